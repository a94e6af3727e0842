"""The scheduler the engine runs: holds, explorations, estimates over rounds, the decision log and its replay, and joint requests decoded together under it."""

from __future__ import annotations

import itertools
import io
import json
import math
import random
import subprocess
import sys

import pytest

from joint_fixtures import PAIRS, load_pair
from protocol import messages as m
from worker.engine import Engine, EngineConfig
from worker import scheduler
from worker.round import Cell
from bench import simulator as sim
from worker.scheduler import EXPLORE_MARGIN, FEW_PLAIN_GAP, FEW_ROUNDS, FREE_SIT_OUT, PROBE_SHARE, UNCERTAIN_SHARE, HOPELESS_EVERY, MAX_AGE, MAX_HOLD, MIN_SAMPLES, PACE_WINDOW, PIPELINE_REASONS, PIPELINE_WARM_ROUNDS, PLAIN_GAP, PACE_BOUND, PROBE_EVERY, STALE_GAP, WINDOW, CostModel, Scheduler, _best, _best_drafting, allocate, decide, estimate, plain_probe_interval, probe_interval, rank, replay, survivals

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
    monkeypatch.setattr(scheduler.state, "MAX_HOLD", 0)  # decide every round: 32 tokens of ms rounds would hold most decisions
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
    drafting = [rec for rec in observed if rec["shape"][2]]
    assert drafting and all(0 < rec["draft_s"] < rec["observed"] for rec in drafting)  # the engine times its drafting
    assert all(rec["draft_s"] == 0 for rec in observed if not rec["shape"][2])
    assert engine.scheduler.cost.draft_step(2) or engine.scheduler.cost.draft_step(1)
    i = max(i for i, line in enumerate(lines) if any(json.loads(line).get("acceptance", [])[:1]))  # the last that could draft
    rec = json.loads(lines[i])
    rec["acceptance"][0][0] = 0.01 if rec["acceptance"][0][0] > 0.5 else 0.99
    rec["cost_table"] = {k: v * (3.0 if k.split(",")[1] != "0" else 1.0) for k, v in rec["cost_table"].items()}
    altered = tmp_path / "altered.jsonl"
    altered.write_text("\n".join(lines[:i] + [json.dumps(rec)] + lines[i + 1:]) + "\n")
    r = subprocess.run([*verity, str(altered)], capture_output=True, text=True)
    assert r.returncode == 1 and f"line {i + 1}" in r.stdout, r.stdout + r.stderr

def test_an_unlucky_deep_position_drifts_back_while_drafts_stay_shallow():
    """Two early rejections at position 2 would keep drafts at depth 1 for good (position 2 is
    then never tried again); cycles that do not try it make its old counts fade, so its estimate
    returns to what position 1 shows and a deeper draft gets tried again."""
    s = Scheduler()
    for _ in range(2):
        _drafting_round(s, "r", 2, 1)  # position 1 accepted, position 2 rejected
    assert s.shared_rates()[1] < 0.6
    for _ in range(60):
        _drafting_round(s, "r", 1, 1)  # depth 1 only, always accepted
    shared = s.shared_rates()
    assert shared[0] > 0.9 and shared[1] > 0.85
    assert s.acceptance["r"].rates(shared)[1] > 0.85

