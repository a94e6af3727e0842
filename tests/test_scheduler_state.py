"""The Scheduler the engine runs (worker/scheduler/state.py): holds, probes and explorations over
rounds, room caps, and its typed round interface (plan_round, observe)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from worker import scheduler
from worker.round import Cell, CycleReport, Paid, RoundInput, RoundPlan, RoundReport, RowState, SetApart
from worker.scheduler import (EXPLORE_MARGIN, FEW_PLAIN_GAP, MAX_AGE, MAX_HOLD, MIN_SAMPLES, PIPELINE_REASONS,
                              PIPELINE_WARM_ROUNDS, PLAIN_GAP, PROBE_EVERY, PROBE_SHARE, UNCERTAIN_SHARE, CostModel,
                              Scheduler, decide, plain_probe_interval, replay)
from worker.scheduler.decide import _best


def test_no_request_drafts_past_its_remaining_tokens():
    """A cycle emits its accepted drafts and one more token, so a request with r tokens left can
    use at most r - 1 drafts: fixed k and the adaptive allocation are both capped there."""
    fixed = Scheduler(fixed=4)
    assert fixed.plan(["a", "b"], 2, room=[2, 0]) == [2, 0]
    assert fixed.plan(["a"], 1) == [4]
    s = Scheduler()
    table = {Cell(2, 0, 0): 0.010, Cell(2, 2, 1): 0.0105, Cell(2, 4, 2): 0.011, Cell(2, 8, 4): 0.012}
    s.cost.cells = {k: [(1, v)] * 9 for k, v in table.items()}
    for _ in range(40):
        s.observe_cycle("a", 4, 4)
        s.observe_cycle("b", 4, 4)
    free = s.plan(["a", "b"], 2)
    assert min(free) >= 3
    assert s.plan(["a", "b"], 2, room=[1, 0]) == [1, 0]


def test_drafting_tells_what_the_last_decision_with_room_chose():
    """The engine starts a lone request's plain pipeline at once only where the scheduler is not
    drafting; a request's last round, with no room to draft, and a probe leave that as it was."""
    s = Scheduler()
    s.cost.cells = {Cell(1, 0, 0): [(1, 0.030)] * 9, Cell(1, 1, 1): [(1, 0.036)] * 9}
    assert not s.drafting  # nothing decided yet
    for _ in range(40):
        s.observe_cycle("a", 1, 1)  # every draft accepted: drafting pays
    assert s.plan(["a"], 1, room=[8])[0] > 0 and s.drafting
    assert s.plan(["a"], 1, room=[0]) == [0] and s.drafting  # the request's last token
    for _ in range(60):
        s.observe_cycle("b", 1, 0)  # every draft rejected: plain pays
    s.forget("a")
    assert s.plan(["b"], 1, room=[8]) == [0] and not s.drafting


def test_a_decision_governs_more_rounds_where_rounds_cost_little_next_to_deciding(tmp_path):
    """Deciding takes ~0.1 ms of Python: against a 50 ms round every round decides, against a
    microsecond round one decision holds for MAX_HOLD rounds (logged as held, skipped by replay);
    a request joining or leaving, or a due probe, ends the hold at once."""
    def sched(plain_s, log=None):
        s = Scheduler(log_path=log)
        s.cost.cells = {Cell(1, 0, 0): [(0, plain_s)] * 9, Cell(1, 1, 1): [(0, 2.5 * plain_s)] * 9, Cell(2, 0, 0): [(0, plain_s)] * 9}
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
    s.cost.cells = {Cell(1, 0, 0): [(1, 1.0e-6)] * 3, Cell(1, 1, 1): [(1, 1.15e-6)] * 9}  # k = 1 pays, by less than 1.25×
    s.cost.rounds = 1
    for i in range(100):
        s.observe_cycle(f"old{i // 50}", 1, int(i % 3 == 0))
    budgets: list[int] = []
    for i in range(PLAIN_GAP + 2):
        k = s.plan(["r"], 1)[0]
        if k:
            s.observe_cycle("r", k, int(i % 3 == 0))
        s.observe_round(1.15e-6 if k else 1.0e-6, True)
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
    s.cost.cells = {Cell(1, 0, 0): [(1, 1.0e-6)] * 3, Cell(1, 1, 1): [(1, 1.1e-6)] * 9}  # k = 1 leads 1.6×
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


