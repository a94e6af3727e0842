"""The never-lose rule (worker/scheduler/window.py): drafting rounds (probes among them) that
deliver fewer tokens per second than plain rounds of the same N, beyond noise, stop drafting for
that N for a cooldown that doubles on each repeated failure; then the decision's own rule,
probes included, resumes."""

from __future__ import annotations

import json

from worker.round import Cell, CycleReport, RoundReport, SetApart
from worker.scheduler import Scheduler, replay
from worker.scheduler.window import (COOLDOWN, LOSE_WINDOW, LOSS_MARGIN, MAX_COOLDOWN, MIN_JUDGED, SPAN, NeverLose,
                                     WindowState)


def _plain(rule: NeverLose, n: int, seconds: float, rounds: int = 8, start: int = 0) -> int:
    for r in range(start, start + rounds):
        rule.observe(n, r, n, seconds, 0, False)
    return start + rounds


def test_a_drafting_regime_that_loses_is_stopped_within_the_window():
    """32 rows at 10 ms a plain round; drafting rounds of 16 drafts deliver 10% fewer tokens a
    second: stopped as soon as the window may judge (MIN_JUDGED rounds)."""
    rule = NeverLose()
    r = _plain(rule, 32, 0.010)
    stopped = None
    for i in range(LOSE_WINDOW):
        stopped = rule.observe(32, r + i, 36, 0.0125, 16, False)  # 36 tokens in 12.5 ms: 0.9 of plain's 3.2 a ms
        if stopped:
            break
    assert i + 1 == MIN_JUDGED and isinstance(stopped, WindowState) and stopped.rounds == MIN_JUDGED
    assert abs(stopped.loss - 0.1) < 1e-9 and stopped.loss > stopped.bound > LOSS_MARGIN
    assert stopped.stopped_left == COOLDOWN and stopped.failures == 1 and stopped.cooldown == 2 * COOLDOWN
    before = rule.state(32)
    assert before.rounds == 0 and abs(before.plain_rate - 3200) < 1e-6  # the window starts anew


def test_a_regime_within_its_noise_or_the_margin_is_not():
    """A loss under LOSS_MARGIN is a tie; one request's drafting rounds deliver 1 or 2 tokens, so
    a 10% loss over 24 of them is within their noise (acceptance's and time's)."""
    tie = NeverLose()
    r = _plain(tie, 32, 0.010)
    assert not any(tie.observe(32, r + i, 32 + 16, 0.0152, 16, False) for i in range(200))  # 0.987 of plain
    assert tie.state(32).loss < LOSS_MARGIN
    one = NeverLose()
    r = _plain(one, 1, 0.010)
    for i in range(200):  # k = 1 at 0.5: 1.5 tokens in 16.7 ms, 0.9 of plain's 1 in 10
        assert not one.observe(1, r + i, 1 + i % 2, 0.0167, 1, False)
    state = one.state(1)
    assert LOSS_MARGIN < state.loss < state.bound


def test_a_stop_doubles_on_each_repeated_failure_up_to_a_bound():
    rule = NeverLose()
    r = _plain(rule, 8, 0.010)
    lengths = []
    for _ in range(8):
        while not rule.observe(8, r, 8, 0.020, 8, False):  # drafting at half of plain's tokens a second
            r += 1
        lengths.append(rule.state(8).stopped_left)
        while rule.stopped(8):
            r += 1
    assert lengths == [min(MAX_COOLDOWN, COOLDOWN * 2 ** i) for i in range(8)] and lengths[-1] == MAX_COOLDOWN
    for i in range(2 * LOSE_WINDOW):  # a whole window that does not lose: the next stop is a first one
        assert not rule.observe(8, r + i, 16, 0.010, 8, False)
    assert rule.state(8).failures == 0 and rule.state(8).cooldown == COOLDOWN