def test_a_decision_governs_more_rounds_where_rounds_cost_little_next_to_deciding(tmp_path):
    """Deciding takes ~0.1 ms of Python: against a 50 ms round every round decides, against a
    microsecond round one decision holds for MAX_HOLD rounds (logged as held, skipped by replay);
    a request joining or leaving, or a due probe, ends the hold at once."""
    def sched(plain_s, log=None):
        s = Scheduler(log_path=log)
        s.cost.cells = {(1, 0, 0): [(0, plain_s)] * 9, (1, 1, 1): [(0, 2.5 * plain_s)] * 9, (2, 0, 0): [(0, plain_s)] * 9}
        for _ in range(20):
            s.observe_cycle("a", 1, 0)  # the draft is rejected: plain pays
        return s
    slow = sched(10.0, str(tmp_path / "slow.jsonl"))
    for _ in range(5):
        slow.plan(["a"], 1)
    slow.flush_log()  # records are held back and written together (the engine flushes when idle)
    assert len([x for x in (tmp_path / "slow.jsonl").read_text().splitlines() if "held" not in x]) == 5
    log = tmp_path / "fast.jsonl"
    fast = sched(1e-6, str(log))
    for _ in range(MAX_HOLD + 2):
        assert fast.plan(["a"], 1) == [0]
    fast.plan(["a", "b"], 2)  # a request joined: decide now
    fast.flush_log()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r.get("held", False) for r in recs] == [False] + [True] * MAX_HOLD + [False, False]
    assert all(r["allocation"] == [0] for r in recs[:-1]) and recs[-1]["requests"] == ["a", "b"]
    r = subprocess.run([sys.executable, "-m", "cli.main", "replay", str(log)], capture_output=True, text=True)
    assert r.returncode == 0 and "0 differences" in r.stderr, r.stdout + r.stderr
    probing = sched(1e-6)
    budgets, everys = [], []
    for _ in range(200):
        budgets.append(probing.plan(["a"], 1)[0])
        everys.append(probing._probe_every)  # as the round's decision (or the last one) computed it
    every = everys[budgets.index(1)]
    assert every % (MAX_HOLD + 1) != 0  # the probe falls due within a hold
    assert budgets[: every + 1] == [0] * every + [1]  # the hold does not delay it


def test_a_due_plain_exploration_ends_a_drafting_hold(tmp_path):
    """Against microsecond rounds a drafting decision holds for MAX_HOLD rounds; the plain rounds
    due every PLAIN_GAP drafting rounds come on time all the same (on a slow machine a hold of a
    few rounds had put them off, where the decision took 0.5 ms against a 46 ms round)."""
    log = tmp_path / "log.jsonl"
    s = Scheduler(b_max=1, log_path=str(log))
    s.cost.cells = {(1, 0, 0): [(1, 1.0e-6)] * 3, (1, 1, 1): [(1, 1.26e-6)] * 9}  # k = 1 pays, by less than 1.25×
    s.cost.rounds = 1
    for i in range(100):
        s.observe_cycle(f"old{i // 50}", 1, int(i % 3 == 0))
    budgets: list[int] = []
    for i in range(PLAIN_GAP + 2):
        k = s.plan(["r"], 1)[0]
        if k:
            s.observe_cycle("r", k, int(i % 3 == 0))
        s.observe_round(1.26e-6 if k else 1.0e-6, True)
        budgets.append(k)
    s.flush_log()
    assert budgets[:PLAIN_GAP] == [1] * PLAIN_GAP and budgets[PLAIN_GAP] == 0
    assert sum(bool(json.loads(x).get("held")) for x in log.read_text().splitlines()) >= PLAIN_GAP // 2  # it held


def test_a_due_plain_exploration_that_would_not_be_taken_leaves_a_hold_alone(tmp_path):
    """Where drafting leads plain by EXPLORE_MARGIN or more, a due exploration is not taken, so it
    does not end the hold either: on the H200 at α = 0.95 (k = 8 leading 2×) every round decided
    again once plain rounds were due (0.6 ms of Python a decision on this CPU)."""
    log = tmp_path / "log.jsonl"
    s = Scheduler(b_max=1, log_path=str(log))
    s.cost.cells = {(1, 0, 0): [(1, 1.0e-6)] * 3, (1, 1, 1): [(1, 1.1e-6)] * 9}  # k = 1 leads 1.6×
    s.cost.rounds = 1
    for i in range(100):
        s.observe_cycle(f"old{i // 50}", 1, 1)
    for i in range(PLAIN_GAP + 40):
        k = s.plan(["r"], 1)[0]
        if k:
            s.observe_cycle("r", k, 1)
        s.observe_round(1.1e-6 if k else 1.0e-6, True)
    s.flush_log()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    late = [r for r in recs if "observed" not in r and r["round"] > PLAIN_GAP + 2]
    assert any(r.get("explore_plain") for r in recs if not r.get("held"))  # plain rounds were due ...
    assert all(r["allocation"] == [1] for r in late) and sum(bool(r.get("held")) for r in late) >= len(late) // 2  # ... and it held


