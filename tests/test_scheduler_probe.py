"""Cheap probes by construction (worker/scheduler/probe.py): while drafting is off, a probe drafts
for a few rows only, a little, inside an ordinary round, rotating across the rows; it is priced
by its own cell, and followed by another only where it did better than expected."""

from __future__ import annotations

import json

from worker import scheduler
from worker.round import Cell
from worker.scheduler import (FREE_SIT_OUT, PROBE_DEPTH, PROBE_EVERY, PROBE_ROWS, PROBE_SHARE, UNCERTAIN_SHARE, Probe,
                              Scheduler, decide, plausible_acceptance, probe_count, probe_interval, replay, survivals)

# bench/simulator.py's GPU_BATCH with 32 rows (ms): plain 7.5; four rows drafting 1 or 2 cost the
# drafting round's fixed cost and draft steps (memory-bound, the verify as plain); every row at 1
GPU_32 = {Cell(32, 0, 0): 0.0075, Cell(32, 4, 1): 0.0110, Cell(32, 4, 2): 0.0126, Cell(32, 32, 1): 0.0140}


def _off(log: str | None = None) -> Scheduler:
    """A scheduler whose 32 requests' drafts are seldom right (0.3): drafting is off."""
    s = Scheduler(log_path=log)
    s.cost.cells = {c: [(0, v)] * 9 for c, v in GPU_32.items()}
    for i in range(300):
        s.observe_cycle("old", 1, int(i % 10 < 3))
    return s


def test_a_probe_drafts_for_few_rows_a_little_rotating_across_them(tmp_path):
    log = tmp_path / "log.jsonl"
    s = _off(str(log))
    ids = [f"r{i}" for i in range(32)]
    probes = []
    for _ in range(600):
        lengths = s.plan(ids, 32)
        if any(lengths):
            probes.append(lengths)
            for rid, k in zip(ids, lengths):
                if k:
                    s.observe_cycle(rid, k, 0)  # every draft missed: no follow-up
    assert len(probes) >= 8 and probe_count(32) == 32 // PROBE_ROWS == 4
    assert all(sum(k > 0 for k in p) == 4 for p in probes)  # a few rows, inside an ordinary round
    assert [max(p) for p in probes[:4]] == [1, 2, 1, 2] and PROBE_DEPTH == 2  # 1 to PROBE_DEPTH deep, in turn
    probed = [{i for i, k in enumerate(p) if k} for p in probes[:8]]
    assert set().union(*probed) == set(range(32))  # 8 probes: every row observed once, the fewest observed first
    s.flush_log()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(len(r.get("probe_rows", [])) == 4 for r in records if r.get("probe") and r.get("budget"))
    assert replay(log.read_text().splitlines()) == []


def test_a_probe_is_priced_by_its_own_cell():
    """Four rows drafting one token cost 1.5 plain rounds where every row drafting costs 1.9: the
    probe that drafts for a few rows comes about twice as often, as PROBE_SHARE allows."""
    rows = [survivals([0.3])] * 32
    few = Probe.of(rows, [1] * 4 + [0] * 28)
    every = Probe.of(rows, [1] * 32)
    first = [0.3] * 32
    assert (few.lengths.count(1), round(few.gain, 9)) == (4, 1.2)
    cheap, whole = probe_interval(GPU_32, 32, first=first, probe=few), probe_interval(GPU_32, 32, first=first, probe=every)
    assert FREE_SIT_OUT < cheap < 0.6 * whole


def test_a_probe_is_followed_only_where_it_beat_its_estimates():
    """One draft accepted among 8 rows is no news where 2.4 were expected: only a probe that
    accepts more drafts than its estimates expected is followed by another (with one row drafting
    one token, a hit, as before). A follow-up is priced at that chance (`Probe.beaten`)."""
    assert abs(Probe.of([[0.3]], [1]).beaten() - 0.3) < 1e-12
    eight = Probe.of([[0.3]] * 8, [1] * 8)
    assert 0.4 < eight.beaten() < 0.6  # P(more than 2.4 of 8 at 0.3) = P(3 or more)
    for accepted, followed in ((2, False), (3, True)):
        s = _off()
        ids = [f"r{i}" for i in range(64)]
        lengths = next(ls for ls in (s.plan(ids, 64) for _ in range(400)) if any(ls))
        drafted = [rid for rid, k in zip(ids, lengths) if k]
        assert len(drafted) == 8
        for j, rid in enumerate(drafted):
            s.observe_cycle(rid, 1, int(j < accepted))
        assert any(s.plan(ids, 64)) == followed


