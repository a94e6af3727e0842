"""Continuous batching of baseline requests: each request's output in a batch, with others joining,
leaving and being cancelled mid-stream, is the output it has alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from bench.tiny_models import tiny_model_dir
from protocol import messages as m
from worker.engine import Engine, EngineConfig
from worker.loader import load_model
from worker.text import render_prompt

NEAR_TIE = 1e-3  # a divergence is tolerated only where the target's top two logits differ less
PROMPTS = ["the quick brown fox", "hello world", "once upon a time " * 6, "one two three four",
           "tell me a story about the sea " * 3, "hi", "a b c d e f g h", "why is the sky blue"]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def lm(request, tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory, request.param, seed=3)))


def chat(text: str, n: int, **kw) -> m.GenerateRequest:
    kw.setdefault("temperature", 0.0)
    return m.GenerateRequest(messages=[m.Message("user", text)], max_tokens=n, ignore_eos=True, **kw)


def drive(engine: Engine, arrivals: dict[int, list[tuple[str, m.GenerateRequest]]],
          cancels: dict[int, list[str]] | None = None) -> dict[str, list[int]]:
    """Steps the engine, submitting and cancelling at the given steps; each request's tokens."""
    out: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in arrivals):
        for rid, req in arrivals.get(step, []):
            engine.submit(rid, req)
            out[rid] = []
        for rid in (cancels or {}).get(step, []):
            engine.cancel(rid)
        for ev in engine.step():
            if isinstance(ev, m.TextDelta):
                out[ev.request_id] += ev.token_ids
            assert not isinstance(ev, m.Error), ev
        step += 1
    return out


def alone(lm, req: m.GenerateRequest) -> list[int]:
    return drive(Engine(lm, EngineConfig(max_active=1)), {0: [("x", req)]})["x"]


def divergences_off_near_ties(lm, req: m.GenerateRequest, got: list[int], want: list[int]) -> int:
    """Divergences (at most one a request: after it the texts differ) where the top two logits
    of the request alone differ by more than NEAR_TIE."""
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return 0
    prompt = render_prompt(lm.tokenizer, req) + want[:i]
    logits = lm.model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    top2 = mx.sort(logits)[-2:].tolist()
    return int(top2[1] - top2[0] >= NEAR_TIE)


def test_batched_greedy_equals_alone_with_requests_joining_and_leaving(lm):
    reqs = {f"r{i}": chat(p, 10 + 3 * i) for i, p in enumerate(PROMPTS)}
    arrivals = {0: [("r0", reqs["r0"]), ("r1", reqs["r1"])], 2: [("r2", reqs["r2"])], 3: [("r3", reqs["r3"])],
                7: [("r4", reqs["r4"]), ("r5", reqs["r5"])], 11: [("r6", reqs["r6"])], 16: [("r7", reqs["r7"])]}
    got = drive(Engine(lm, EngineConfig(max_active=8, prefill_step=16)), arrivals)
    for rid, req in reqs.items():
        want = alone(lm, req)
        assert len(got[rid]) == req.max_tokens
        assert divergences_off_near_ties(lm, req, got[rid], want) == 0, (rid, got[rid], want)


def test_a_cancel_in_a_batch_of_8_leaves_the_other_7_as_they_were(lm):
    reqs = [(f"r{i}", chat(p, 16)) for i, p in enumerate(PROMPTS)]
    undisturbed = drive(Engine(lm, EngineConfig(max_active=8)), {0: reqs})
    cancelled = drive(Engine(lm, EngineConfig(max_active=8)), {0: reqs}, cancels={6: ["r3"]})
    assert len(cancelled["r3"]) < 16
    assert {k: v for k, v in cancelled.items() if k != "r3"} == {k: v for k, v in undisturbed.items() if k != "r3"}


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(lm):
    seeded = chat("once upon a time", 16, temperature=0.9, top_p=0.95, seed=1234)
    others = [(f"o{i}", chat(p, 12, temperature=1.0)) for i, p in enumerate(PROMPTS[:5])]
    in_batch = drive(Engine(lm, EngineConfig(max_active=8)), {0: others[:2] + [("s", seeded)], 1: others[2:]})["s"]
    assert in_batch == alone(lm, seeded)


def test_rows_never_exceed_max_active_and_the_rest_wait(lm):
    engine = Engine(lm, EngineConfig(max_active=3))
    for i, p in enumerate(PROMPTS):
        engine.submit(f"r{i}", chat(p, 6))
    finished = set()
    while engine.has_work():
        assert engine.active_count() <= 3
        finished |= {e.request_id for e in engine.step() if isinstance(e, m.Finished)}
    assert finished == {f"r{i}" for i in range(len(PROMPTS))}


class CountingModel:
    """The model, with the input shape of every forward recorded."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.shapes.append(tuple(inputs.shape))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_every_decoding_request_is_in_one_forward_a_round(lm):
    import dataclasses

    counting = CountingModel(lm.model)
    engine = Engine(dataclasses.replace(lm, model=counting), EngineConfig(max_active=4))
    for i, p in enumerate(PROMPTS[:4]):
        engine.submit(f"r{i}", chat(p, 40))
    tokens = 0
    while tokens < 4 * 10:  # past every prefill: all four rows decode
        tokens += sum(len(e.token_ids) for e in engine.step() if isinstance(e, m.TextDelta))
    counting.shapes.clear()
    events = engine.step()
    assert counting.shapes == [(4, 1)]  # one forward, four rows of one token
    assert sorted(e.request_id for e in events if isinstance(e, m.TextDelta)) == ["r0", "r1", "r2", "r3"]


def test_admission_waits_for_room_in_the_kv_budget_and_refuses_what_never_fits(lm):
    from worker.engine import RequestError

    probe = Engine(lm, EngineConfig(max_active=8))
    req = chat("hello world", 20)
    need = probe._worst_case(req, render_prompt(lm.tokenizer, req))
    engine = Engine(lm, EngineConfig(max_active=8, kv_budget=2 * need + need // 2))  # room for two
    for i in range(5):
        engine.submit(f"r{i}", req)
    finished = set()
    while engine.has_work():
        assert engine.active_count() <= 2
        finished |= {e.request_id for e in engine.step() if isinstance(e, m.Finished)}
    assert finished == {f"r{i}" for i in range(5)}
    with pytest.raises(RequestError) as e:
        engine.submit("big", chat("hello world", 200))
    assert e.value.code == "kv_budget_exceeded" and "--kv-budget" in e.value.message
