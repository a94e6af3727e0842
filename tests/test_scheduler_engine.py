"""The scheduler under the engine and the simulator: joint requests decoded together as their
baselines are, the decision log an engine writes replayed, bench/simulator.py's prices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import simulator as sim
from joint_fixtures import load_pair
from protocol import messages as m
from worker.engine import Engine, EngineConfig
from worker.round import Cell
from worker.scheduler import state


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return load_pair(tmp_path_factory.mktemp("sched"), "llama+llama")


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    return load_pair(tmp_path_factory.mktemp("sched-h"), "qwen3_5+qwen3_5")


def _run(engine, reqs):
    for rid, req in reqs.items():
        engine.submit(rid, req)
    out = {rid: [] for rid in reqs}
    while engine.has_work():
        for e in engine.step():
            if isinstance(e, m.TextDelta):
                out[e.request_id] += e.token_ids
    return out


@pytest.mark.parametrize("pair_name", ["llama+llama", "qwen3_5+qwen3_5"])
def test_four_concurrent_joint_requests_equal_their_baselines(pair_name, llama_pair, hybrid_pair, tmp_path, monkeypatch):
    pair = llama_pair if pair_name == "llama+llama" else hybrid_pair
    monkeypatch.setattr(state, "MAX_HOLD", 0)  # decide every round: 32 tokens of ms rounds would hold most decisions
    texts = ["hello world", "the quick brown fox", "once upon a time", "tell me a story"]
    reqs = {f"{mode}{i}": m.GenerateRequest(messages=[m.Message("user", t)], max_tokens=32, temperature=0.0,
                                            ignore_eos=True, mode=mode)
            for i, t in enumerate(texts) for mode in ("joint", "baseline")}
    log = tmp_path / "decisions.jsonl"
    engine = Engine(pair.target, EngineConfig(max_active=4, decision_log=str(log)), pair.drafts["perturbed"])
    joint = _run(engine, {k: v for k, v in reqs.items() if k.startswith("joint")})
    base = _run(Engine(pair.target, EngineConfig(max_active=1)), {k: v for k, v in reqs.items() if k.startswith("base")})
    for i in range(len(texts)):
        assert joint[f"joint{i}"] == base[f"baseline{i}"]
    decisions = [rec for rec in map(json.loads, log.read_text().splitlines()) if "observed" not in rec]
    assert len(decisions) > 10 and any(rec["budget"] > 0 for rec in decisions)
    assert not any(rec.get("held") for rec in decisions)
    assert any(len(rec["requests"]) == 4 for rec in decisions)


def test_replay_reports_no_difference_then_the_altered_input(llama_pair, tmp_path):
    log = tmp_path / "decisions.jsonl"
    engine = Engine(llama_pair.target, EngineConfig(max_active=2, decision_log=str(log)), llama_pair.drafts["perturbed"])
    _run(engine, {f"r{i}": m.GenerateRequest(messages=[m.Message("user", t)], max_tokens=40, temperature=0.0,
                                             ignore_eos=True, mode="joint")
                  for i, t in enumerate(["hello world", "once upon a time"])})
    verity = [sys.executable, "-m", "cli.main", "replay"]
    r = subprocess.run([*verity, str(log)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 differences" in r.stderr
    lines = log.read_text().splitlines()
    observed = [rec for rec in map(json.loads, lines) if "observed" in rec]  # every round's time, beside the decisions
    assert sum(rec["complete"] for rec in observed) == engine.scheduler.cost.rounds
    assert all(rec["observed"] > 0 and len(rec["shape"]) == 3 and (rec["complete"] or rec["reason"]) for rec in observed)
    # the engine times its drafting (a row leaving the baseline batch drafts from the round after)
    drafting = [rec for rec in observed if rec["shape"][2] and rec.get("reason") != "batch switch"]
    assert drafting and all(0 < rec["draft_s"] < rec["observed"] for rec in drafting)
    assert all(rec["draft_s"] == 0 for rec in observed if not rec["shape"][2])
    assert engine.scheduler.cost.draft_step(2) or engine.scheduler.cost.draft_step(1)
    i = max(i for i, line in enumerate(lines) if any(json.loads(line).get("acceptance", [])[:1]))  # the last that could draft
    rec = json.loads(lines[i])
    rec["acceptance"][0][0] = 0.01 if rec["acceptance"][0][0] > 0.5 else 0.99
    rec["cost_table"] = {k: v * (3.0 if Cell.parse(k).b else 1.0) for k, v in rec["cost_table"].items()}
    altered = tmp_path / "altered.jsonl"
    altered.write_text("\n".join(lines[:i] + [json.dumps(rec)] + lines[i + 1:]) + "\n")
    r = subprocess.run([*verity, str(altered)], capture_output=True, text=True)
    assert r.returncode == 1 and f"line {i + 1}" in r.stdout, r.stdout + r.stderr


def test_the_simulator_prices_budgets_by_its_table_and_adaptive_follows_the_best():
    """bench/simulator.py, the quick check of a scheduler change: where drafts are nearly
    always right k = 4 beats plain rounds by its table's margin and adaptive keeps up with it; where
    they are always wrong, k = 1 loses and adaptive stays with plain rounds."""
    easy = sim.Scenario("α=0.9 ×1", lambda p, n: 0.9, 1, sim.EMBEDDED_X1, runs=4, warm_runs=1)
    o = sim.compare(easy, 0)
    assert o["k=4"] > 1.3 * o["k=0"] and o["adaptive"] > 0.9 * max(o.values())
    hopeless = sim.Scenario("α=0 ×1", lambda p, n: 0.0, 1, sim.EMBEDDED_X1, runs=4, warm_runs=1)
    o = sim.compare(hopeless, 0)
    assert o["k=1"] < 0.8 * o["k=0"] and o["adaptive"] > 0.95 * o["k=0"]