def test_probes_count_and_rounds_far_apart_drop_out():
    """Probes are drafting rounds a user feels: a run of dear ones stops them too. Rounds older than
    SPAN rounds leave the window, so probes far apart are judged by their interval's pricing."""
    dense = NeverLose()
    r = _plain(dense, 32, 0.010)
    assert any(dense.observe(32, r + i, 33, 0.015, 4, True) for i in range(MIN_JUDGED))
    sparse = NeverLose()
    r = _plain(sparse, 32, 0.010)
    assert not any(sparse.observe(32, r + i * SPAN // 4, 33, 0.015, 4, True) for i in range(100))
    assert sparse.state(32).rounds == 4 and sparse.state(32).probes == 4


def _drafting_that_pays_on_paper(log: str | None) -> Scheduler:
    """Four requests, a table that prices drafting at 1.1 plain rounds a depth: after a few plain
    rounds (drafts always wrong), drafts nearly always right, and drafting pays on paper."""
    s = Scheduler(log_path=log)
    s.cost.cells = {Cell(4, 0, 0): [(0, 0.010)] * 9, Cell(4, 4, 1): [(0, 0.011)] * 9, Cell(4, 8, 2): [(0, 0.012)] * 9,
                    Cell(4, 12, 3): [(0, 0.013)] * 9, Cell(4, 16, 4): [(0, 0.014)] * 9}
    for _ in range(50):
        s.observe_cycle("old", 4, 0)
    for _ in range(5):
        assert s.plan(IDS, 4) == [0] * 4
        s.observe(RoundReport(0.010, cycles=[CycleReport(r, 0, 0) for r in IDS]))
    for _ in range(50):
        s.observe_cycle("old", 4, 4)
    return s


IDS = ["a", "b", "c", "d"]


def test_drafting_that_loses_to_what_the_table_never_sees_is_stopped_then_tried_again(tmp_path):
    """Main's engine: a drafting row moved out of the batch and back, the rounds set apart as a
    batch switch, which no cell sees: drafting that pays on paper took 8× a plain round's time.
    Counted in the window, it stops within MIN_JUDGED drafting rounds; the stop drafts nothing and
    probes nothing for COOLDOWN rounds, then the decision drafts again, loses again, and stops for
    twice as long. Every decision replays."""
    log = tmp_path / "log.jsonl"
    s = _drafting_that_pays_on_paper(str(log))
    drafted = []
    for _ in range(400):
        lengths = s.plan(IDS, 4)
        drafted.append(sum(lengths))
        cycles = [CycleReport(r, k, k) for r, k in zip(IDS, lengths)]
        report = RoundReport(0.080, SetApart.BATCH_SWITCH, cycles=cycles) if any(lengths) else RoundReport(0.010, cycles=cycles)
        s.observe(report)
    runs = _runs([bool(d) for d in drafted])
    assert runs[0][0] and runs[0][1] <= MIN_JUDGED  # drafting, stopped within the window
    assert [n for drafts, n in runs[1:4:2]] == [COOLDOWN, 2 * COOLDOWN]  # nothing drafted, no probe, then twice as long
    s.flush_log()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(rec.get("halted") and rec["allocation"] == [0] * 4 for rec in records)
    stops = [rec["stopped"] for rec in records if "stopped" in rec]
    assert [st["stopped_left"] for st in stops[:2]] == [COOLDOWN, 2 * COOLDOWN] and stops[0]["loss"] > 0.3
    assert replay(log.read_text().splitlines()) == []


def _runs(xs: list[bool]) -> list[tuple[bool, int]]:
    out: list[tuple[bool, int]] = []
    for x in xs:
        out = out[:-1] + [(x, out[-1][1] + 1)] if out and out[-1][0] == x else out + [(x, 1)]
    return out


def test_a_typed_state_for_each_n():
    s = _drafting_that_pays_on_paper(None)
    state = s.window(4)
    assert state == WindowState(4, 0, 0, None, 400.0, None, None, 0, 0, COOLDOWN)  # 4 tokens a 10 ms plain round
    assert set(state.to_log()) == {"n", "rounds", "probes", "drafting_rate", "plain_rate", "loss", "bound",
                                   "stopped_left", "failures", "cooldown"}
