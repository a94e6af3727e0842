"""Samplers, logits processors and log-probabilities in the engine, baseline and joint, on tiny
random models: per-row processors, exact greedy joint == baseline under them, seeded
reproduction alone and concurrently, and the greedy floor."""

from __future__ import annotations

import math

import pytest

from joint_fixtures import load_pair
from protocol import messages as m
from worker.engine import Engine, EngineConfig, RequestError

PROMPTS = ("tell me a story", "hello world", "one two three four")
PROCESSED = {"repetition_penalty": 1.3, "presence_penalty": 0.7, "frequency_penalty": 0.4,
             "logit_bias": {"5": 4.0, "17": -3.0}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A hybrid target (attention plus recurrent state) and a perturbed draft of it."""
    return load_pair(tmp_path_factory.mktemp("sampling"), "qwen3_5+qwen3_5")


def req(text: str, **kw) -> m.GenerateRequest:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 16)
    return m.GenerateRequest(messages=[m.Message("user", text)], ignore_eos=True, **kw)


def run(engine: Engine, reqs: dict[str, m.GenerateRequest]) -> dict[str, tuple[list[int], list]]:
    out = {k: ([], []) for k in reqs}
    for k, r in reqs.items():
        engine.submit(k, r)
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, m.TextDelta):
                out[ev.request_id][0].extend(ev.token_ids)
                out[ev.request_id][1].extend(ev.logprobs or [])
            elif isinstance(ev, m.Error):
                raise AssertionError(ev.message)
    return out


@pytest.mark.parametrize("budget", [0, 3, None])
def test_greedy_joint_equals_baseline_under_processors(pair, budget):
    """Penalties and logit_bias on every verify position: joint greedy output (batched verifies,
    pipelined plain cycles at k = 0, adaptive) is the baseline's token for token, and so are the
    log-probabilities of the emitted tokens."""
    base = run(Engine(pair.target, EngineConfig()),
               {t: req(t, logprobs=True, top_logprobs=2, **PROCESSED) for t in PROMPTS})
    plain = run(Engine(pair.target, EngineConfig()), {t: req(t) for t in PROMPTS})
    assert any(base[t][0] != plain[t][0] for t in PROMPTS)  # the processors change the output
    joint = run(Engine(pair.target, EngineConfig(draft_budget=budget), pair.drafts["perturbed"]),
                {t: req(t, mode="joint", logprobs=True, top_logprobs=2, **PROCESSED) for t in PROMPTS})
    for t in PROMPTS:
        assert joint[t][0] == base[t][0]
        assert len(joint[t][1]) == len(base[t][1]) == 16
        for j, b in zip(joint[t][1], base[t][1]):
            assert (j.token, [x.token for x in j.top_logprobs]) == (b.token, [x.token for x in b.top_logprobs])
            assert math.isclose(j.logprob, b.logprob, abs_tol=1e-4)
            assert j.logprob == pytest.approx(j.top_logprobs[0].logprob, abs=1e-6)  # greedy: the best one


def test_logit_bias_forces_a_token(pair):
    out = run(Engine(pair.target, EngineConfig()), {"a": req("hello", logit_bias={"7": 100.0}, max_tokens=5)})
    assert out["a"][0] == [7] * 5


@pytest.mark.parametrize("mode", ["baseline", "joint"])
def test_seeded_truncated_sampling_reproduces_alone_and_concurrently(pair, mode):
    """top_k, min_p and penalties with a seed: the same tokens alone, again, and beside others."""
    fields = dict(temperature=1.3, top_k=20, min_p=0.02, top_p=0.95, seed=11, mode=mode, **PROCESSED)

    def engine():
        return Engine(pair.target, EngineConfig(draft_budget=2), pair.drafts["perturbed"])

    alone = run(engine(), {"a": req("once upon a time", **fields)})["a"][0]
    again = run(engine(), {"a": req("once upon a time", **fields)})["a"][0]
    # beside other requests of the batch (joint: baseline ones; a joint request verified in one
    # forward with other joint requests gets padded shapes, whose rounding can flip a sampled
    # token: docs/design.md, "Samplers, log-probabilities and request defaults")
    others = {f"o{i}": req(t, temperature=1.0, seed=i) for i, t in enumerate(PROMPTS)}
    crowd = run(engine(), {"a": req("once upon a time", **fields), **others})["a"][0]
    assert alone == again == crowd
    other_seed = run(engine(), {"a": req("once upon a time", **{**fields, "seed": 12})})["a"][0]
    assert other_seed != alone


def test_temperature_under_the_floor_is_greedy(pair):
    eng = Engine(pair.target, EngineConfig())
    out = run(eng, {"floor": req("hello world", temperature=1e-6, seed=None), "zero": req("hello world")})
    assert out["floor"][0] == out["zero"][0]


def test_out_of_vocabulary_token_ids_are_refused(pair):
    eng = Engine(pair.target, EngineConfig())
    with pytest.raises(RequestError) as e:
        eng.submit("a", req("hi", logit_bias={"999999": 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(RequestError) as e:
        eng.submit("b", m.GenerateRequest(prompt=[1, 2, 999999], max_tokens=2))
    assert (e.value.code, e.value.param) == ("invalid_prompt", "prompt")


def test_defaults_fill_omitted_fields(pair):
    """A request that omits temperature gets the server's default (here greedy)."""
    eng = Engine(pair.target, EngineConfig(defaults=m.SamplingDefaults(temperature=0.0, top_k=3, source="flags")))
    r = m.GenerateRequest(messages=[m.Message("user", "hello")], max_tokens=6, ignore_eos=True)
    out = run(eng, {"a": r, "b": req("hello", max_tokens=6)})
    assert (r.temperature, r.top_k) == (0.0, 3)
    assert out["a"][0] == out["b"][0]


def test_request_defaults_come_from_flags_then_the_model(tmp_path):
    """Each field falls back on its own: flags, generation_config.json, the embedded card, OpenAI."""
    from worker.defaults import resolve

    assert resolve("embedded", {}) == m.SamplingDefaults(temperature=0.2, top_p=0.9, source="model_card")
    both = resolve("embedded", {"temperature": 0.0, "top_k": 5}, max_tokens=64)
    assert (both.temperature, both.top_p, both.top_k, both.max_tokens, both.source) == (0.0, 0.9, 5, 64, "flags+model_card")
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true}')
    folder = resolve(str(tmp_path), {"min_p": 0.1})
    assert (folder.temperature, folder.top_p, folder.top_k, folder.min_p) == (0.6, 0.95, 20, 0.1)
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert resolve(str(tmp_path), {}).temperature == 0.0  # do_sample false: greedy
    assert resolve(str(tmp_path / "none"), {}) == m.SamplingDefaults()
