"""The scheduler under the batch engine's rounds (issue #53, bench/simulator.py --batch): no round
is ever set apart (no look-ahead, batch switch, draft prefill or pipeline restart), nothing is
pipelined or computed ahead, every row is padded to the round's widest width. The rules must not
need what disappeared."""

from __future__ import annotations

from bench import simulator as sim
from worker import scheduler as S
from worker.round import RoundReport


def _row(name: str) -> sim.BatchScenario:
    return next(r for r in sim.batch_rows() if r.name == name)


def test_the_batch_engine_never_sets_a_round_apart():
    sc = _row("gpu α=0.8 N=8")
    sched, reports = S.Scheduler(), []
    observe = sched.observe
    sched.observe = lambda report: (reports.append(report), observe(report))
    sim.simulate_batch(sched, sc, 1, sim.random.Random(0), sim.Spells(sim.random.Random(1), sc.machine), sim.SimClock())
    assert reports and all(isinstance(r, RoundReport) and r.complete and not r.apart for r in reports)
    assert any(c.k for r in reports for c in r.cycles) and sched.cost.draft_step(8)


def test_adaptive_drafts_where_it_pays_and_keeps_plain_where_it_does_not():
    """One request on the H200 at α = 0.8: drafting pays 1.45× at k = 4, and adaptive keeps up with
    the best fixed k; eight on the compute-bound CPU at α = 0.6, where every k loses (0.68 at
    k = 1: every row is padded to the widest), adaptive stays within the tie band of plain."""
    one = sim.compare_batch(_row("gpu α=0.8 N=1"), 0)
    assert one["k=4"] > 1.4 * one["k=0"] and one["adaptive"] > 0.95 * max(one.values())
    eight = sim.compare_batch(_row("cpu α=0.6 N=8"), 0)
    assert eight["k=1"] < 0.7 * eight["k=0"] and eight["adaptive"] > 0.97 * eight["k=0"]