def test_a_probe_whose_draft_was_accepted_is_followed_by_another():
    """One probe's observation among SHARED_WEIGHT moves nothing, and probes far apart never fill
    the short memory that sees a change (α 0.9 → 0.2 → 0.9 on one request: one probe every ~48
    plain rounds, each hit lost, plain through the α = 0.9 third). A probe that hits is followed
    by another, until the estimate has followed the text and the decision drafts on its own; a
    probe that misses is not."""
    def after_a_bad_text() -> Scheduler:
        s = Scheduler()
        s.cost.cells = {Cell(1, 0, 0): [(0, 0.033)] * 32, Cell(1, 1, 1): [(0, 0.052)] * 32}
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


def test_a_draft_seen_on_few_cycles_is_probed_until_it_is_known(monkeypatch):
    """Three rejections at a new server's start (α = 0.6, the controlled draft's first hard
    tokens) made an estimate of 0.14-0.20 that priced its own probes away: no probe in 280 rounds,
    adaptive 0.87 of k = 1. Until position 1 has FEW_OBSERVED observations over the long run,
    probes may cost UNCERTAIN_SHARE of plain time, not PROBE_SHARE; a hopeless draft is still left
    alone."""
    def first_probe() -> int:
        s = Scheduler()
        s.cost.cells = {Cell(1, 0, 0): [(1, 0.033)] * 32, Cell(1, 1, 1): [(1, 0.056)] * 3}
        s.cost.rounds = 1
        s.cost.set_apart.extend([(Cell(1, 1, 1), 0.20, "draft prefill"), (Cell(1, 0, 0), 0.09, "plain pipeline start"),
                                 (Cell(1, 0, 0), 0.042, "plain pipeline warm-up"), (Cell(1, 1, 1), 0.03, "look-ahead discarded")])
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
    hopeless.cost.cells = {Cell(1, 0, 0): [(1, 0.0014)] * 32, Cell(1, 1, 1): [(1, 0.0055)] * 3}
    hopeless.cost.rounds = 1
    assert not any(hopeless.plan(["r"], 1, ahead=[True], pipelined=True)[0] for _ in range(3 * PROBE_EVERY))


def test_a_late_probe_waits_for_what_its_catch_up_costs():
    """One request that never drafted, on H200-like costs: a probe 60 rounds in feeds the prompt
    and every token since (5 pieces), not the median short catch-up; priced by its feed, the
    probes come further apart."""
    s = Scheduler()
    s.cost.cells = {Cell(1, 0, 0): [(0, 0.006)] * 9, Cell(1, 4, 4): [(0, 0.0165)] * 9}
    for t in (4, 5, 6, 4, 5, 6):
        s.cost.set_aside(Cell(1, 4, 4), 0.006 * scheduler.feed_pieces(t), "draft catch-up", (t, scheduler.feed_pieces(t)))
    for _ in range(4):
        s.observe_cycle("old", 4, 1)  # α ≈ 0.6 at position 1: drafting near break-even
    s.plan(["r"], 1, behind=[True], pipelined=True)
    by_median = s._probe_every
    s._held = None
    s.plan(["r"], 1, behind=[True], pipelined=True, feeds=[123])
    assert s._probe_every > by_median


def test_plain_rounds_are_measured_again_while_drafting(tmp_path):
    """Nothing measures plain rounds while drafting pays on paper: a plain figure from one early
    round (36.7 ms where steady ones cost 33) kept one request drafting at α = 0.3, 8% below plain
    decoding. A drafting decision gives way to plain rounds every plain_probe_interval rounds (at
    least PLAIN_GAP): two where plain rounds are pipelined (the first restarts the pipeline and is
    set apart), and the fresh figure decides; not where drafting leads by EXPLORE_MARGIN or more,
    which no stale plain figure flips. Replay reproduces the choice from the log."""
    d = decide([[0.3]], 1, {Cell(1, 0, 0): 0.0367, Cell(1, 1, 1): 0.0461}, 8)
    assert d.budget == 1 and d.candidates[1].gain == pytest.approx(1.3)
    assert plain_probe_interval(d, 1) == PLAIN_GAP  # its loss, 1.2 ms a round, is small
    assert plain_probe_interval(d, 1, restart=0.08, discard=0.006) == 100  # (0.086 + 5 × 1.2 ms) / (2% of 0.0461)
    assert decide([[0.3]], 1, {Cell(1, 0, 0): 0.0367, Cell(1, 1, 1): 0.0461}, 8, explore_plain=True).allocation == [0]
    assert decide([[0.9]], 1, {Cell(1, 0, 0): 0.0367, Cell(1, 1, 1): 0.0461}, 8, explore_plain=True).allocation == [1]  # a 1.5× lead
    assert decide([[0.05]], 1, {Cell(1, 0, 0): 0.0367, Cell(1, 1, 1): 0.0461}, 8, probe=True, explore_plain=True).allocation == [1]
    log = tmp_path / "decisions.jsonl"
    s = Scheduler(log_path=str(log))
    s.cost.cells = {Cell(1, 0, 0): [(1, 0.0367)] * 3, Cell(1, 1, 1): [(1, 0.0461)] * 9}
    s.cost.rounds = 1
    for i in range(100):
        s.observe_cycle(f"old{i // 50}", 1, int(i % 3 == 0))
    budgets: list[int] = []
    for i in range(PLAIN_GAP + 8):
        k = s.plan(["r"], 1, ahead=[bool(budgets) and budgets[-1] == 0], pipelined=True)[0]
        if k:
            s.observe_cycle("r", k, int(i % 3 == 0))
            s.observe_round(0.0461, True)
        else:
            _observe_pipelined_plain(s, budgets, (0.085, 0.042, 0.033))
        budgets.append(k)
    assert budgets == [1] * PLAIN_GAP + [0] * 8
    assert s.cost.table()[Cell(1, 0, 0)] == 0.033
    assert replay(log.read_text().splitlines()) == []