def test_an_unlucky_spell_does_not_stop_drafting_for_good(tmp_path):
    """A draft accepted 43% of the time, where drafting pays from 25%: a spell of rejections takes
    the estimate under that, and rounds that draft nothing observe nothing. The estimates fade
    back toward what the draft showed over the long run, so drafting resumes by a decision, not
    only by probes (which observe nothing here)."""
    s = Scheduler(log_path=str(tmp_path / "log.jsonl"))
    s.cost.cells = {(1, 0, 0): [(0, 0.048)] * 9, (1, 1, 1): [(0, 0.060)] * 9}
    s.cost.set_apart = [((1, 1, 1), 0.5, "draft catch-up")]
    assert probe_interval(s.cost.table(), 1, s.cost.counts(), s.cost.catch_up_seconds(1), [0.0]) > 300
    for i in range(300):
        s.observe_cycle(f"old{i // 100}", 1, int(i % 7 < 3))  # 3 of 7 accepted
    for _ in range(8):
        s.observe_cycle("r", 1, 0)
    assert s.plan(["r"], 1) == [0]
    def drafts_by_decision() -> bool:  # probes (here every few rounds: near break-even they cost little) aside
        drafts = s.plan(["r"], 1) == [1]
        s.flush_log()
        return drafts and not json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])["probe"]
    resumed = next(i for i in range(400) if drafts_by_decision())
    assert resumed < 60
    assert s.acceptance["r"].rates(s.shared_rates())[0] > 0.25


def test_a_change_of_text_is_followed_within_a_few_rounds_and_steady_noise_is_not_taken_for_one():
    """Four requests whose draft goes from 1 in 5 accepted to every one accepted (the text
    changed): the server-wide estimate forgets what came before the change within two rounds,
    where without the short memory it would still be under 0.6; at a steady 9 in 10 (one
    rejection, in turn) it never forgets."""
    def run(detect: bool, pattern, rounds: int) -> list[float]:
        overall = scheduler.Acceptance(scheduler.POSITIONS, detect_change=detect, per_round=True)
        out = []
        for i in range(rounds):
            overall.fade(recent=False)  # a round's decay, as Scheduler.plan applies it
            for r in range(4):
                overall.observe(1, pattern(i, r))
            out.append(overall.rates([0.5] * scheduler.POSITIONS, scheduler.PRIOR_WEIGHT)[0])
        return out

    change = lambda i, r: int(i >= 20 or (4 * i + r) % 5 == 0)  # noqa: E731
    with_change, without = run(True, change, 22), run(False, change, 22)
    assert with_change[19] < 0.35 and without[19] < 0.35  # both saw 1 in 5
    assert with_change[21] > 0.75 and without[21] < 0.6
    steady = lambda i, r: int((4 * i + r) % 10 != 0)  # noqa: E731
    with_steady, without_steady = run(True, steady, 100), run(False, steady, 100)
    assert with_steady == without_steady


def _drafting_round(s: Scheduler, rid: str, k: int, n: int) -> None:
    """A round in which request rid drafted k and n were accepted, as Scheduler.plan and the
    engine report it: the round's decay of the server-wide estimate, then the cycle."""
    s._fade([rid], [k])
    s.observe_cycle(rid, k, n)


def test_the_server_wide_estimate_remembers_rounds_not_cycles():
    """Four requests a round give the server-wide estimate four cycles a round, and it decays by
    rounds: it remembers as many rounds as with one request, four times the cycles (decayed per
    cycle it remembered ~5 rounds, and near break-even its noise decided whether to draft)."""
    def memory(n: int) -> float:
        s = Scheduler()
        ids = [f"r{i}" for i in range(n)]
        for i in range(200):
            s._fade(ids, [1] * n)  # a drafting round's decay, as Scheduler.plan applies it
            for j, rid in enumerate(ids):
                s.observe_cycle(rid, 1, int((i + j) % 3 == 0))  # a steady 1 in 3
        return s.overall.tried[0]

    one, four = memory(1), memory(4)
    assert one == pytest.approx(1 / (1 - scheduler.DECAY), rel=0.05)
    assert four == pytest.approx(4 * one, rel=0.05)


