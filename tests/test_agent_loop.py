"""Prefix reuse in an agent's loop over chat completions, on a real stack: a tool-using conversation
(bench/agent_script.py) where each request resends everything, the model's own answers included,
reuses ≥ 90% of its prompt from the third request, each answer is reused whole by the next request,
and the answers equal those of a stack with the cache off (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from bench.agent_apis import ChatClient
from bench.agent_loop import loop, tokens_per_char
from bench.agent_script import opening
from bench.tiny_models import THINKING_TEMPLATE, tiny_model_dir
from protocol import messages as m
from stack import Stack
from worker.text import message_boundaries, render_prompt

# pure attention; hybrid (recurrent state: exact snapshots only); hybrid with Qwen3.5's thinking
# generation prompt (the answer resent without its think block, the template rendering it anew)
MODELS = ("llama", "qwen3_5", "qwen3_5-thinking")
PREFIX_TOKENS = 1500  # the system prompt, about
MAX_TOKENS = 64
NEAR_TIE = 1e-3
THINKING = ("--max-thinking-tokens", "8")  # the think block closed early: room for the call after it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {arch: tiny_model_dir(tmp_path_factory, arch, seed=0, max_position_embeddings=8192) for arch in MODELS[:2]}
    out["qwen3_5-thinking"] = tiny_model_dir(tmp_path_factory, "qwen3_5", seed=0, max_position_embeddings=8192,
                                             chat_template=THINKING_TEMPLATE)
    return out


def request_of(client: ChatClient, items, tool_choice: str) -> m.GenerateRequest:
    """The chat body the bench sent, as the worker's request (what its prompt is rendered from)."""
    body = client.body(items, tool_choice)
    keep = ("messages", "tools", "tool_choice", "parallel_tool_calls")
    return msgspec.convert({k: body[k] for k in keep}, m.GenerateRequest)


def answer(t) -> tuple:
    """A turn's answer: its text and calls (their ids are each stack's own)."""
    return t.text, [(c.name, c.arguments) for c in t.calls]


def near_tie(got: list[dict], ref: list[dict]) -> bool:
    """The first token where two greedy answers part is one where the reference's top two
    log-probabilities (its logits less one constant) are within NEAR_TIE."""
    i = next(i for i, (a, b) in enumerate(zip(got + [{}], ref + [{}])) if a.get("bytes") != b.get("bytes"))
    top = ref[i]["top_logprobs"] if i < len(ref) else []
    return len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE


def answer_end(tokenizer, req: m.GenerateRequest) -> int:
    """Tokens of the conversation up to the end of its next-to-last message (the previous answer)."""
    return message_boundaries(tokenizer, req, render_prompt(tokenizer, req))[-2]


@pytest.mark.parametrize("model", MODELS)
def test_agent_loop_reuses_prompt_and_answers_exactly(models, model):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(models[model])
    flags, n = (THINKING, MAX_TOKENS + 32) if model.endswith("thinking") else ((), MAX_TOKENS)
    with Stack(str(models[model]), *flags) as s, Stack(str(models[model]), *flags, "--cache-bytes", "0") as off:
        client = ChatClient(s.url, n, top_logprobs=2)
        sent, live, cold = loop(client, ChatClient(off.url, n, top_logprobs=2),
                                opening(PREFIX_TOKENS, tokens_per_char(s.url)))
    assert s.exit_code == 0 and off.exit_code == 0
    # a cache service that misses its answer deadline on a loaded machine leaves a request (and the
    # snapshot its answer would have kept) without reuse, by design: only those turns may fall short
    slow = s.log().count("the cache service did not answer within")
    shares = [t.cached_tokens / t.prompt_tokens for t in live]
    assert shares[0] < 0.05, shares  # a fresh system prompt
    short = [n for n in range(2, len(live)) if shares[n] < 0.90]
    missed = []
    for n in range(1, len(live)):  # the previous answer (a call or text) is reused whole: all but,
        req = request_of(client, *sent[n])  # at most, the separator the template puts after its end token
        assert req.messages[-2].role == "assistant"
        if live[n].cached_tokens < answer_end(tokenizer, req) - 1:
            missed.append(n)
    assert len(short) <= slow and len(missed) <= 2 * slow, (shares, short, missed, slow)
    assert sum(len(t.calls) for t in live) >= 4, "the loop made tool calls"
    # greedy: the same answers, or a divergence at a near tie only (docs/design.md, "Exactness")
    differ = [n for n, (w, c) in enumerate(zip(live, cold)) if answer(w) != answer(c)]
    assert len(differ) <= 1 and all(near_tie(live[n].logprobs, cold[n].logprobs) for n in differ), differ
    assert all(t.cached_tokens == 0 for t in cold)


def test_bench_agent_loop_quick(models):
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "agent-loop", "--model", str(models["llama"]),
                        "--quick", "--api", "all", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "agent-loop"
    for label in ("embedded", "hybrid"):
        for api in ("chat", "messages", "responses"):
            res = figures["models"][label][api]
            assert res["served"] and len(res["turns"]) == 12, (label, api, res)
            assert sum(not t["same_answer"] for t in res["turns"]) <= 1, (label, api, res)  # a near tie at most
            assert all(t["reused"] > 0 and t["cold_reused"] == 0 for t in res["turns"][1:]), (label, api)
    assert "bench agent-loop" in r.stdout
