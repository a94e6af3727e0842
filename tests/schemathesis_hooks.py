"""schemathesis hooks for tests/test_bad_input.py (loaded through SCHEMATHESIS_HOOKS).

valid_requests_are_served replaces schemathesis's positive_data_acceptance: a request generated
as valid by /openapi.json must get 200, or a 400 for one of the rules that the description can
only state in words (JSON Schema cannot count tokens, compare two fields, or tell 5 from 5.0).
"""

import re

import schemathesis

UNSTATABLE = {"context_length_exceeded", "invalid_prompt", "invalid_schema", "invalid_tools",
              "invalid_token_id", "too_many_choices", "integer_out_of_range",  # tokens; schemas a grammar enforces; names across fields
              "conflicting_thinking_controls", "prompt_or_messages",  # fields that must agree
              "prefill_unsupported"}  # /v1/messages: a last assistant turn


@schemathesis.check
def valid_requests_are_served(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or case.method != "POST":
        return None
    if response.status_code == 200 or (response.status_code == 404 and case.path.endswith("/cancel")):
        return None  # a made-up id is never running
    code = None
    if response.status_code in (400, 404):
        try:
            code = response.json()["error"]["code"]
        except Exception:
            pass
    if code in UNSTATABLE:
        return None
    if response.status_code in (400, 404) and code in ("response_not_found", "response_not_running"):
        return None  # a response id the description cannot know: unknown, evicted, or ended
    text = response.text
    if code == "invalid_request" and ("max_completion_tokens" in text  # both given, and different
                                      or re.search(r"Expected `[^`]*\bint\b", text) and "got `float`" in text):  # 5.0 for 5
        return None
    raise AssertionError(f"a request valid by /openapi.json got {response.status_code}: {response.text[:500]}")
