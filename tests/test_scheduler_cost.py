"""The cost model (worker/scheduler/cost.py): cells, the pace, what is kept apart, what is
measured again."""

from __future__ import annotations

import pytest

from worker import scheduler
from worker.round import Cell
from worker.scheduler import (FEW_ROUNDS, MAX_AGE, MIN_SAMPLES, PACE_BOUND, PACE_WINDOW, STALE_GAP, WINDOW, CostModel,
                              Scheduler, decide, estimate)


def test_cost_model_keeps_only_complete_rounds():
    cm = CostModel()
    cm.observe(Cell(1, 0, 0), 0.010)
    cm.observe(Cell(1, 0, 0), 0.011)  # commits the first: one round late
    assert cm.table() == {Cell(1, 0, 0): 0.010}
    cm.interrupt("cancel")  # the second round turned out interrupted
    cm.commit()
    assert cm.table() == {Cell(1, 0, 0): 0.010} and cm.set_apart[-1][2] == "cancel"
    for t in (0.010, 0.012, 0.011, 0.5):  # 0.5 is a stall
        cm.observe(Cell(1, 0, 0), t)
    cm.commit()
    # the fourth round reads a pace of 1.1 against the cell's median (0.010): every figure × 1.1
    assert cm.pace == pytest.approx(1.1) and cm.table() == {Cell(1, 0, 0): pytest.approx(0.011)}
    assert cm.set_apart[-1][2] == "stall"
    cm.observe(Cell(1, 1, 1), 0.02)
    for _ in range(MAX_AGE - 1):
        cm.observe(Cell(1, 0, 0), 0.010)
    cm.commit()
    assert cm.counts() == {Cell(1, 0, 0): WINDOW, Cell(1, 1, 1): 1}
    cm.observe(Cell(1, 0, 0), 0.010)
    cm.commit()  # (1, 1, 1)'s one round was measured MAX_AGE rounds ago: it expires
    assert cm.counts() == {Cell(1, 0, 0): WINDOW}
    kept = CostModel()  # a cell of MIN_SAMPLES rounds keeps them, priced at today's pace
    for _ in range(MIN_SAMPLES):
        kept.observe(Cell(1, 1, 1), 0.02)
    for _ in range(MAX_AGE):
        kept.observe(Cell(1, 0, 0), 0.010)
    for _ in range(PACE_WINDOW):
        kept.observe(Cell(1, 0, 0), 0.012)
    kept.commit()
    assert kept.counts()[Cell(1, 1, 1)] == MIN_SAMPLES and kept.table()[Cell(1, 1, 1)] == pytest.approx(0.024)
    s = Scheduler()
    s.plan(["a"], 1)
    s.observe_round(1.0, complete=False, reason="prefill")
    s.plan(["a"], 1)
    assert s.cost.table() == {} and s.cost.set_apart[-1][2] == "prefill"


def test_a_cell_measured_again_after_a_long_gap_starts_anew():
    """A batch's first drafting rounds priced k = 1 out (they cost more than its later ones); a
    probe STALE_GAP rounds later measures it again, and that cheaper fresh round replaces the
    stale ones. Within the gap, or dearer than them, rounds pool as usual."""
    def run(gap: int, fresh: float = 0.15) -> CostModel:
        cm = CostModel()
        for _ in range(5):
            cm.observe(Cell(4, 4, 1), 0.24)
        for _ in range(gap):
            cm.observe(Cell(4, 0, 0), 0.12)
        cm.observe(Cell(4, 4, 1), fresh)
        cm.commit()
        return cm
    late, soon, dearer = run(STALE_GAP + 1), run(STALE_GAP - 1, 0.23), run(STALE_GAP + 1, 0.30)
    assert late.table()[Cell(4, 4, 1)] == 0.15 and late.counts()[Cell(4, 4, 1)] == 1
    assert soon.table()[Cell(4, 4, 1)] == 0.24 and soon.counts()[Cell(4, 4, 1)] == 6
    assert dearer.table()[Cell(4, 4, 1)] == 0.24 and dearer.counts()[Cell(4, 4, 1)] == 6
    assert decide([[0.5]] * 4, 4, late.table(), 16, counts=late.counts()).budget == 4


