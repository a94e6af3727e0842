"""The context policy over HTTP on a real stack: --max-context below the model's limit,
--context-overflow truncate-middle as the server's default and `context_overflow` per request
(refuse names the limit; truncate-middle keeps the system message and the latest turns and says
what it dropped; rolling decodes past the limit as mlx-lm's RotatingKVCache and is refused by name
for hybrid models), with prefix reuse exact under each."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from bench.tiny_models import tiny_model_dir
from protocol.messages import GenerateRequest, Message
from stack import Stack
from worker.loader import load_model
from worker.text import render_prompt

LIMIT = 160
SYSTEM = {"role": "system", "content": "You are brief."}
TURNS = [{"role": "user" if i % 2 == 0 else "assistant",
          "content": f"turn {i}: the quick brown fox jumps over the lazy dog {i}"} for i in range(12)]
LAST = {"role": "user", "content": "What is the capital of France?"}


def post(url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(url: str, messages: list, **kw) -> tuple[int, dict]:
    return post(url, {"messages": messages, "temperature": 0, "max_tokens": 8, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with Stack(str(tiny_llama), "--max-context", str(LIMIT), "--context-overflow", "truncate-middle") as s:
        yield s
    assert s.exit_code == 0, s.log()


def test_info_reports_the_bounded_context(stack):
    with urllib.request.urlopen(stack.url + "/v1/verity/info", timeout=10) as r:
        assert json.loads(r.read())["context_limit"] == LIMIT


def test_truncate_middle_keeps_system_and_latest_turns_and_reuse_stays_exact(stack):
    conversation = [SYSTEM, *TURNS, LAST]
    status, cut = chat(stack.url, conversation)  # the server's default policy
    assert status == 200, cut
    dropped = cut["metrics"]["dropped_messages"]
    assert 0 < dropped < len(TURNS) and cut["metrics"]["dropped_tokens"] > 0
    assert cut["usage"]["prompt_tokens"] + 8 <= LIMIT
    kept = [SYSTEM, *TURNS[dropped:], LAST]  # the oldest middle turns went, whole
    status, same = chat(stack.url, kept, context_overflow="refuse")
    assert status == 200 and same["metrics"]["dropped_messages"] == 0
    assert same["usage"]["prompt_tokens"] == cut["usage"]["prompt_tokens"]
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # reused the truncated prompt's state
    assert same["choices"][0]["message"]["content"] == cut["choices"][0]["message"]["content"]
    status, again = chat(stack.url, conversation, stream=False)
    assert status == 200 and again["choices"][0]["message"]["content"] == cut["choices"][0]["message"]["content"]
    assert again["metrics"]["dropped_messages"] == dropped


def test_refuse_per_request_names_the_limit(stack):
    status, body = chat(stack.url, [SYSTEM, *TURNS * 3, LAST], context_overflow="refuse")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert str(LIMIT) in body["error"]["message"] and body["error"]["param"] == "messages"
    status, fits = chat(stack.url, [SYSTEM, LAST], context_overflow="refuse")  # what fits is served as it is
    assert status == 200 and fits["metrics"]["dropped_messages"] == 0


def test_what_cannot_be_truncated_is_refused_by_name(stack):
    status, body = chat(stack.url, [SYSTEM, {"role": "user", "content": "fox " * 400}])
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and str(LIMIT) in body["error"]["message"]
    status, body = post(stack.url, {"prompt": "fox " * 400, "max_tokens": 4}, "/v1/completions")  # no messages to drop
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def rolling_reference(lm, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of mlx-lm's own RotatingKVCache(max_size=LIMIT, keep=4), one forward a token."""
    cache = [RotatingKVCache(max_size=LIMIT, keep=4) for _ in lm.model.layers]
    logits, out = lm.model(mx.array([prompt]), cache=cache)[:, -1], []
    for _ in range(n):
        out.append(int(mx.argmax(logits, -1).item()))
        logits = lm.model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out


def test_rolling_decodes_past_the_limit_as_a_rotating_cache(stack, tiny_llama_lm):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    status, refused = chat(stack.url, messages, max_tokens=200, context_overflow="refuse")
    assert status == 200 and refused["choices"][0]["finish_reason"] == "length"
    prompt_tokens = refused["usage"]["prompt_tokens"]
    assert refused["usage"]["completion_tokens"] == LIMIT - prompt_tokens  # today's: it ends at the context's end
    status, rolled = chat(stack.url, messages, max_tokens=200, context_overflow="rolling")
    assert status == 200 and rolled["usage"]["completion_tokens"] == 200  # past the limit of 160
    text = rolled["choices"][0]["message"]["content"]
    assert text.startswith(refused["choices"][0]["message"]["content"])  # the same until the window moves
    prompt = render_prompt(tiny_llama_lm.tokenizer, GenerateRequest(messages=[Message(**x) for x in messages]))
    assert len(prompt) == prompt_tokens
    assert text == tiny_llama_lm.tokenizer.decode(rolling_reference(tiny_llama_lm, prompt, 200))
    status, again = chat(stack.url, messages, max_tokens=200, context_overflow="rolling")  # its prefix reused
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and again["choices"][0]["message"]["content"] == text


def test_unknown_policies_are_refused_by_name(stack):
    status, body = chat(stack.url, [SYSTEM, LAST], context_overflow="drop-everything")
    assert status == 400 and "context_overflow" in body["error"]["message"]


def test_rolling_is_refused_by_name_for_a_hybrid_model(tmp_path_factory):
    from worker.engine import Engine, EngineConfig, RequestError

    lm = load_model(str(tiny_model_dir(tmp_path_factory, "qwen3_5", seed=0)))
    req = GenerateRequest(messages=[Message("user", "hello")], max_tokens=4, context_overflow="rolling")
    with pytest.raises(RequestError) as e:
        Engine(lm, EngineConfig(max_context=64)).submit("r", req)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_policy_unsupported", "context_overflow")
    assert "rolling" in e.value.message and "hybrid" in e.value.message


@pytest.mark.parametrize("arch, flags, says", [
    ("llama", ("--max-context", "100000"), "outside [2, 2048]"),
    ("qwen3_5", ("--context-overflow", "rolling"), "not supported for this model")])
def test_a_context_the_server_cannot_give_stops_the_start(tmp_path_factory, arch, flags, says):
    model = tiny_model_dir(tmp_path_factory, arch, seed=0)
    run = subprocess.run([sys.executable, "-m", "cli.launch", "--model", str(model), "--port", "0", "--cache-bytes", "0",
                          *flags], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and says in run.stderr, run.stderr[-2000:]