def _observe_pipelined_plain(s: Scheduler, budgets: list[int], costs: tuple[float, float, float]) -> None:
    """A pipelined plain round as the engine reports it: the first after drafting starts the
    pipeline, the next ones warm it up (all set apart, PIPELINE_WARM_ROUNDS in all), then steady."""
    run = len(budgets) - next((i + 1 for i in reversed(range(len(budgets))) if budgets[i]), 0)
    if run < PIPELINE_WARM_ROUNDS:
        s.observe_round(costs[min(run, 1)], False, PIPELINE_REASONS[min(run, 1)])
    else:
        s.observe_round(costs[2], True)


def test_a_plain_cell_of_few_rounds_is_measured_again_soon(tmp_path):
    """An engine's first plain round (38 ms, against 31 ms steady) was the plain cell's only one,
    and k = 1 (44 ms) drafted 100 rounds at α = 0.3 before PLAIN_GAP let plain rounds be measured
    again. While the plain cell has fewer than MIN_SAMPLES rounds, plain rounds are explored
    every FEW_PLAIN_GAP drafting rounds, and the fresh figures stop the drafting."""
    log = tmp_path / "decisions.jsonl"
    s = Scheduler(log_path=str(log))
    s.cost.cells = {Cell(1, 0, 0): [(1, 0.038)], Cell(1, 1, 1): [(1, 0.044)] * 9}
    s.cost.rounds = 1
    for i in range(100):
        s.observe_cycle(f"old{i // 50}", 1, int(i % 10 < 3))
    budgets: list[int] = []
    for i in range(4 * FEW_PLAIN_GAP):
        k = s.plan(["r"], 1, ahead=[bool(budgets) and budgets[-1] == 0], pipelined=True)[0]
        if k:
            s.observe_cycle("r", k, int(i % 10 < 3))
            s.observe_round(0.044, True)
        else:
            _observe_pipelined_plain(s, budgets, (0.076, 0.042, 0.031))
        budgets.append(k)
    assert budgets[:FEW_PLAIN_GAP + 1] == [1] * FEW_PLAIN_GAP + [0]
    assert budgets[-FEW_PLAIN_GAP:] == [0] * FEW_PLAIN_GAP and s.cost.counts()[Cell(1, 0, 0)] >= MIN_SAMPLES
    assert replay(log.read_text().splitlines()) == []


def test_a_plain_figure_of_few_rounds_is_kept_and_explored_whatever_the_lead(tmp_path):
    """α = 0.6 on one request (this CPU): two plain rounds in 370, every other one set apart as a
    pipeline's restart; once those two expired the plain round was priced as k = 1's (152 ms, where
    it costs ~100), k = 3 led 1.9×, and no exploration came, since one is taken only under
    EXPLORE_MARGIN: 0.80 of k = 1. A plain cell keeps its rounds however few, and while it has fewer
    than MIN_SAMPLES a due exploration is taken whatever the lead."""
    cm = CostModel()
    for _ in range(2):
        cm.observe(Cell(1, 0, 0), 0.100)
    for _ in range(MAX_AGE + 1):
        cm.observe(Cell(1, 3, 3), 0.235)
    cm.commit()
    assert cm.table()[Cell(1, 0, 0)] == pytest.approx(0.100)
    s = Scheduler(log_path=str(tmp_path / "log.jsonl"))
    s.cost.cells = {Cell(1, 0, 0): [(1, 0.100)] * 2, Cell(1, 3, 3): [(1, 0.150)] * 9}
    s.cost.rounds = FEW_PLAIN_GAP + 1
    for _ in range(40):
        s.observe_cycle("old", 3, 3)
    d = s._decide(["r"], 1, [False], [40])[0]
    lead = _best(d.candidates).objective / d.candidates[0].objective
    assert lead > EXPLORE_MARGIN and d.explored and d.allocation == [0]
    s.cost.cells[Cell(1, 0, 0)] = [(1, 0.100)] * MIN_SAMPLES  # enough plain rounds: the margin holds
    assert not s._decide(["r"], 1, [False], [40])[0].explored


