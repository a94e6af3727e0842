"""The acceptance estimates (worker/scheduler/acceptance.py) and how the Scheduler keeps them:
the three levels, fading, a change of text."""

from __future__ import annotations

import json

import pytest

from worker import scheduler
from worker.round import Cell
from worker.scheduler import Scheduler, probe_interval


def test_untried_positions_borrow_the_previous_position_estimate():
    good, bad = Scheduler(), Scheduler()
    for _ in range(20):
        good.observe_cycle("r", 1, 1)  # only position 1 was ever tried, always accepted
        bad.observe_cycle("r", 1, 0)
    g, b = good.acceptance["r"].rates(good.shared_rates()), bad.acceptance["r"].rates(bad.shared_rates())
    assert g[0] > 0.9 and g[1] > 0.8 and g[7] > 0.6  # untried, but likely as good as the first
    assert b[0] < 0.1 and max(b[1:]) < 0.4


def test_a_few_unlucky_cycles_do_not_stop_a_request_drafting():
    """Each request's estimate leans on the server-wide one: two rejections in a row (likely at
    a = 0.6) leave it near what the draft is, not at the 0.25 that would switch it off."""
    s = Scheduler()
    for i in range(60):
        s.observe_cycle(f"r{i % 3}", 1, int(i % 5 < 3))  # 60% accepted
    s.observe_cycle("unlucky", 1, 0)
    s.observe_cycle("unlucky", 1, 0)
    shared = s.shared_rates()
    assert 0.45 < shared[0] < 0.65
    assert s.acceptance["unlucky"].rates(shared)[0] > 0.4
    assert s.acceptance["unlucky"].rates()[0] < 0.3  # on its own counts alone


def test_new_requests_start_from_what_the_server_has_seen():
    s = Scheduler()
    for _ in range(30):
        s.observe_cycle("old", 2, 0)  # the draft is rejected at once, every time
    s.forget("old")
    fresh = s._acceptance("new").rates(s.shared_rates())
    assert fresh[0] < 0.25  # not the 0.5 of the bare prior
    for _ in range(15):
        s.observe_cycle("new", 2, 2)  # this request's own text is easy: it soon goes its own way
    assert s.acceptance["new"].rates(s.shared_rates())[0] > 0.6


def _drafting_round(s: Scheduler, rid: str, k: int, n: int) -> None:
    """A round in which request rid drafted k and n were accepted, as Scheduler.plan and the
    engine report it: the round's decay of the server-wide estimate, then the cycle."""
    s._fade([rid], [k])
    s.observe_cycle(rid, k, n)


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


def test_an_unlucky_spell_does_not_stop_drafting_for_good(tmp_path):
    """A draft accepted 43% of the time, where drafting pays from 25%: a spell of rejections takes
    the estimate under that, and rounds that draft nothing observe nothing. The estimates fade
    back toward what the draft showed over the long run, so drafting resumes by a decision, not
    only by probes (which observe nothing here)."""
    s = Scheduler(log_path=str(tmp_path / "log.jsonl"))
    s.cost.cells = {Cell(1, 0, 0): [(0, 0.048)] * 9, Cell(1, 1, 1): [(0, 0.060)] * 9}
    s.cost.set_apart = [(Cell(1, 1, 1), 0.5, "draft catch-up")]
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
