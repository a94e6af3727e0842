"""Thinking models in the worker (worker/thinking.py): detection from the template and tokenizer,
where a generation starts, and the think block's budget in baseline and joint rows; and the
gateway's streaming split (gateway/reasoning.py)."""

from __future__ import annotations

import json
import random

import pytest

from bench.tiny_models import THINKING_TEMPLATE, build_tiny_model
from gateway.reasoning import Parts, ReasoningSplit, split
from protocol import messages as m
from protocol.schema import RequestInvalid, parse_request
from worker import thinking
from worker.engine import Engine, EngineConfig
from worker.loader import load_model
from worker.text import render_prompt

BUDGET = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny qwen3_5 with Qwen3.5's thinking template, a perturbed draft of it, and the plain
    qwen3_5 (whose template lets the model write `<think>` itself) and llama (no thinking)."""
    root = tmp_path_factory.mktemp("thinking")
    target = build_tiny_model(root / "target", "qwen3_5", seed=0, chat_template=THINKING_TEMPLATE)
    draft = build_tiny_model(root / "draft", "qwen3_5", seed=1, perturb_from=target, noise=0.3)
    plain = build_tiny_model(root / "plain", "qwen3_5", seed=0)
    llama = build_tiny_model(root / "llama", "llama", seed=0)
    return {name: load_model(str(p)) for name, p in
            (("target", target), ("draft", draft), ("plain", plain), ("llama", llama))}


def ask(text: str, n: int = 24, **kw) -> m.GenerateRequest:
    kw = {"temperature": 0.0, "ignore_eos": True, **kw}
    return m.GenerateRequest(messages=[m.Message("user", text)], max_tokens=n, **kw)


def run(engine: Engine, reqs: dict[str, m.GenerateRequest]) -> tuple[dict[str, list[int]], dict[str, m.Queued]]:
    queued = {rid: engine.queue(rid, req) for rid, req in reqs.items()}
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    while engine.has_work():
        for ev in engine.step():
            assert not isinstance(ev, m.Error), ev
            if isinstance(ev, m.TextDelta):
                out[ev.request_id] += ev.token_ids
    return out, queued


def test_the_template_and_tokenizer_say_whether_a_model_thinks(models):
    fmt = thinking.detect(models["target"].tokenizer, models["target"].chat_template)
    vocab = models["target"].tokenizer.get_vocab()
    assert fmt == thinking.ThinkFormat(vocab["<think>"], vocab["</think>"],
                                       tuple(models["target"].tokenizer.encode("\n\n", add_special_tokens=False)), True)
    plain = thinking.detect(models["plain"].tokenizer, models["plain"].chat_template)
    assert plain is not None and not plain.opens_in_prompt
    assert thinking.detect(models["llama"].tokenizer, models["llama"].chat_template) is None
    tok = models["target"].tokenizer
    assert thinking.starts_inside(fmt, render_prompt(tok, ask("hi")))
    assert not thinking.starts_inside(fmt, render_prompt(tok, ask("hi", thinking=False)))
    assert not thinking.starts_inside(plain, render_prompt(models["plain"].tokenizer, ask("hi")))


def test_the_budget_closes_the_block_alike_in_baseline_and_joint_rows(models):
    """After BUDGET tokens inside the block: `</think>`, the separator, then the answer; a joint
    row (drafting or not) gives the baseline row's tokens exactly, batched with others."""
    lm, fmt = models["target"], None
    fmt = thinking.detect(lm.tokenizer, lm.chat_template)
    engine = Engine(lm, EngineConfig(max_active=8, draft_budget=2), models["draft"])
    reqs = {"base": ask("hello world", max_thinking_tokens=BUDGET),
            "joint": ask("hello world", max_thinking_tokens=BUDGET, mode="joint"),
            "other": ask("the quick brown fox", mode="joint"),
            "zero": ask("hello world", max_thinking_tokens=0),
            "off": ask("hello world", thinking=False, max_thinking_tokens=0)}
    out, queued = run(engine, reqs)
    assert queued["base"].thinking and queued["joint"].thinking and not queued["off"].thinking
    closed = [fmt.close_id, *fmt.separator]
    assert out["base"][BUDGET:BUDGET + len(closed)] == closed and fmt.close_id not in out["base"][:BUDGET]
    assert out["joint"] == out["base"]
    assert out["zero"][:len(closed)] == closed
    assert fmt.close_id not in out["other"]  # no budget: the random model never closes it itself
    assert fmt.close_id not in out["off"]  # thinking off: the prompt closed the block already