def test_a_change_forgets_the_deeper_positions_server_wide_but_not_in_a_request():
    """After α = 0.9 text (drafts of 8, nearly all accepted) position 1 starts failing, and the
    deeper positions, now seldom tried, would keep the old text's rates (the engine drafted 6-8
    deep into α = 0.2 text). The server-wide estimate forgets them with position 1, so the next
    few cycles that reach them decide their rates; a request's own estimate keeps them (its own
    false alarms made α = 0.9 ×4 allocations uneven), and so does a rise."""
    s = Scheduler()
    for i in range(20):
        _drafting_round(s, "r", 8, 8 if i % 10 else 2)
    deep_before = list(s.overall.tried[1:])
    for _ in range(3):
        _drafting_round(s, "r", 8, 0)
    assert s.overall.tried[0] < 4 and max(s.overall.tried[1:]) < 2 < min(deep_before)
    assert min(s.acceptance["r"].tried[1:]) > 0.8 * min(deep_before)
    shared_deep = s.shared_rates()[1]
    _drafting_round(s, "r", 8, 1)  # the next cycle reaching position 2 fails there
    assert s.shared_rates()[1] < shared_deep - 0.25
    rising = Scheduler()  # after a rise, deeper positions are tried often again: nothing to forget
    for i in range(20):
        _drafting_round(rising, "r", 8, 0 if i % 10 else 8)
    for _ in range(5):
        _drafting_round(rising, "r", 8, 8)
    assert rising.overall.tried[0] < 4 and rising.overall.tried[4] > 4


def test_a_draft_seen_on_few_cycles_is_probed_until_it_is_known(monkeypatch):
    """Three rejections at a new server's start (α = 0.6, the controlled draft's first hard
    tokens) made an estimate of 0.14-0.20 that priced its own probes away: no probe in 280 rounds,
    adaptive 0.87 of k = 1. Until position 1 has FEW_OBSERVED observations over the long run,
    probes may cost UNCERTAIN_SHARE of plain time, not PROBE_SHARE; a hopeless draft is still left
    alone."""
    def first_probe() -> int:
        s = Scheduler()
        s.cost.cells = {(1, 0, 0): [(1, 0.033)] * 32, (1, 1, 1): [(1, 0.056)] * 3}
        s.cost.rounds = 1
        s.cost.set_apart.extend([((1, 1, 1), 0.20, "draft prefill"), ((1, 0, 0), 0.09, "plain pipeline start"),
                                 ((1, 0, 0), 0.042, "plain pipeline warm-up"), ((1, 1, 1), 0.03, "look-ahead discarded")])
        for _ in range(3):
            s.observe_cycle("first", 1, 0)
        for i in range(2000):
            if s.plan(["r"], 1, behind=[True], ahead=[True], pipelined=True)[0]:
                return i
        return 2000
    uncertain = first_probe()
    monkeypatch.setattr(scheduler.state, "FEW_OBSERVED", 0.0)
    known = first_probe()
    assert known > 200 and uncertain <= known * PROBE_SHARE / UNCERTAIN_SHARE + 1
    hopeless = Scheduler()
    hopeless.cost.cells = {(1, 0, 0): [(1, 0.0014)] * 32, (1, 1, 1): [(1, 0.0055)] * 3}
    hopeless.cost.rounds = 1
    assert not any(hopeless.plan(["r"], 1, ahead=[True], pipelined=True)[0] for _ in range(3 * PROBE_EVERY))


def test_drafting_tells_what_the_last_decision_with_room_chose():
    """The engine starts a lone request's plain pipeline at once only where the scheduler is not
    drafting; a request's last round, with no room to draft, and a probe leave that as it was."""
    s = Scheduler()
    s.cost.cells = {(1, 0, 0): [(1, 0.030)] * 9, (1, 1, 1): [(1, 0.036)] * 9}
    assert not s.drafting  # nothing decided yet
    for _ in range(40):
        s.observe_cycle("a", 1, 1)  # every draft accepted: drafting pays
    assert s.plan(["a"], 1, room=[8])[0] > 0 and s.drafting
    assert s.plan(["a"], 1, room=[0]) == [0] and s.drafting  # the request's last token
    for _ in range(60):
        s.observe_cycle("b", 1, 0)  # every draft rejected: plain pays
    s.forget("a")
    assert s.plan(["b"], 1, room=[8]) == [0] and not s.drafting


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


