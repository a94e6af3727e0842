"""The joint path: exactness against baseline, recovery, checkpoints, cancel, rejection sampling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import FULL
from joint_fixtures import (DRAFTS, PAIRS, PROMPTS, baseline_greedy, first_divergence, joint_greedy,
                            load_pair, make_drafter, prompt_ids, top2_gap)
from protocol import messages as m
from worker.engine import Engine, EngineConfig
from worker.round import Cell
from worker.loader import PairingError, check_tokenizers_agree
from worker.state import checkpoint as st
from worker.scheduler import PIPELINE_WARM_ROUNDS
from worker.joint.draft import Drafter
from worker.joint.decoder import CATCH_UP_LAG, JointDecoder
from worker.joint.sampling import SamplingParams, accept_sampled, make_key_fn

N_PROMPTS, N_TOKENS = (20, 128) if FULL else (6, 48)
NEAR_TIE = 1e-3


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {name: load_pair(root, name) for name in PAIRS}


@pytest.fixture(scope="session")
def references(pairs):
    """Baseline greedy output of every target for every prompt."""
    return {name: [baseline_greedy(p.target, prompt_ids(p.target, t), N_TOKENS) for t in PROMPTS[:N_PROMPTS]]
            for name, p in pairs.items()}


@pytest.mark.parametrize("recovery", ["fast", "replay"])
@pytest.mark.parametrize("kind", DRAFTS)
@pytest.mark.parametrize("pair_name", list(PAIRS))
def test_greedy_joint_equals_baseline(pairs, references, pair_name, kind, recovery):
    pair = pairs[pair_name]
    near_ties, drafted, accepted = [], 0, 0
    for text, ref in zip(PROMPTS, references[pair_name]):
        prompt = prompt_ids(pair.target, text)
        out, jd = joint_greedy(pair, make_drafter(pair, kind, recovery, ref), prompt, N_TOKENS, recovery)
        drafted, accepted = drafted + jd.stats.drafted, accepted + jd.stats.accepted
        i = first_divergence(out, ref)
        if i is None:
            continue
        gap = top2_gap(pair.target, prompt + ref[:i])
        print(f"divergence: {pair_name}/{kind}/{recovery} prompt {text!r} at token {i}: top-2 gap {gap:.2e}")
        assert gap < NEAR_TIE, f"joint output differs from baseline at token {i} where the target is not near a tie ({gap:.2e})"
        near_ties.append(i)
    assert len(near_ties) <= max(1, N_PROMPTS // 20), f"{len(near_ties)} near-tie divergences in {N_PROMPTS} prompts"
    rate = accepted / drafted
    if kind == "wrong":
        assert accepted == 0
    elif kind == "copy":
        assert rate > 0.9, rate
    elif PAIRS[pair_name][0] == PAIRS[pair_name][1]:
        assert 0.2 < rate < 0.85, rate


def test_cache_invariants_hold_after_every_cycle(tmp_path):
    """Runs tests/joint_invariants.py on the reference BLAS, where a batched forward and one-token
    forwards round alike (docs/design.md, "The BLAS on Linux": MKL's gemm and gemv differ by up to 2e-5 in these models)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    script = Path(__file__).with_name("joint_invariants.py")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == len(PAIRS) * (len(DRAFTS) + 1) * 2  # + batched rounds
    for combo, res in results.items():
        assert res["cycles"] > 10 and res["rollbacks"] > 0 or "copy" in combo, (combo, res)
        assert res["target_mismatches"] == 0 and res["draft_mismatches"] == 0, (combo, res)


@pytest.mark.parametrize("recovery", ["fast", "replay"])
def test_checkpoint_unchanged_after_restored_branch_moves_on(pairs, recovery):
    pair = pairs["qwen3_5+qwen3_5"]
    prompt = prompt_ids(pair.target, "hello world")
    out, jd = joint_greedy(pair, make_drafter(pair, "perturbed", recovery, []), prompt, 12, recovery)
    ck = st.checkpoint(jd.cache)
    saved = [np.array(a) for a in st.cache_arrays(jd.cache)]
    held = [np.array(a) for a in _held(ck)]
    for k in (3, 2, 4):  # the branch moves on
        jd.commit(len(jd.cycle(k)))
    assert all(np.array_equal(x, np.array(a)) for x, a in zip(held, _held(ck)))
    st.rollback(jd.cache, ck)
    restored = st.cache_arrays(jd.cache)
    assert len(restored) == len(saved)
    assert all(np.array_equal(x, np.array(y)) for x, y in zip(saved, restored))


def _held(ck: st.Checkpoint) -> list:
    return [a for arrays in ck.arrays if arrays for a in arrays if a is not None]


def test_cancel_mid_cycle_leaves_worker_exact(pairs):
    pair = pairs["qwen3_5+qwen3_5"]
    draft = pair.drafts["perturbed"]

    def engine():
        return Engine(pair.target, EngineConfig(max_active=2, draft_budget=3), draft)

    def run(eng, rid, req):
        eng.submit(rid, req)
        toks = []
        while eng.has_work():
            toks += [t for e in eng.step() if isinstance(e, m.TextDelta) and e.request_id == rid for t in e.token_ids]
        return toks

    req = m.GenerateRequest(messages=[m.Message("user", "tell me a story")], max_tokens=24, temperature=0.0,
                            mode="joint", ignore_eos=True)
    fresh = run(engine(), "b", req)
    eng = engine()
    eng.submit("a", m.GenerateRequest(messages=[m.Message("user", "once upon a time")], max_tokens=200,
                                      temperature=0.0, mode="joint", ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.cancel("a")
    finished = [e for e in eng.step() if isinstance(e, m.Finished)]
    assert [f.finish_reason for f in finished] == ["cancelled"] and eng.active_count() == 0
    assert finished[0].metrics.drafted > 0 and finished[0].metrics.mode == "joint"
    assert run(eng, "b", req) == fresh


def test_joint_metrics_and_stop_inside_accepted_tokens(pairs):
    pair = pairs["llama+llama"]
    eng = Engine(pair.target, EngineConfig(draft_budget=4), pair.drafts["copy"])
    base = m.GenerateRequest(messages=[m.Message("user", "hello world")], max_tokens=20, temperature=0.0,
                             ignore_eos=True)
    outs = {}
    for mode in ("baseline", "joint"):
        eng.submit(mode, m.GenerateRequest(**{**_fields(base), "mode": mode}))
    while eng.has_work():
        for e in eng.step():
            o = outs.setdefault(e.request_id, {"tokens": [], "fin": None})
            if isinstance(e, m.TextDelta):
                o["tokens"] += e.token_ids
            elif isinstance(e, m.Finished):
                o["fin"] = e
    assert outs["joint"]["tokens"] == outs["baseline"]["tokens"]
    jm = outs["joint"]["fin"].metrics
    assert jm.mode == "joint" and jm.draft and jm.drafted >= jm.accepted > 0 and jm.cycles < 20
    # every cycle drafts 4 and emits 5, but the last one: with 4 tokens left it drafts 3
    assert jm.budget_mean == pytest.approx((4 * (jm.cycles - 1) + 3) / jm.cycles) and jm.completion_tokens == 20
    # a cycle's drafts are capped at the tokens left, so max_tokens ends the request on a cycle's end
    eng.submit("cut", m.GenerateRequest(**{**_fields(base), "mode": "joint", "max_tokens": 7}))
    while eng.has_work():
        eng.step()
    assert eng.active_count() == 0


def _fields(req: m.GenerateRequest) -> dict:
    return {f: getattr(req, f) for f in req.__struct_fields__}


def test_pairing_refuses_a_different_tokenizer(pairs, tiny_llama_lm):
    with pytest.raises(PairingError, match="tokenizer differs"):
        check_tokenizers_agree(pairs["qwen3_5+qwen3_5"].target.tokenizer, tiny_llama_lm.tokenizer)


def test_rejection_sampling_keeps_target_distribution():
    """Function-level: the first emitted token's distribution is p, whatever q proposes.

    Chi-square over V = 6 with 6,000 draws; the critical value at p = 0.001 (df = 5) is 20.5."""
    rng = np.random.default_rng(0)
    V, N = 6, 6000
    p = rng.dirichlet(np.ones(V))
    q = mx.array(rng.dirichlet(np.ones(V) * 0.5).astype(np.float32))
    logits = mx.log(mx.array(np.stack([p, p]).astype(np.float32)))
    key_fn = make_key_fn(123)
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(V)
    for _ in range(N):
        d = mx.random.categorical(mx.log(q), key=key_fn()).item()
        n, own = accept_sampled([d], [q], logits, params, key_fn)
        counts[d if n == 1 else own] += 1
    chi2 = (((counts - N * p) ** 2) / (N * p)).sum()
    assert chi2 < 20.5, (chi2, counts / N, p)


def test_rejection_sampling_end_to_end_matches_baseline(pairs):
    """Joint against baseline on the tiny model: the second token's distribution over 300 seeds.

    Two-sample chi-square on the tokens seen at least 10 times in all; critical value at p = 0.001."""
    pair = pairs["llama+llama"]
    draft = pair.drafts["perturbed"]
    counts = {"baseline": {}, "joint": {}}
    for mode in counts:
        eng = Engine(pair.target, EngineConfig(max_active=8, max_waiting=300, draft_budget=3), draft)
        for seed in range(300):
            eng.submit(f"{mode}{seed}", m.GenerateRequest(messages=[m.Message("user", "hi")], max_tokens=2,
                                                          temperature=0.8, top_p=0.9, seed=seed, mode=mode,
                                                          ignore_eos=True))
        toks = {}
        while eng.has_work():
            for e in eng.step():
                if isinstance(e, m.TextDelta):
                    toks.setdefault(e.request_id, []).extend(e.token_ids)
        for t in toks.values():
            counts[mode][tuple(t[:2])] = counts[mode].get(tuple(t[:2]), 0) + 1
    keys = [k for k in set(counts["baseline"]) | set(counts["joint"])
            if counts["baseline"].get(k, 0) + counts["joint"].get(k, 0) >= 10]
    a = np.array([counts["baseline"].get(k, 0) for k in keys] + [300 - sum(counts["baseline"].get(k, 0) for k in keys)])
    b = np.array([counts["joint"].get(k, 0) for k in keys] + [300 - sum(counts["joint"].get(k, 0) for k in keys)])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    chi2 = (((a - b) ** 2) / (a + b)).sum()
    df = len(a) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, p = 0.001
    assert df >= 3 and chi2 < critical, (chi2, df, critical)


def test_draft_catch_up_pieces_are_powers_of_two():
    """A draft that lags after plain cycles catches up in few distinct input lengths (each new one
    compiles kernels on a GPU): binary pieces, largest first, capped."""
    from worker.joint.draft import pow2_pieces

    assert pow2_pieces(13) == [8, 4, 1] and pow2_pieces(1) == [1] and pow2_pieces(0) == []
    assert pow2_pieces(1100, most=512) == [512, 512, 64, 8, 4]
    for n in range(1, 300):
        p = pow2_pieces(n)
        assert sum(p) == n and p == sorted(p, reverse=True) and all(x & (x - 1) == 0 for x in p)


def test_a_lagging_draft_catches_up_in_pieces_of_powers_of_two(pairs):
    """The catch-up after plain cycles feeds the draft those pieces, not one input of the lag's
    length (on the H200 every new length compiled for 1.5-2 s, and the scheduler, pricing a
    catch-up so, never drafted again), and ends where one feed of the whole lag does."""
    from worker.state import checkpoint as st
    from worker.joint.draft import Drafter

    model = pairs["qwen3_5+qwen3_5"].drafts["perturbed"].model
    fed = []

    def recording(inputs, cache=None):
        fed.append(inputs.shape[1])
        return model(inputs, cache=cache)

    context = list(range(3, 40))
    pieces, whole = Drafter(recording, cache=st.make_cache(model)), Drafter(model)
    for d in (pieces, whole):
        d.prefill(context[:8])
    fed.clear()
    pieces.catch_up(context)  # 37 tokens, 8 consumed, the last kept: a lag of 28
    assert fed == [16, 8, 4] and pieces.consumed == context[:-1]
    whole.prefill(context[8:-1])
    nxt = mx.array([[context[-1]]])
    a, b = recording(nxt, cache=pieces.cache), model(nxt, cache=whole.cache)
    assert mx.allclose(a, b, atol=1e-4).item()


def test_draft_is_prefilled_only_when_it_first_drafts(pairs):
    """k = 0 throughout: the draft never consumes the prompt. The first drafting round prefills
    it and is recorded apart as "draft prefill" (not a cost sample). (Exactness with the lazy
    prefill: every test above runs with it.)"""
    pair = pairs["qwen3_5+qwen3_5"]
    req = m.GenerateRequest(messages=[m.Message("user", "tell me a story")], max_tokens=12, temperature=0.0,
                            mode="joint", ignore_eos=True)
    plain = Engine(pair.target, EngineConfig(draft_budget=0), pair.drafts["perturbed"])
    plain.submit("a", req)
    plain.step()  # admits and prefills the target: the first token
    plain.step()
    jd = plain._active[0].decoder
    assert jd.draft_lacks_prompt and jd.drafter.consumed == []
    while plain.has_work():
        plain.step()

    eng = Engine(pair.target, EngineConfig(draft_budget=2), pair.drafts["perturbed"])
    eng.submit("b", req)
    out = []
    while eng.has_work():
        out += [t for e in eng.step() if isinstance(e, m.TextDelta) for t in e.token_ids]
    reasons = [r for *_, r in eng.scheduler.cost.set_apart]
    assert reasons.count("draft prefill") == 1 and len(out) == 12


def test_draft_catching_up_after_sitting_out_is_not_a_cost_sample(pairs):
    """A draft that sat out more than CATCH_UP_LAG cycles feeds them at its next drafting cycle,
    on their own: that catch-up is timed apart as "draft catch-up", and so is the wait for the
    forward the pipelined plain cycles computed ahead, whose token the drafting cycle takes as its
    first ("look-ahead taken"); the rest of that
    round is a drafting round like any other, a cost sample. The first plain round after drafting
    (it starts the plain pipeline) is recorded apart whole, and so are the next ones until the
    pipeline runs steady (PIPELINE_WARM_ROUNDS in all)."""
    pair = pairs["qwen3_5+qwen3_5"]
    req = m.GenerateRequest(messages=[m.Message("user", "tell me a story")], max_tokens=24, temperature=0.0,
                            mode="joint", ignore_eos=True)
    eng = Engine(pair.target, EngineConfig(draft_budget=1), pair.drafts["perturbed"])
    eng.submit("a", req)
    out, budgets = [], [1] * 3 + [0] * (CATCH_UP_LAG + 2) + [1] * 24
    while eng.has_work():
        eng.scheduler.fixed = budgets.pop(0)
        out += [t for e in eng.step() if isinstance(e, m.TextDelta) for t in e.token_ids]
    reasons = [r for *_, r in eng.scheduler.cost.set_apart]
    assert reasons.count("draft prefill") == 1 and reasons.count("draft catch-up") == 1
    assert reasons.count("look-ahead taken") == 1 and "look-ahead discarded" not in reasons
    rounds = [r for r, _ in eng.scheduler.cost.cells[(1, 1, 1)]]
    assert 3 + CATCH_UP_LAG + 2 + 1 in rounds  # the round that caught up, less the catch-up
    assert reasons.count("plain pipeline start") == 2  # the sat-out rounds' first, and the last cycle's:
    assert reasons.count("plain pipeline warm-up") == PIPELINE_WARM_ROUNDS - 1  # with one token left it has no room to draft
    counts = eng.scheduler.cost.counts()
    assert counts[Cell(1, 1, 1)] >= 3 and counts[Cell(1, 0, 0)] == CATCH_UP_LAG + 2 - PIPELINE_WARM_ROUNDS and len(out) == 24


def test_a_requests_last_plain_round_is_not_a_cost_sample(pairs):
    """A request's last plain cycle computes nothing ahead: its round only waits for the token
    computed before, so it is set apart ("last plain round"). As a sample it priced a batch's
    tail (one request left) at 5 ms a plain round, where steady ones cost 30."""
    pair = pairs["qwen3_5+qwen3_5"]
    req = m.GenerateRequest(messages=[m.Message("user", "tell me a story")], max_tokens=12, temperature=0.0,
                            mode="joint", ignore_eos=True)
    eng = Engine(pair.target, EngineConfig(draft_budget=0), pair.drafts["perturbed"])
    eng.submit("a", req)
    while eng.has_work():
        eng.step()
    reasons = [r for *_, r in eng.scheduler.cost.set_apart]
    assert reasons.count("last plain round") == 1
    assert "plain pipeline warm-up" not in reasons  # it never drafted: its first rounds are no stop's cost
    assert eng.scheduler.cost.counts()[Cell(1, 0, 0)] == 12 - 1 - reasons.count("first plain rounds") - 1  # less the prefill's and the last


@pytest.mark.parametrize("recovery", ["fast", "replay"])
def test_a_stop_on_the_taken_look_ahead_keeps_neither_drafts_nor_verify(pairs, recovery):
    """A drafting cycle after pipelined plain ones starts with the token computed ahead; kept
    alone (a stop on it), both caches go back to just before the drafts, and decoding goes on
    exactly: every token is the baseline's, through plain and drafting cycles after."""
    pair = pairs["qwen3_5+qwen3_5"]
    prompt = prompt_ids(pair.target, "tell me a story")
    ref = baseline_greedy(pair.target, prompt, 40)
    jd = JointDecoder(pair.target.model, make_drafter(pair, "perturbed", recovery, ref), prompt, SamplingParams(),
                      recovery=recovery)
    out, stops = [jd.start(pipelined=True)], 0
    while len(out) < 34:
        for k in (0, 0, 3, 2):  # the drafting cycle after plain ones is cut after its first token
            emitted = jd.cycle(k)
            keep = 1 if k == 3 else len(emitted)
            stops += k == 3 and len(emitted) > 1
            jd.commit(keep)
            out += emitted[:keep]
            assert len(jd.drafter.consumed) < len(jd.tokens) and jd.drafter.consumed == jd.tokens[:len(jd.drafter.consumed)]
    assert out == ref[:len(out)] and stops >= 4


def test_the_last_plain_cycle_computes_nothing_ahead(pairs):
    """A request's last token needs no forward after it (mlx-lm's generate_step computes one,
    never emitted): the cache then holds every token but the last, as after any commit, and a
    cycle after all the same restarts the pipeline exactly."""
    pair = pairs["qwen3_5+qwen3_5"]
    prompt = prompt_ids(pair.target, "hello world")
    ref = baseline_greedy(pair.target, prompt, 8)
    jd = JointDecoder(pair.target.model, make_drafter(pair, "perturbed", "fast", ref), prompt, SamplingParams())
    out = [jd.start(pipelined=True)]
    for last in (False, False, True, False, True):
        emitted = jd.cycle(0, last)
        jd.commit(1)
        out += emitted
        assert jd.looking_ahead == (not last)
        offsets = {c.offset for c in jd.cache if isinstance(c, st.KVCache)}
        assert offsets == {len(jd.tokens) - last}  # the look-ahead feeds the last token
    assert out == ref[:6]


def test_a_cycle_drafts_no_more_than_the_request_can_still_emit(pairs):
    """With 3 tokens left a cycle can use at most 2 drafts (it adds one token of its own): the
    engine caps fixed k there, and the output is still the baseline's."""
    pair = pairs["qwen3_5+qwen3_5"]
    req = m.GenerateRequest(messages=[m.Message("user", "tell me a story")], max_tokens=4, temperature=0.0,
                            mode="joint", ignore_eos=True)
    eng = Engine(pair.target, EngineConfig(draft_budget=4), pair.drafts["perturbed"])
    eng.submit("a", req)
    out = []
    while eng.has_work():
        out += [t for e in eng.step() if isinstance(e, m.TextDelta) for t in e.token_ids]
    shapes = list(eng.scheduler.cost.cells) + [key for key, *_ in eng.scheduler.cost.set_apart]
    assert max(d for _, _, d in shapes) == 2 and 1 <= eng.totals.joint.drafted <= 3
    base = Engine(pair.target, EngineConfig(), pair.drafts["perturbed"])
    base.submit("b", m.GenerateRequest(messages=req.messages, max_tokens=4, temperature=0.0, ignore_eos=True))
    ref = []
    while base.has_work():
        ref += [t for e in base.step() if isinstance(e, m.TextDelta) for t in e.token_ids]
    assert out == ref and len(out) == 4


@pytest.mark.parametrize("budget, batch, drafting, lookahead", [
    (None, True, False, [True, False]), (0, True, False, [True, False]), (2, True, False, [False, False]),
    (None, False, False, [True, True]), (None, False, True, [False, False])])
def test_a_lone_request_likely_to_run_plain_starts_its_pipeline_at_once(pairs, budget, batch, drafting, lookahead):
    """As mlx-lm's generate_step does, the forward after the first token is started before that
    token is read, where plain unbatched cycles are likely next (k = 0, or adaptive while its last
    decision drafted nothing, and no other joint request to batch with); a fixed k, or adaptive
    while drafting, drafts first and starts unpipelined. Either way the output is the baseline's."""
    pair = pairs["qwen3_5+qwen3_5"]
    reqs = {rid: m.GenerateRequest(messages=[m.Message("user", text)], max_tokens=20, temperature=0.0,
                                   mode="joint", ignore_eos=True)
            for rid, text in (("a", "tell me a story"), ("b", "hello world"))}
    eng = Engine(pair.target, EngineConfig(draft_budget=budget, batch_verify=batch), pair.drafts["perturbed"])
    eng.scheduler._drafting = drafting  # what its last decision chose (test_scheduler.py tests that)
    out = {rid: [] for rid in reqs}
    seen = {}

    def step():
        for e in eng.step():
            if isinstance(e, m.TextDelta):
                out[e.request_id] += e.token_ids
        for r in eng._active:
            seen.setdefault(r.id, r.decoder.looking_ahead)  # just after its start

    eng.submit("a", reqs["a"])
    step()  # "a" starts alone
    eng.submit("b", reqs["b"])
    while eng.has_work():
        step()
    assert [seen["a"], seen["b"]] == lookahead
    base = Engine(pair.target, EngineConfig())
    for rid, req in reqs.items():
        base.submit(rid, m.GenerateRequest(messages=req.messages, max_tokens=20, temperature=0.0, ignore_eos=True))
    ref = {rid: [] for rid in reqs}
    while base.has_work():
        for e in base.step():
            if isinstance(e, m.TextDelta):
                ref[e.request_id] += e.token_ids
    assert out == ref


def test_a_drafting_cycle_queues_its_verify_before_reading_the_drafts(pairs):
    """One wait a cycle: the verify forward is built on the draft's tokens as they are being
    computed, and the drafts are read on the host only after it is queued (on a GPU the host
    builds the verify while the device drafts; reading them first idled the device: the H200's
    joint k = 4 at α = 0.8 read 173 tok/s so, 225 queued). The output stays the baseline's."""
    pair = pairs["qwen3_5+qwen3_5"]
    prompt = prompt_ids(pair.target, "tell me a story")
    ref = baseline_greedy(pair.target, prompt, 12)
    drafter = Drafter(pair.drafts["perturbed"].model)
    jd = JointDecoder(pair.target.model, drafter, prompt, SamplingParams())
    verifies = []

    def target(x, cache):
        if x.shape[1] > 1:  # a verify of [y, d1..dk]: the drafts are not on the host yet
            verifies.append((x.shape[1], len(drafter.consumed), len(jd.tokens)))
        return pair.target.model(x, cache=cache)

    out = [jd.start()]
    jd.target = target
    while len(out) < 12:
        emitted = jd.cycle(min(3, 12 - len(out) - 1))
        jd.commit(min(len(emitted), 12 - len(out)))
        out += emitted[: 12 - len(out)]
    assert out == ref
    assert verifies and all(consumed < tokens for _, consumed, tokens in verifies), verifies
    assert [width for width, _, _ in verifies[:2]] == [4, 4]
