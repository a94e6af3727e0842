"""Decoding and checking of the one request schema, with errors that name the field."""

from __future__ import annotations

import re
from typing import Literal, Optional

import msgspec

from protocol.messages import GenerateRequest

# OpenAI fields verity does not implement: refused by name, never silently ignored.
UNSUPPORTED_FIELDS = frozenset(
    "tools tool_choice functions function_call parallel_tool_calls response_format logprobs "
    "top_logprobs logit_bias audio modalities prediction service_tier store metadata "
    "reasoning_effort web_search_options best_of echo suffix top_k min_p repetition_penalty".split()
)
MAX_STOP_STRINGS = 4

Endpoint = Literal["chat", "completion"]
_decoder = msgspec.json.Decoder(GenerateRequest)
_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]*)`")


class RequestInvalid(Exception):
    """A request the schema refuses; maps to an OpenAI error object with HTTP 400."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def parse_request(body: bytes, endpoint: Endpoint) -> GenerateRequest:
    """JSON bytes -> a checked, normalized GenerateRequest, or RequestInvalid."""
    try:
        body.decode("utf-8")  # msgspec versions report bad UTF-8 differently: check it first
    except UnicodeDecodeError as e:
        raise RequestInvalid(f"request body is not valid UTF-8: {e.reason} at byte {e.start}", code="invalid_json") from None
    try:
        req = _decoder.decode(body)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise RequestInvalid(f"request body is not valid JSON: {e}", code="invalid_json") from None
    return check_request(req, endpoint)


def _validation_error(text: str) -> RequestInvalid:
    path = _PATH_RE.search(text)
    param = (path.group(1) if path else None) or None
    unknown = _UNKNOWN_RE.match(text)
    if unknown:
        name = unknown.group(1)
        full = f"{param}.{name}" if param else name
        if not param and name in UNSUPPORTED_FIELDS:
            return RequestInvalid(f"`{name}` is not supported by verity", full, "unsupported_parameter")
        return RequestInvalid(f"unknown field `{full}`", full, "unknown_parameter")
    rule = _PATH_RE.sub("", text)
    return RequestInvalid(f"invalid `{param or 'body'}`: {rule}", param)


def check_request(req: GenerateRequest, endpoint: Endpoint) -> GenerateRequest:
    """Rules that span fields or that types cannot say; normalizes max_tokens and stop."""
    if endpoint == "chat":
        if req.prompt is not None:
            raise RequestInvalid("`prompt` belongs to /v1/completions; chat takes `messages`", "prompt")
        if not req.messages:
            raise RequestInvalid("`messages` is required and must not be empty", "messages")
    else:
        if req.messages is not None:
            raise RequestInvalid("`messages` belongs to /v1/chat/completions; completions take `prompt`", "messages")
        if req.prompt is None:
            raise RequestInvalid("`prompt` is required", "prompt")
    a, b = req.max_tokens, req.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise RequestInvalid(
            f"`max_tokens` ({a}) and its alias `max_completion_tokens` ({b}) differ", "max_completion_tokens"
        )
    req.max_tokens, req.max_completion_tokens = (a if a is not None else b), None
    if req.n != 1:
        raise RequestInvalid("`n` > 1 is not supported by verity", "n", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) != 0:
            raise RequestInvalid(f"`{name}` other than 0 is not supported by verity", name, "unsupported_parameter")
    if isinstance(req.stop, str):
        req.stop = [req.stop]
    if req.stop is not None:
        if len(req.stop) > MAX_STOP_STRINGS:
            raise RequestInvalid(f"`stop` takes at most {MAX_STOP_STRINGS} strings", "stop")
        if any(s == "" for s in req.stop):
            raise RequestInvalid("`stop` strings must not be empty", "stop")
    if req.stream_options is not None and not req.stream:
        raise RequestInvalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    return req


def resolve_max_tokens(req: GenerateRequest, cap: int) -> GenerateRequest:
    """Applies the server's cap: a larger explicit value is refused, a missing one gets the cap."""
    if req.max_tokens is None:
        req.max_tokens = cap
    elif req.max_tokens > cap:
        raise RequestInvalid(f"`max_tokens` ({req.max_tokens}) exceeds this server's cap of {cap}", "max_tokens")
    return req