def test_a_probe_whose_draft_was_accepted_is_followed_by_another():
    """One probe's observation among SHARED_WEIGHT moves nothing, and probes far apart never fill
    the short memory that sees a change (α 0.9 → 0.2 → 0.9 on one request: one probe every ~48
    plain rounds, each hit lost, plain through the α = 0.9 third). A probe that hits is followed
    by another, until the estimate has followed the text and the decision drafts on its own; a
    probe that misses is not."""
    def after_a_bad_text() -> Scheduler:
        s = Scheduler()
        s.cost.cells = {(1, 0, 0): [(0, 0.033)] * 32, (1, 1, 1): [(0, 0.052)] * 32}
        for _ in range(60):
            s.observe_cycle("r", 1, 0)
        return s

    good = after_a_bad_text()
    rounds = []
    for _ in range(300):
        k = good.plan(["r"], 1)[0]
        rounds.append(k)
        if k:
            good.observe_cycle("r", k, k)  # the text changed: every draft is accepted now
    first = rounds.index(1)
    assert all(rounds[first:]) and good.drafting  # from the first probe on: probes, then drafting
    bad = after_a_bad_text()
    rounds = []
    for _ in range(300):
        k = bad.plan(["r"], 1)[0]
        rounds.append(k)
        if k:
            bad.observe_cycle("r", k, 0)
    probes = [i for i, k in enumerate(rounds) if k]
    assert len(probes) >= 2 and all(b - a > 1 for a, b in zip(probes, probes[1:]))  # a miss: plain again


def test_over_plain_rounds_the_server_wide_estimate_fades_to_the_long_run_one():
    """A draft accepted 3 in 10, then 60 plain rounds: the server-wide estimate's position 1 reads
    the long-run rate, worth FADE_WEIGHT cycles (the deeper positions fade to nothing, as before),
    so one probe's miss leaves it near that rate (faded to nothing,
    the miss took it to ~3/4 of it, and the next probes came as rarely as that priced them: α = 0.3
    on one request read 0.09-0.20 through a whole run and stayed plain, 0.90 of k = 1)."""
    s = Scheduler()
    for i in range(200):
        _drafting_round(s, "r", 1, int(i % 10 < 3))
    for _ in range(60):
        s._fade(["r"], [0])
    longrun = s.longrun.rates()[0]
    assert s.shared_rates()[0] == pytest.approx(longrun, abs=0.01)
    assert s.overall.tried[0] == pytest.approx(scheduler.FADE_WEIGHT, rel=0.1) and s.overall.tried[1] < 0.1
    _drafting_round(s, "r", 1, 0)  # a probe's miss
    assert s.shared_rates()[0] > 0.85 * longrun


def test_a_plain_figure_of_few_rounds_is_kept_and_explored_whatever_the_lead(tmp_path):
    """α = 0.6 on one request (this CPU): two plain rounds in 370, every other one set apart as a
    pipeline's restart; once those two expired the plain round was priced as k = 1's (152 ms, where
    it costs ~100), k = 3 led 1.9×, and no exploration came, since one is taken only under
    EXPLORE_MARGIN: 0.80 of k = 1. A plain cell keeps its rounds however few, and while it has fewer
    than MIN_SAMPLES a due exploration is taken whatever the lead."""
    cm = CostModel()
    for _ in range(2):
        cm.observe((1, 0, 0), 0.100)
    for _ in range(MAX_AGE + 1):
        cm.observe((1, 3, 3), 0.235)
    cm.commit()
    assert cm.table()[Cell(1, 0, 0)] == pytest.approx(0.100)
    s = Scheduler(log_path=str(tmp_path / "log.jsonl"))
    s.cost.cells = {(1, 0, 0): [(1, 0.100)] * 2, (1, 3, 3): [(1, 0.150)] * 9}
    s.cost.rounds = FEW_PLAIN_GAP + 1
    for _ in range(40):
        s.observe_cycle("old", 3, 3)
    d = s._decide(["r"], 1, [False], [40])[0]
    lead = _best(d.candidates).objective / d.candidates[0].objective
    assert lead > EXPLORE_MARGIN and d.explored and d.allocation == [0]
    s.cost.cells[(1, 0, 0)] = [(1, 0.100)] * MIN_SAMPLES  # enough plain rounds: the margin holds
    assert not s._decide(["r"], 1, [False], [40])[0].explored