def test_the_pace_is_read_only_against_a_cell_of_min_samples_rounds():
    """H200, α = 0.6: one plain round at the engine's start (8.7 ms; steady ones 6.0) was all the
    plain cell held when k = 8 was first measured (18.4 ms); set against it, the steady plain
    rounds would read a pace of 0.69, price k = 8 at 12.6 ms, 2.1× plain, where it costs 3.1×,
    and α = 0.6 drafted 8 deep at 23 ms a round. A round's pace is read against MIN_SAMPLES rounds
    of its cell or more; as many slow rounds are a slow spell."""
    def run(plain_rounds: int) -> CostModel:
        cm = CostModel()
        for _ in range(plain_rounds):
            cm.observe(Cell(1, 0, 0), 0.0087)
        for _ in range(4):
            cm.observe(Cell(1, 8, 8), 0.0184)
        for _ in range(STALE_GAP + 1):
            cm.observe(Cell(1, 0, 0), 0.0060)
        cm.commit()
        return cm
    one, enough = run(1), run(MIN_SAMPLES)
    assert one.pace == 1.0 and one.table()[Cell(1, 8, 8)] == pytest.approx(0.0184)  # not 0.0184 / 0.0087 × 0.0060
    assert enough.table()[Cell(1, 8, 8)] == pytest.approx(0.0184 / 0.0087 * 0.0060)
    priced = [estimate(cm.table(), 1, 8, 8, cm.counts()) for cm in (one, enough)]
    assert priced[0] > 1.3 * priced[1] and priced[0] > 2.9 * 0.0060  # near what it cost, not 2.1× plain


def test_cells_measured_in_different_spells_compare_through_the_pace():
    """H200, α = 0.6 (run C of the twenty-second session): k = 5 measured at 15.5 ms beside plain
    rounds of 6.0 (k = 1 at 13.0), then the host slowed and plain rounds read 9.5 ms. Priced raw,
    k = 5 cost 1.63 plain rounds, and it drafted through two runs where it lost; with the pace
    (9.5 ÷ 6.0) k = 5 costs 2.58 and k = 1 2.17, and plain rounds go on. Back at the old pace, so is k = 5's
    figure; one cell's rounds alone (k = 5 in a slow spell after plain rounds) move the pace and
    carry the plain figure with them."""
    def run(spell: list[tuple[Cell, float]]) -> CostModel:
        cm = CostModel()
        for _ in range(6):
            for _ in range(4):
                cm.observe(Cell(1, 0, 0), 0.0060)
            cm.observe(Cell(1, 1, 1), 0.0130)
            cm.observe(Cell(1, 5, 5), 0.0155)
        for key, t in spell:
            cm.observe(key, t)
        cm.commit()
        return cm
    slow = run([(Cell(1, 0, 0), 0.0095)] * 20)
    assert slow.pace == pytest.approx(0.0095 / 0.0060)
    assert slow.table()[Cell(1, 5, 5)] == pytest.approx(0.0155 * 0.0095 / 0.0060)
    assert decide([[0.6] * 5], 1, slow.table(), 8, counts=slow.counts()).budget == 0
    raw = {Cell(1, 0, 0): 0.0095, Cell(1, 1, 1): 0.0130, Cell(1, 5, 5): 0.0155}
    assert decide([[0.6] * 5], 1, raw, 8, counts={Cell(1, 0, 0): 20, Cell(1, 1, 1): 6, Cell(1, 5, 5): 6}).budget > 0  # it drafted
    back = run([(Cell(1, 0, 0), 0.0095)] * 20 + [(Cell(1, 0, 0), 0.0060)] * 20)
    assert back.pace == pytest.approx(1.0) and back.table()[Cell(1, 5, 5)] == pytest.approx(0.0155)
    drafting = run([(Cell(1, 5, 5), 0.0155 * 1.4)] * 20)
    assert drafting.table()[Cell(1, 0, 0)] == pytest.approx(0.0060 * 1.4)


