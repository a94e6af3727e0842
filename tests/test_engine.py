"""The engine in-process on a tiny random llama loaded through the real loader."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from protocol import messages as m
from worker.engine import Engine, EngineConfig, RequestError
from worker.text import StopMatcher, StreamingDetokenizer, render_prompt


def chat(text: str, **kw) -> m.GenerateRequest:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 12)
    return m.GenerateRequest(messages=[m.Message("user", text)], **kw)


def run(engine: Engine, reqs: dict[str, m.GenerateRequest]) -> dict[str, dict]:
    out = {k: {"text": "", "tokens": [], "finished": None} for k in reqs}
    for k, r in reqs.items():
        engine.submit(k, r)
    while engine.has_work():
        assert engine.active_count() <= engine.config.max_active
        for ev in engine.step():
            o = out[ev.request_id]
            if isinstance(ev, m.TextDelta):
                o["text"] += ev.text
                o["tokens"] += ev.token_ids
            elif isinstance(ev, (m.Finished, m.Error)):
                o["finished"] = ev
    return out


def reference_greedy(lm, req: m.GenerateRequest, n: int) -> list[int]:
    prompt = mx.array(render_prompt(lm.tokenizer, req))
    return [t for t, _ in zip((t for t, _ in generate_step(prompt, lm.model, max_tokens=n)), range(n))]


@pytest.fixture
def engine(tiny_llama_lm):
    return Engine(tiny_llama_lm, EngineConfig(max_active=2))


PROMPTS = ["the quick brown fox", "hello world", "once upon a time", "one two three four"]


def test_greedy_matches_mlx_lm(engine, tiny_llama_lm):
    reqs = {p: chat(p, max_tokens=10, ignore_eos=True) for p in PROMPTS}
    out = run(engine, reqs)
    for p, r in reqs.items():
        assert out[p]["tokens"] == reference_greedy(tiny_llama_lm, r, 10)
        assert out[p]["finished"].finish_reason == "length"
        assert out[p]["finished"].metrics.completion_tokens == 10


def test_concurrent_requests_do_not_mix(engine, tiny_llama_lm):
    reqs = {f"r{i}": chat(p, max_tokens=8, ignore_eos=True) for i, p in enumerate(PROMPTS)}
    together = run(engine, reqs)
    for k, r in reqs.items():
        alone = run(Engine(tiny_llama_lm, EngineConfig(max_active=1)), {k: r})
        assert together[k]["tokens"] == alone[k]["tokens"]


def test_seeded_sampling_is_reproducible_under_concurrency(engine, tiny_llama_lm):
    r = chat("hello world", temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run(engine, {"a": r})["a"]["tokens"]
    noisy = {"a": r, "b": chat("other", temperature=1.0, max_tokens=12), "c": chat("x y", temperature=0.7, seed=5)}
    assert run(engine, noisy)["a"]["tokens"] == alone
    other_seed = chat("hello world", temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert run(engine, {"d": other_seed})["d"]["tokens"] != alone


def test_fifo_order_and_bound(tiny_llama_lm):
    eng = Engine(tiny_llama_lm, EngineConfig(max_active=2))
    for i in range(5):
        eng.submit(f"r{i}", chat(PROMPTS[i % 4], max_tokens=3))
    started = []
    while eng.has_work():
        started += [e.request_id for e in eng.step() if isinstance(e, m.Started)]
        assert eng.active_count() <= 2
    assert started == [f"r{i}" for i in range(5)]


def test_stop_string_truncates(engine):
    base = run(engine, {"a": chat("hello world", max_tokens=16, ignore_eos=True)})["a"]["text"]
    assert len(base) > 6
    stop = base[3:6]
    out = run(engine, {"b": chat("hello world", max_tokens=16, ignore_eos=True, stop=[stop])})["b"]
    assert out["finished"].finish_reason == "stop"
    assert out["text"] == base[: base.index(stop)]


def test_cancel_active_and_waiting(tiny_llama_lm):
    eng = Engine(tiny_llama_lm, EngineConfig(max_active=1))
    eng.submit("run", chat("hello", max_tokens=500, ignore_eos=True))
    eng.submit("wait", chat("hello", max_tokens=5))
    eng.step()
    eng.step()
    eng.cancel("run")
    eng.cancel("wait")
    finished = {}
    while eng.has_work():
        finished.update({e.request_id: e for e in eng.step() if isinstance(e, m.Finished)})
    assert {k: v.finish_reason for k, v in finished.items()} == {"run": "cancelled", "wait": "cancelled"}
    assert finished["run"].metrics.completion_tokens < 500
    assert eng.active_count() == 0 and not eng.has_work()


def test_refusals(tiny_llama_lm):
    eng = Engine(tiny_llama_lm, EngineConfig(max_active=1, max_waiting=1))
    with pytest.raises(RequestError) as e:
        eng.submit("j", chat("x", mode="joint"))
    assert e.value.param == "mode" and "draft" in e.value.message
    with pytest.raises(RequestError) as e:
        eng.submit("long", m.GenerateRequest(prompt="word " * tiny_llama_lm.context_limit, max_tokens=1))
    assert e.value.code == "context_length_exceeded" and str(tiny_llama_lm.context_limit) in e.value.message
    eng.submit("a", chat("x"))
    with pytest.raises(RequestError) as e:
        eng.submit("b", chat("x"))
    assert e.value.status == 429


def test_metrics(engine):
    f = run(engine, {"a": chat("hello world", max_tokens=6, ignore_eos=True)})["a"]["finished"]
    assert f.metrics.mode == "baseline" and f.metrics.draft is None
    assert f.metrics.prompt_tokens > 3 and f.metrics.completion_tokens == 6
    assert f.metrics.ttft_s > 0 and f.metrics.decode_tps > 0


def test_streaming_detokenizer_never_splits_utf8(tiny_llama_lm):
    tok = tiny_llama_lm.tokenizer
    text = " café ünïcödé 😀 日本語 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    d = StreamingDetokenizer(tok, [])
    pieces = [d.add(i) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


def test_stop_matcher_holds_back_only_possible_starts():
    s = StopMatcher(["END", "xy"])
    assert s.feed("abcE") == ("abc", False)
    assert s.feed("Nd") == ("ENd", False)
    assert s.feed("fooEN") == ("foo", False)
    assert s.feed("D tail") == ("", True)
    s = StopMatcher(["xy"])
    assert s.feed("ax") == ("a", False)
    assert s.flush() == "x"
    assert StopMatcher(None).feed("anything") == ("anything", False)


def test_mlx_releases_outside_the_tested_range_are_named(monkeypatch):
    """pyproject.toml takes a range of MLX and mlx-lm releases; a release outside the tested ones
    loads with a warning naming it."""
    import importlib.metadata

    from worker import loader

    assert loader.untested_versions() == []  # what the tests run on is tested
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"mlx": "0.32.9", "mlx-lm": "0.34.0"}[name])
    assert loader.untested_versions() == ["mlx-lm 0.34.0"]