def test_a_catch_up_is_priced_by_the_pieces_and_tokens_it_feeds():
    """On the H200 a catch-up costs by its pieces (one launch each), here by its tokens: the fit
    recovers either from catch-ups of several lags, ignores a shape's first, dear time, and prices
    a lag never seen (a probe late in a request that never drafted) by what it will feed."""
    by_pieces = [(0.006 * scheduler.feed_pieces(t), t, scheduler.feed_pieces(t)) for t in (4, 5, 6, 7, 12, 13, 20)]
    assert scheduler.fit_feed(by_pieces) == pytest.approx((0.006, 0.0), abs=1e-9)
    by_tokens = [(0.001 * t + 0.002 * scheduler.feed_pieces(t), t, scheduler.feed_pieces(t)) for t in (4, 7, 12, 31, 64)]
    assert scheduler.fit_feed(by_tokens) == pytest.approx((0.002, 0.001), abs=1e-9)
    cold = by_pieces + [(0.5, 8, 1)]  # one shape's first time
    assert scheduler.fit_feed(cold) == pytest.approx((0.006, 0.0), abs=1e-9)
    one_lag = [(0.012, 5, 2)] * 4  # one ratio of tokens to pieces: put on the pieces
    assert scheduler.fit_feed(one_lag) == pytest.approx((0.006, 0.0))
    assert scheduler.feed_pieces(109) == 5 and scheduler.feed_pieces(1100) == 2 + 3  # 512, 512, 64, 8, 4

    cm = CostModel()
    for t in (4, 5, 6, 4, 5):  # short sit-outs, as most catch-ups are
        cm.set_aside((1, 4, 4), 0.006 * scheduler.feed_pieces(t), "draft catch-up", (t, scheduler.feed_pieces(t)))
    cm.set_aside((1, 0, 0), 0.2, "cancel", (50, 3))  # not a catch-up: not fitted
    assert len(cm.fed) == 5
    assert cm.feed_seconds(1, 0) == 0.0
    assert cm.feed_seconds(1, 109) == pytest.approx(0.030)  # 5 pieces, where the median catch-up is 0.012
    assert cm.catch_up_seconds(1) == pytest.approx(0.012)
    assert CostModel().feed_seconds(1, 109) is None  # nothing measured
    few = CostModel()
    few.set_aside((1, 4, 4), 0.010, "draft catch-up", (5, 2))
    assert few.feed_seconds(1, 109) == pytest.approx(0.010)  # too few to fit: the median


def test_a_late_probe_waits_for_what_its_catch_up_costs():
    """One request that never drafted, on H200-like costs: a probe 60 rounds in feeds the prompt
    and every token since (5 pieces), not the median short catch-up; priced by its feed, the
    probes come further apart."""
    s = Scheduler()
    s.cost.cells = {(1, 0, 0): [(0, 0.006)] * 9, (1, 4, 4): [(0, 0.0165)] * 9}
    for t in (4, 5, 6, 4, 5, 6):
        s.cost.set_aside((1, 4, 4), 0.006 * scheduler.feed_pieces(t), "draft catch-up", (t, scheduler.feed_pieces(t)))
    for _ in range(4):
        s.observe_cycle("old", 4, 1)  # α ≈ 0.6 at position 1: drafting near break-even
    s.plan(["r"], 1, behind=[True], pipelined=True)
    by_median = s._probe_every
    s._held = None
    s.plan(["r"], 1, behind=[True], pipelined=True, feeds=[123])
    assert s._probe_every > by_median


def test_a_round_with_costs_apart_enters_the_table_at_its_own_time():
    """A round whose draft first caught up (its catch-up timed apart, with the tokens and pieces it
    fed) is priced at the round's time, the catch-up kept apart. A whole bench sched run read a
    338 ms k = 8 round at the 5.8 ms of its catch-up, priced k = 8 at 16 ms on the CPU, and drafted
    8 deep through α = 0.2: 0.69 of k = 2."""
    s = Scheduler()
    for _ in range(3):
        s.plan(["r"], 1)
        s._round = (1, 8, 8)
        s.observe_round(0.338, True, apart={"draft catch-up": (0.0058, 4, 1), "look-ahead taken": (0.017, 0, 0)})
    s.cost.commit()
    table, counts = s.cost.table_and_counts()
    assert counts[Cell(1, 8, 8)] == 3 and table[Cell(1, 8, 8)] == pytest.approx(0.338)
    assert sorted(why for _, _, why in s.cost.set_apart) == ["draft catch-up"] * 3 + ["look-ahead taken"] * 3
    assert s.cost.catch_up_seconds(1) == pytest.approx(0.0058)
