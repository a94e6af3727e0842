"""The joint path in the batch: exactness against baseline, recovery, cancel, rejection sampling."""

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
from joint_fixtures import (DRAFTS, PAIRS, PROMPTS, baseline_greedy, first_divergence, greedy, joint_engine,
                            load_pair, prompt_ids, run_engine, top2_gap)
from protocol import messages as m
from worker.batch.drafts import CATCH_UP_LAG
from worker.engine import Engine, EngineConfig
from worker.round import Cell
from worker.loader import PairingError, check_tokenizers_agree
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
    """Every prompt a joint row of one batch, drafting by a schedule that differs row to row
    (every verify width, plain rounds between): each output is the target's own greedy one."""
    pair = pairs[pair_name]
    texts = PROMPTS[:N_PROMPTS]
    refs = {tuple(prompt_ids(pair.target, t)): ref for t, ref in zip(texts, references[pair_name])}
    eng = joint_engine(pair, kind, recovery, refs, max_active=len(texts))
    got = run_engine(eng, {f"r{i}": greedy(t, N_TOKENS) for i, t in enumerate(texts)})
    near_ties = []
    for i, (text, ref) in enumerate(zip(texts, references[pair_name])):
        j = first_divergence(got[f"r{i}"], ref)
        assert len(got[f"r{i}"]) == N_TOKENS
        if j is None:
            continue
        gap = top2_gap(pair.target, prompt_ids(pair.target, text) + ref[:j])
        print(f"divergence: {pair_name}/{kind}/{recovery} prompt {text!r} at token {j}: top-2 gap {gap:.2e}")
        assert gap < NEAR_TIE, f"joint output differs from baseline at token {j} where the target is not near a tie ({gap:.2e})"
        near_ties.append(j)
    assert len(near_ties) <= max(1, N_PROMPTS // 20), f"{len(near_ties)} near-tie divergences in {N_PROMPTS} prompts"
    s = eng.totals.joint
    rate = s.accepted / s.drafted
    if kind == "wrong":
        assert s.accepted == 0
    elif kind == "copy":
        assert rate > 0.9, rate
    elif PAIRS[pair_name][0] == PAIRS[pair_name][1]:
        assert 0.2 < rate < 0.85, rate
    assert (s.rollbacks > 0) == (kind != "copy")


def test_cache_invariants_hold_after_every_cycle(tmp_path):
    """Runs tests/joint_invariants.py on the reference BLAS, where a batched forward and one-token
    forwards round alike (docs/design.md, "The BLAS on Linux": MKL's gemm and gemv differ by up to 2e-5 in these models)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    script = Path(__file__).with_name("joint_invariants.py")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == len(PAIRS) * len(DRAFTS) * 2
    for combo, res in results.items():
        assert res["checks"] > 20 and (res["cycles"] > 10 and res["rollbacks"] > 0 or "copy" in combo), (combo, res)
        assert res["target_mismatches"] == 0 and res["draft_mismatches"] == 0, (combo, res)


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
    # the first round emits its 4 accepted drafts (the prompt's last token is no output), each next
    # one its pending token and 4 drafts; with one token left the last drafts none: 4 + 5 + 5 + 5 + 1
    assert (jm.drafted, jm.cycles, jm.completion_tokens) == (16, 5, 20)
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


def test_the_draft_is_fed_the_prompt_in_step_with_the_target(pairs):
    """A joint row's prompt chunks feed the draft in the same rounds as the target: when its
    prompt is in, its draft holds what the target holds, and it may draft at its first round."""
    pair = pairs["qwen3_5+qwen3_5"]
    eng = Engine(pair.target, EngineConfig(draft_budget=2, prefill_step=8), pair.drafts["perturbed"])
    eng.submit("a", greedy("tell me a story about the sea and the ships on it", 12))
    eng.step()
    runner = eng.runner
    row = runner.rows["a"]
    assert 0 < row.fed < len(row.prompt) - 1 and runner.draft.lengths["a"] == runner.target.lengths["a"] == row.fed
    while row.phase.value == "prefill":
        eng.step()
    assert runner.draft.lengths["a"] >= len(row.prompt) - 1
    assert row.stats.drafted > 0  # it drafted in its first decoding round
    while eng.has_work():
        assert not [e for e in eng.step() if isinstance(e, m.Error)]
    assert "draft prefill" not in [r for *_, r in eng.scheduler.cost.set_apart]


def test_a_draft_catching_up_after_sitting_out_is_paid_apart(pairs):
    """A draft that sat out more than CATCH_UP_LAG rounds feeds them in a forward of its own
    before drafting: that catch-up is timed apart ("draft catch-up"), and the rest of the round
    is a drafting round like any other, a cost sample."""
    pair = pairs["qwen3_5+qwen3_5"]
    eng = Engine(pair.target, EngineConfig(draft_budget=1), pair.drafts["perturbed"])
    eng.submit("a", greedy("tell me a story", 24))
    out, budgets = [], [1] * 3 + [0] * (CATCH_UP_LAG + 2) + [1] * 40
    while eng.has_work():
        if eng.runner.decoding():
            eng.scheduler.fixed = budgets.pop(0)
        out += [t for e in eng.step() if isinstance(e, m.TextDelta) for t in e.token_ids]
    reasons = [r for *_, r in eng.scheduler.cost.set_apart]
    assert reasons.count("draft catch-up") == 1 and len(out) == 24
    assert eng.scheduler.cost.counts()[Cell(1, 1, 1)] >= 3


def test_a_cycle_drafts_no_more_than_the_request_can_still_emit(pairs):
    """A round emits a row's pending token and its accepted drafts, and leaves it the target's
    own next (computed by the verify anyway): with t tokens left a row drafts at most t - 1 (t in
    its first round, whose pending token is the prompt's), and the output is the baseline's."""
    pair = pairs["qwen3_5+qwen3_5"]
    eng = Engine(pair.target, EngineConfig(draft_budget=8, decision_log=None), pair.drafts["perturbed"])
    seen = []
    plan = eng.scheduler.plan_round
    eng.scheduler.plan_round = lambda inp: seen.append([(s.room, s.request_id) for s in inp.rows]) or plan(inp)
    out = run_engine(eng, {"a": greedy("tell me a story", 4)})["a"]
    assert seen[0] == [(4, "a")] and all(room < 4 for (room, _), in seen[1:])
    shapes = list(eng.scheduler.cost.cells) + [key for key, *_ in eng.scheduler.cost.set_apart]
    assert max(d for _, _, d in shapes) == 4
    base = Engine(pair.target, EngineConfig(), pair.drafts["perturbed"])
    assert out == run_engine(base, {"b": greedy("tell me a story", 4, "baseline")})["b"] and len(out) == 4