def test_a_cell_that_starts_anew_keeps_nothing_of_the_rounds_it_dropped():
    """A tiny model's first drafting rounds cost 6× plain, its steady ones 1.2×: the cell started
    anew holds its one fresh round, which expires after MAX_AGE rounds like any figure of fewer
    than MIN_SAMPLES rounds; the dear rounds do not come back."""
    cm = CostModel()
    for _ in range(3):
        cm.observe(Cell(1, 0, 0), 0.003)
    for _ in range(5):
        cm.observe(Cell(1, 1, 1), 0.020)
    for _ in range(STALE_GAP + 1):
        cm.observe(Cell(1, 0, 0), 0.003)
    cm.observe(Cell(1, 1, 1), 0.004)
    cm.commit()
    assert cm.counts()[Cell(1, 1, 1)] == 1 and cm.table()[Cell(1, 1, 1)] == pytest.approx(0.004)
    for _ in range(MAX_AGE):
        cm.observe(Cell(1, 0, 0), 0.003)
    cm.commit()
    assert Cell(1, 1, 1) not in cm.table()


def test_a_stale_drafting_cell_follows_the_plain_rounds_load():
    """Only the chosen cell is measured, and this machine's speed drifts ±20% over tens of
    seconds: k = 1 measured beside plain rounds of 36 ms, then plain rounds slow to 44 ms. At an
    acceptance of 0.35 the old k = 1 figure (53.5 ms) would keep drafting, 13% worse than plain
    at today's speed; unmeasured for STALE_GAP rounds, it is priced by its ratio to the plain
    round, and drafting stops. And the other way: a faster spell makes the stale drafting figure
    cheaper with it (at 0.6 it then pays). The pace follows the plain rounds, so the drafting
    figure follows them at once, before it is stale."""
    def run(plain_now: float) -> CostModel:
        cm = CostModel()
        for _ in range(WINDOW):
            cm.observe(Cell(1, 0, 0), 0.036)
        for _ in range(5):
            cm.observe(Cell(1, 1, 1), 0.0535)
        for _ in range(60):
            cm.observe(Cell(1, 0, 0), plain_now)
        cm.commit()
        return cm
    slow, fast, same = run(0.044), run(0.030), run(0.036)
    assert slow.table()[Cell(1, 0, 0)] == pytest.approx(0.044, rel=0.01)
    assert slow.table()[Cell(1, 1, 1)] == pytest.approx(0.0535 * 0.044 / 0.036, rel=0.03)
    assert fast.table()[Cell(1, 1, 1)] == pytest.approx(0.0535 * 0.030 / 0.036, rel=0.03)
    assert same.table() == {Cell(1, 0, 0): pytest.approx(0.036), Cell(1, 1, 1): pytest.approx(0.0535)}
    assert decide([[0.35]], 1, slow.table(), 8, counts=slow.counts()).budget == 0
    assert decide([[0.6]], 1, fast.table(), 8, counts=fast.counts()).budget == 1
    assert decide([[0.6]], 1, {Cell(1, 0, 0): 0.030, Cell(1, 1, 1): 0.0535}, 8).budget == 0  # unscaled, it would not
    recent = CostModel()
    for t in [0.036] * WINDOW + [0.0535] * 5 + [0.044] * (STALE_GAP - 1):
        recent.observe(Cell(1, 0, 0) if t != 0.0535 else Cell(1, 1, 1), t)
    recent.commit()
    assert recent.table()[Cell(1, 1, 1)] == pytest.approx(0.0535 * 0.044 / 0.036, rel=0.03)