def test_a_batch_tail_explores_plain_only_where_drafting_leads_narrowly():
    """With fewer than MIN_SAMPLES plain rounds of an N, a due exploration is taken whatever the lead,
    except in a batch's tail (N under the most of the last PLAIN_GAP rounds): there its few rounds
    would all be explorations, and α = 0.9 ×4's tails decoded plain against leads of 1.26-1.50."""
    s = Scheduler()
    s.cost.cells = {Cell(4, 0, 0): [(1, 0.08)] * 9, Cell(4, 16, 4): [(1, 0.17)] * 9, Cell(1, 0, 0): [(1, 0.03)]}
    s.cost.rounds = FEW_PLAIN_GAP + 1
    for _ in range(40):
        s.observe_cycle("old", 4, 4)
    assert min(s._decide(["a", "b", "c", "d"], 4, [False] * 4, [40] * 4)[0].allocation) >= 4
    tail, _, _, margin = s._decide(["a"], 1, [False], [20])
    assert s._plain_due(1, 1)  # an exploration is due ...
    assert not tail.explored and margin == EXPLORE_MARGIN and tail.allocation[0] >= 4  # ... and not taken
    s.rounds += PLAIN_GAP + 1  # long since 4 were seen: one request is the steady state, explored whatever the lead
    steady, _, _, margin = s._decide(["a"], 1, [False], [20])
    assert margin is None and steady.explored and steady.allocation == [0]


class _Ticks:
    """A decision clock that advances a fixed step each read (as the simulator's does), so two
    schedulers fed the same rounds hold the same decisions."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _round_input(i: int, rng: random.Random) -> RoundInput:
    """Round i: one to three joint rows (their number changes every 50 rounds) in every state a row
    can be in (behind, ahead, out of room), and a baseline request every other 70 rounds."""
    rows = [RowState(f"r{j}", room=rng.choice([0, 2, 8, 40, 40, 40]), lag=rng.choice([0, 1, 2, 2, 2, 6, 30]),
                     lacks_prompt=rng.random() < 0.05, ahead=rng.random() < 0.3, plain_run=rng.randint(0, 6),
                     has_drafted=rng.random() < 0.8) for j in range(1 + (i // 50) % 3)]
    return RoundInput(rows, len(rows) + (i // 70) % 2, pipelined=len(rows) == 1)


def _round_report(inp: RoundInput, plan: RoundPlan, rng: random.Random) -> RoundReport:
    """The round as it might have run: each draft position right 7 times in 10, a cost by the
    round's shape, now and then a reason or a cost paid apart."""
    depth = max(plan.budgets.values(), default=0)
    cycles = []
    for r in inp.rows:
        k = plan.k(r.request_id)
        cycles.append(CycleReport(r.request_id, k, next((i for i in range(k) if rng.random() > 0.7), k)))
    apart = {SetApart.DRAFT_CATCH_UP: Paid(0.01, 6, 2)} if depth and rng.random() < 0.2 else {}
    if rng.random() < 0.1:
        apart[SetApart.LOOK_AHEAD_TAKEN] = Paid(0.004)
    seconds = (0.03 * inp.n_requests ** 0.5 + 0.008 * depth + 0.001 * plan.drafted) * rng.uniform(0.9, 1.1)
    reason = rng.choice([None] * 8 + [SetApart.PLAIN_PIPELINE_START, SetApart.DRAFT_PREFILL])
    return RoundReport(seconds, reason, apart, 0.002 * depth, cycles)


def _plan_as_lists(s: Scheduler, inp: RoundInput) -> RoundPlan:
    rows = inp.rows
    ks = s.plan([r.request_id for r in rows], inp.n_requests, [r.behind for r in rows], [r.room for r in rows],
                [r.ahead for r in rows], inp.pipelined, [r.feed for r in rows])
    return RoundPlan({r.request_id: k for r, k in zip(rows, ks)})