# one request whose drafting round costs 2.5 plain rounds and 3.5 ms a depth more: every draft
# accepted, 6 deep leads plain rounds by 1.5×; at 0.8 it loses, and at 0.9 it leads by less than 1.25×
DEAR_1 = {Cell(1, 0, 0): 0.0072, Cell(1, 1, 1): 0.018, Cell(1, 4, 4): 0.028, Cell(1, 6, 6): 0.034}
# an H100's one request (bench/simulator.py's H100_BATCH): every draft accepted leads by under 1.2×
H100_1 = {Cell(1, 0, 0): 0.0072, Cell(1, 1, 1): 0.0208, Cell(1, 4, 4): 0.0340, Cell(1, 6, 6): 0.0460}


def test_an_uncertain_draft_is_probed_more_only_where_it_could_plausibly_pay_well(monkeypatch):
    """At one row a probe observes position 1 once, so the uncertain share (10% of plain time
    until FEW_OBSERVED observations) lasted a whole run: the simulator's h100 α = 0.8 N = 1 read
    0.935 of plain (least 0.889). Probes may cost UNCERTAIN_SHARE only where drafting, at the
    most its acceptance plausibly is (the observations' upper bound), would lead plain rounds
    by UNCERTAIN_LEAD: three cycles seen leave that open, fourteen at 0.7 do not (probes come as
    where the draft is known), and on an H100's one request not even every draft accepted would."""
    def first_probe(accepted: list[int]) -> int:
        s = Scheduler()
        s.cost.cells = {c: [(0, v)] * 9 for c, v in DEAR_1.items()}
        s.cost.rounds = 1
        for n in accepted:
            s.observe_cycle("old", 4, n)
        return next((i for i in range(2000) if s.plan(["r"], 1)[0]), 2000)
    few, seen = [4, 1, 3], [4, 1, 3, 0, 2, 4, 1, 3, 0, 4, 2, 1, 0, 2]  # position 1 tried 3 and 14 times
    uncertain = first_probe(few), first_probe(seen)
    monkeypatch.setattr(scheduler.state, "FEW_OBSERVED", 0.0)
    known = first_probe(few), first_probe(seen)
    assert known[0] > 3 * PROBE_EVERY and uncertain[0] <= max(PROBE_EVERY, known[0] * PROBE_SHARE / UNCERTAIN_SHARE + 1)
    assert uncertain[1] == known[1] > 3 * PROBE_EVERY
    assert plausible_acceptance(0, 0) == 1.0 and 0.9 < plausible_acceptance(24, 34) < 0.92 < plausible_acceptance(8, 10)
    assert probe_interval(H100_1, 1, first=[0.8], plausible=1.0) == probe_interval(H100_1, 1, first=[0.8]) > PROBE_EVERY
    assert probe_interval(DEAR_1, 1, first=[0.8], plausible=1.0) < probe_interval(DEAR_1, 1, first=[0.8])


def test_a_decision_replays_the_probe_it_logged():
    acceptance = [[0.3, 0.3]] * 8
    d = decide(acceptance, 8, {Cell(8, 0, 0): 0.0070, Cell(8, 8, 1): 0.0120}, 16, probe=True, probe_rows=[2, 5],
               probe_depth=2)
    assert d.allocation == [0, 0, 2, 0, 0, 2, 0, 0] and d.budget == 4
    assert decide([[0.3]] * 8, 8, {Cell(8, 0, 0): 0.0070}, 16, probe=True, probe_rows=[2], probe_depth=2).allocation[2] == 1