def test_a_stale_plain_cell_follows_the_drafting_rounds_pace():
    """The other way round, as a whole run's log showed it at α = 0.3: plain rounds of 31 ms,
    probes of k = 1 at 46 ms beside them, then a slow spell of plain rounds at 41 ms, after which
    the machine ran at its normal pace again while k = 1 was chosen (46 ms against the stale 41,
    it led at 0.3). The k = 1 rounds read the pace back at 1.0 within PACE_WINDOW rounds, and the
    plain figure follows; unmeasured for STALE_GAP rounds, it is also priced by the k = 1 rounds
    since, each ÷ k = 1's ratio to the plain round measured beside it (1.48). Either way drafting
    stops; the k = 1 rounds right after the slow spell, set against it, do not move that ratio."""
    def run(after: int) -> CostModel:
        cm = CostModel()
        for _ in range(12):  # probes among plain rounds
            for _ in range(8):
                cm.observe(Cell(1, 0, 0), 0.031)
            cm.observe(Cell(1, 1, 1), 0.046)
        for _ in range(30):
            cm.observe(Cell(1, 0, 0), 0.041)
        for _ in range(after):
            cm.observe(Cell(1, 1, 1), 0.046)
        cm.commit()
        return cm
    late, soon = run(STALE_GAP + 2), run(STALE_GAP - 2)
    assert late.table()[Cell(1, 0, 0)] == pytest.approx(0.031, rel=0.02)
    assert decide([[0.3]], 1, late.table(), 8, counts=late.counts()).budget == 0
    assert soon.table()[Cell(1, 0, 0)] == pytest.approx(0.031, rel=0.02)  # the pace, before the rounds are stale
    assert decide([[0.3]], 1, soon.table(), 8, counts=soon.counts()).budget == 0
    assert soon.pace == pytest.approx(1.0) and run(PACE_WINDOW // 2 - 1).pace == pytest.approx(0.041 / 0.031)
    wild = CostModel()  # a cell's first rounds 5× its steady ones move the pace PACE_BOUND at most
    for _ in range(8):
        wild.observe(Cell(1, 0, 0), 0.031)
    for _ in range(5):
        wild.observe(Cell(1, 1, 1), 0.046 * 5)
    for _ in range(STALE_GAP + 2):
        wild.observe(Cell(1, 1, 1), 0.046)
    wild.commit()
    assert wild.table()[Cell(1, 0, 0)] == pytest.approx(0.031 / PACE_BOUND)
    plain_only = CostModel()  # nothing drafted since: the plain cell keeps its own rounds
    for _ in range(STALE_GAP + 2):
        plain_only.observe(Cell(1, 0, 0), 0.031)
    plain_only.observe(Cell(1, 1, 1), 0.046)
    plain_only.commit()
    assert plain_only.table()[Cell(1, 0, 0)] == pytest.approx(0.031)


def test_a_plain_figure_from_a_slow_spell_is_capped_by_the_drafting_rounds_since():
    """A whole run's tiny pair: a slow spell's 20 plain rounds (5.2 ms, steady 2.0) priced the
    plain round at 5.2 ms, and the k = 1 rounds after it (5.8 ms, 2.1 of them drafting) read as
    paying at 0.5 (3.9 ms a token): it drafted 311 rounds. A drafting round less its drafting
    costs at least a plain round, so MIN_SAMPLES such rounds cap the plain figure at 3.7 ms, and
    drafting stops; where the plain figure is below the cap, nothing changes."""
    def run(spell: float, drafting: int) -> CostModel:
        cm = CostModel()
        for t in [0.002] * WINDOW + [spell] * 20:
            cm.observe(Cell(1, 0, 0), t)
        for _ in range(drafting):
            cm.observe(Cell(1, 1, 1), 0.0058, draft_s=0.0021)
        cm.commit()
        return cm
    few, enough = run(0.0052, MIN_SAMPLES - 1), run(0.0052, MIN_SAMPLES)
    assert few.table()[Cell(1, 0, 0)] == pytest.approx(0.0052)
    assert decide([[0.5]], 1, few.table(), 8, counts=few.counts()).budget == 1
    assert enough.table()[Cell(1, 0, 0)] == pytest.approx(0.0058 - 0.0021)
    assert decide([[0.5]], 1, enough.table(), 8, counts=enough.counts()).budget == 0
    steady = run(0.002, 2 * MIN_SAMPLES)
    assert steady.table()[Cell(1, 0, 0)] == pytest.approx(0.002)


def test_a_cell_the_ordering_contradicts_is_measured_again():
    """A batch's first k = 1 rounds (4 requests) cost 180 ms, more than its steady k = 2 rounds
    (151 ms) which then bounded it: k = 1 was never tried again, where it was 5% the better. Once
    unmeasured for STALE_GAP rounds, a cell dearer than one that does more work counts as
    unmeasured and is priced by its neighbours; the decision that follows tries it, and its fresh
    figure decides. A fresh round that confirms the old one restores it."""
    def run(fresh: float | None = None) -> CostModel:
        cm = CostModel()
        for _ in range(5):
            cm.observe(Cell(4, 4, 1), 0.180)
        for _ in range(FEW_ROUNDS):  # measured often enough to keep its figure (see the next test)
            cm.observe(Cell(4, 0, 0), 0.105)
            cm.observe(Cell(4, 12, 3), 0.382)
        for _ in range(STALE_GAP + 8):
            cm.observe(Cell(4, 8, 2), 0.151)
        if fresh is not None:
            cm.observe(Cell(4, 4, 1), fresh)
        cm.commit()
        return cm
    rates = [[0.53, 0.46, 0.48, 0.40]] * 4
    early = CostModel()
    for _ in range(5):
        early.observe(Cell(4, 4, 1), 0.180)
    for _ in range(5):
        early.observe(Cell(4, 8, 2), 0.151)
    early.commit()
    assert early.counts()[Cell(4, 4, 1)] == 5  # within STALE_GAP: the bound stands
    assert estimate(early.table(), 4, 4, 1, early.counts()) == pytest.approx(0.151)  # no dearer than k = 2
    stale = run()
    assert stale.counts()[Cell(4, 4, 1)] == 0 and stale.table()[Cell(4, 4, 1)] == pytest.approx(0.180)
    assert decide(rates, 4, stale.table(), 16, counts=stale.counts()).allocation == [1, 1, 1, 1]
    cheaper, confirmed = run(0.125), run(0.180)
    assert cheaper.table()[Cell(4, 4, 1)] == pytest.approx(0.125) and cheaper.counts()[Cell(4, 4, 1)] == 1
    assert decide(rates, 4, cheaper.table(), 16, counts=cheaper.counts()).allocation == [1, 1, 1, 1]
    assert confirmed.counts()[Cell(4, 4, 1)] == 6
    assert decide(rates, 4, confirmed.table(), 16, counts=confirmed.counts()).allocation == [2, 2, 2, 2]


def test_a_deeper_cell_seldom_measured_is_tried_again():
    """Three k = 2 rounds in a slow spell (95 ms, where steady ones cost 63-70) priced k = 2 out
    for a whole run at α = 0.9: k = 1 throughout, no depth past 2 ever tried, 0.90 of k = 4. Left
    STALE_GAP rounds, a cell past the first drafting depth measured fewer than FEW_ROUNDS times is
    priced by its neighbours, so the next decision tries it again and its fresh rounds decide; a
    cell measured that often keeps its figure, and so does a first depth (k = 1 rounds that lose
    are not tried again and again where drafting does not pay)."""
    rates = [[0.93] * 8]
    def run(k2_rounds: int, gap: int) -> CostModel:
        cm = CostModel()
        for _ in range(4):
            cm.observe(Cell(1, 0, 0), 0.0326)
        for _ in range(k2_rounds):
            cm.observe(Cell(1, 2, 2), 0.095)
        for _ in range(gap):
            cm.observe(Cell(1, 1, 1), 0.047)
        cm.commit()
        return cm
    def depth(cm: CostModel) -> int:
        return decide(rates, 1, cm.table(), 16, counts=cm.counts()).allocation[0]
    assert depth(run(3, STALE_GAP)) == 1  # the dear figure stands while it is recent
    stale = run(3, STALE_GAP + 2)
    assert stale.counts()[Cell(1, 2, 2)] == 0 and depth(stale) >= 2
    stale.observe(Cell(1, 2, 2), 0.066)  # the fresh round: cheaper, the cell starts anew
    stale.commit()
    assert stale.table()[Cell(1, 2, 2)] == pytest.approx(0.066) and depth(stale) >= 2
    assert depth(run(FEW_ROUNDS, STALE_GAP + 2)) == 1  # measured often enough: its figure stands
    # ... in all: at α = 0.6 each fresh round, cheaper than the figure, started the cell anew, so it
    # never reached FEW_ROUNDS and was tried again every ~40 rounds for a whole run (k = 2 at 64 ms)
    retried = run(3, STALE_GAP + 2)
    for _ in range(FEW_ROUNDS - 3):
        retried.observe(Cell(1, 2, 2), 0.080)  # dearer than its neighbours imply, cheaper than its figure
        for _ in range(STALE_GAP + 2):
            retried.observe(Cell(1, 1, 1), 0.047)
        retried.commit()
    assert retried.counts()[Cell(1, 2, 2)] > 0  # measured FEW_ROUNDS times in all: its figure stands (0: priced by neighbours)
    dear_k1 = CostModel()
    for _ in range(4):
        dear_k1.observe(Cell(1, 0, 0), 0.030)
    for _ in range(MIN_SAMPLES):
        dear_k1.observe(Cell(1, 1, 1), 0.120)
    for _ in range(STALE_GAP + 2):
        dear_k1.observe(Cell(1, 0, 0), 0.030)
    dear_k1.commit()
    assert dear_k1.counts()[Cell(1, 1, 1)] == MIN_SAMPLES  # the first depth is not re-priced
    assert decide([[0.3] * 8], 1, dear_k1.table(), 16, counts=dear_k1.counts()).budget == 0


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
        cm.set_aside(Cell(1, 4, 4), 0.006 * scheduler.feed_pieces(t), "draft catch-up", (t, scheduler.feed_pieces(t)))
    cm.set_aside(Cell(1, 0, 0), 0.2, "cancel", (50, 3))  # not a catch-up: not fitted
    assert len(cm.fed) == 5
    assert cm.feed_seconds(1, 0) == 0.0
    assert cm.feed_seconds(1, 109) == pytest.approx(0.030)  # 5 pieces, where the median catch-up is 0.012
    assert cm.catch_up_seconds(1) == pytest.approx(0.012)
    assert CostModel().feed_seconds(1, 109) is None  # nothing measured
    few = CostModel()
    few.set_aside(Cell(1, 4, 4), 0.010, "draft catch-up", (5, 2))
    assert few.feed_seconds(1, 109) == pytest.approx(0.010)  # too few to fit: the median


def test_a_round_with_costs_apart_enters_the_table_at_its_own_time():
    """A round whose draft first caught up (its catch-up timed apart, with the tokens and pieces it
    fed) is priced at the round's time, the catch-up kept apart. A whole bench sched run read a
    338 ms k = 8 round at the 5.8 ms of its catch-up, priced k = 8 at 16 ms on the CPU, and drafted
    8 deep through α = 0.2: 0.69 of k = 2."""
    s = Scheduler()
    for _ in range(3):
        s.plan(["r"], 1)
        s._round = Cell(1, 8, 8)
        s.observe_round(0.338, True, apart={"draft catch-up": (0.0058, 4, 1), "look-ahead taken": (0.017, 0, 0)})
    s.cost.commit()
    table, counts = s.cost.table_and_counts()
    assert counts[Cell(1, 8, 8)] == 3 and table[Cell(1, 8, 8)] == pytest.approx(0.338)
    assert sorted(why for _, _, why in s.cost.set_apart) == ["draft catch-up"] * 3 + ["look-ahead taken"] * 3
    assert s.cost.catch_up_seconds(1) == pytest.approx(0.0058)


def test_a_cells_first_round_far_past_plain_is_a_stall_kept_out_of_table_and_window():
    """A GPU builds kernels the first time it meets a shape: a drafting cell's first round at
    200x a plain round is set apart (neither the table nor the never-lose window counts it);
    the same cell's next round at its own pace enters the table."""
    s = Scheduler()
    for _ in range(MIN_SAMPLES + 1):
        s.plan(["a", "b"], 2)
        s._round = Cell(2, 0, 0)  # the round as planned: plain
        s.observe_round(0.010, complete=True)
    window_before = s.window(2).rounds
    s._round = Cell(2, 4, 2)
    s.observe_round(2.0, complete=True)  # 200x plain: no sample of the cell
    s.cost.commit()
    assert Cell(2, 4, 2) not in s.cost.table() and s.cost.set_apart[-1][2] == "stall"
    assert s.window(2).rounds == window_before
    s._round = Cell(2, 4, 2)
    s.observe_round(0.025, complete=True)  # 2.5x plain for up to 3 tokens a row: a sample
    s.cost.commit()
    assert s.cost.table()[Cell(2, 4, 2)] == pytest.approx(0.025)


def test_a_deep_cell_measured_dear_is_not_priced_by_its_neighbours_again_and_again():
    """H100, 32 rows, α = 0.8 (the batch model, the engine's round budget): plain rounds 14 ms,
    every row at k = 1 36 ms, every row 4 deep 79-81 ms, which k = 1's optimistic extrapolation
    prices at 47. Left STALE_GAP rounds, the deep cell (measured fewer than FEW_ROUNDS times) is
    priced by its neighbours and drafted once more; that fresh round, a little under the cell's
    median but within its rounds, confirms the figure: it joins them, and the cell is not priced
    by its neighbours again (before, it started the cell anew and the deep draft came back every
    ~35 rounds: 0.90-0.96 of plain)."""
    rates, deep = [[0.8] * 8] * 32, Cell(32, 128, 4)

    def plain(cm: CostModel, rounds: int) -> None:
        for _ in range(rounds):
            cm.observe(Cell(32, 0, 0), 0.014)
        cm.commit()

    def budget(cm: CostModel) -> int:
        return decide(rates, 32, cm.table(), 128, counts=cm.counts()).budget

    cm = CostModel()
    plain(cm, 8)
    for _ in range(4):
        cm.observe(Cell(32, 32, 1), 0.036)
    for t in (0.0796, 0.0811, 0.0788):
        cm.observe(deep, t)
    plain(cm, 4)
    assert budget(cm) == 0  # measured MIN_SAMPLES times: its figure stands
    plain(cm, STALE_GAP)
    assert cm.counts()[deep] == 0 and budget(cm) == 128  # seldom measured: priced by its neighbours, tried again
    cm.observe(deep, 0.0790)  # under its median (0.0796), over its cheapest round (0.0788)
    plain(cm, 4)
    assert cm.counts()[deep] == MIN_SAMPLES + 1 and budget(cm) == 0
    plain(cm, 2 * STALE_GAP)
    assert cm.counts()[deep] == MIN_SAMPLES + 1 and budget(cm) == 0  # confirmed: not priced by its neighbours again
    assert estimate(cm.table(), 32, 128, 4, cm.counts()) == pytest.approx(0.0793)