def _observe_as_parts(s: Scheduler, report: RoundReport) -> None:
    for c in report.cycles:
        s.observe_cycle(c.request_id, c.k, c.accepted)
    apart = {why: (p.seconds, p.tokens, p.pieces) for why, p in report.apart.items()}
    s.observe_round(report.seconds, report.complete, report.reason or "", apart, report.draft_s)


def _drive(tmp_path, typed_plan: bool, typed_observe: bool, seed: int = 0, rounds: int = 400) -> tuple[str, str, list]:
    """The same rounds through two schedulers, one of them through plan_round or observe: both
    logs, and the plans the typed one made."""
    rng = random.Random(seed)
    a, b = (Scheduler(log_path=str(tmp_path / f"{x}.jsonl"), clock=_Ticks(2e-3)) for x in "ab")
    plans = []
    for i in range(rounds):
        inp = _round_input(i, rng)
        plan = a.plan_round(inp) if typed_plan else _plan_as_lists(a, inp)
        assert plan == _plan_as_lists(b, inp)
        plans.append(plan)
        report = _round_report(inp, plan, rng)
        a.observe(report) if typed_observe else _observe_as_parts(a, report)
        _observe_as_parts(b, report)
        for r in inp.rows:
            if rng.random() < 0.01:
                a.forget(r.request_id)
                b.forget(r.request_id)
    a.flush_log()
    b.flush_log()
    assert a.cost.table_and_counts() == b.cost.table_and_counts() and a.shared_rates() == b.shared_rates()
    return (tmp_path / "a.jsonl").read_text(), (tmp_path / "b.jsonl").read_text(), plans


def test_plan_round_is_plan_of_the_rows_states(tmp_path):
    """The typed round (worker/round.py): each row's state gives plan's lists (behind: the prompt
    or a lag past CATCH_UP_LAG; feed: what that catch-up feeds), and the plan is plan's answer."""
    typed, lists, plans = _drive(tmp_path, typed_plan=True, typed_observe=False)
    assert typed == lists and replay(typed.splitlines()) == []
    assert any(p.drafted for p in plans) and any(not p.drafted for p in plans)  # it drafted, and not always
    assert '"held": true' in typed  # decisions held, as plan holds them
    assert any(p.budgets == {"r0": 0, "r1": 0} or p.budgets == {"r0": 0} for p in plans)
    s = Scheduler(fixed=4)
    inp = RoundInput([RowState("a", room=2), RowState("b", room=8, lag=6)], 3)
    plan = s.plan_round(inp)
    assert plan == RoundPlan({"a": 2, "b": 4}) and plan.drafted == 6 and s._round == Cell(3, 6, 4)


def test_observe_is_each_cycle_then_the_round(tmp_path):
    """A RoundReport observed whole is its cycles (observe_cycle) and then its time (observe_round,
    the costs paid apart as (seconds, tokens, pieces) by reason)."""
    typed, parts, _ = _drive(tmp_path, typed_plan=False, typed_observe=True, seed=1)
    assert typed == parts
    s = Scheduler(fixed=0)
    s.plan(["a"], 1)
    s.observe(RoundReport(0.05, None, {SetApart.DRAFT_CATCH_UP: Paid(0.02, 9, 2)}, 0.0, [CycleReport("a", 0, 0)]))
    s.plan(["a"], 1)
    assert s.cost.table() == {Cell(1, 0, 0): 0.05} and list(s.cost.fed) == [(1, 0.02, 9, 2)]
    s.observe(RoundReport(0.5, SetApart.PREFILL_OR_ERROR, {}, 0.0, [CycleReport("a", 1, 1)]))
    s.plan(["a"], 1)
    assert s.cost.set_apart[-1] == (Cell(1, 0, 0), 0.5, SetApart.PREFILL_OR_ERROR) and s.cost.table() == {Cell(1, 0, 0): 0.05}
    assert s.longrun.tried[0] == 1.0 and s.longrun.accepted[0] == 1.0  # the cycle was observed


def test_a_rounds_draft_budget_grows_with_its_rows_unless_set():
    """At 32 and 64 rows no 16 drafted tokens in all pay (docs/scheduler.md): unless set, a round
    may draft B_PER_ROW tokens a request, between DEFAULT_B_MAX and B_CEILING."""
    from worker.scheduler.state import B_CEILING, B_PER_ROW, DEFAULT_B_MAX

    s = Scheduler()
    assert [s.round_budget(n) for n in (1, 4, 8, 32, 64, 100)] == [DEFAULT_B_MAX, DEFAULT_B_MAX, 8 * B_PER_ROW,
                                                                   32 * B_PER_ROW, B_CEILING, B_CEILING]
    assert Scheduler(b_max=3).round_budget(64) == 3