def test_the_worker_default_budget_and_a_request_that_overrides_it(models):
    engine = Engine(models["target"], EngineConfig(max_active=4, max_thinking_tokens=3))
    fmt = engine.think
    out, _ = run(engine, {"default": ask("hi"), "more": ask("hi", max_thinking_tokens=5)})
    assert out["default"][3] == fmt.close_id and out["more"][5] == fmt.close_id


def test_a_grammar_constrains_the_answer_after_free_thinking(models):
    """json_object: the think block is free text (closed by the budget), the answer parses."""
    engine = Engine(models["target"], EngineConfig(max_active=4), models["draft"])
    rf = m.ResponseFormat("json_object")
    reqs = {"base": ask("hello", 60, max_thinking_tokens=BUDGET, response_format=rf, ignore_eos=False),
            "joint": ask("hello", 60, max_thinking_tokens=BUDGET, response_format=rf, ignore_eos=False, mode="joint")}
    out, _ = run(engine, reqs)
    text = models["target"].tokenizer.decode(out["base"])
    parts = split(text, True)
    assert len(models["target"].tokenizer.encode(parts.reasoning, add_special_tokens=False)) >= 1
    assert isinstance(json.loads(parts.content.replace("<|im_end|>", "")), dict)
    assert out["joint"] == out["base"]


def test_the_thinking_controls_resolve_to_one_field():
    def parse(**kw) -> m.GenerateRequest:
        return parse_request(json.dumps({"messages": [{"role": "user", "content": "x"}], **kw}).encode(), "chat")

    assert parse().thinking is None
    assert parse(reasoning_effort="none").thinking is False and parse(reasoning_effort="minimal").thinking is False
    assert parse(reasoning_effort="high").thinking is True
    assert parse(chat_template_kwargs={"enable_thinking": False}).thinking is False
    assert parse(thinking=True, reasoning_effort="low").thinking is True
    for kw, param in (({"thinking": True, "reasoning_effort": "none"}, "reasoning_effort"),
                      ({"chat_template_kwargs": {"other": 1}}, "chat_template_kwargs.other"),
                      ({"reasoning_effort": "max"}, "reasoning_effort"),
                      ({"max_thinking_tokens": -1}, "max_thinking_tokens")):
        with pytest.raises(RequestInvalid) as e:
            parse(**kw)
        assert e.value.param == param, kw


@pytest.mark.parametrize("text,inside,want", [
    ("plan it</think>\n\nthe answer", True, Parts("plan it", "the answer")),
    ("<think>\nplan it</think>\n\nthe answer", False, Parts("plan it", "the answer")),
    ("  no thinking here", False, Parts("", "  no thinking here")),
    ("cut short </thi", True, Parts("cut short </thi", "")),
    ("\n<think>a</think>b <think>c</think>", False, Parts("a", "b <think>c</think>")),
    ("<thi", False, Parts("", "<thi")),
])
def test_the_split_is_the_same_whole_and_in_any_chunks(text, inside, want):
    assert split(text, inside) == want
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        s, got, prev = ReasoningSplit(inside), Parts(), 0
        for c in cuts + [len(text)]:
            got, prev = got + s.feed(text[prev:c]), c
        assert got + s.finish() == want
