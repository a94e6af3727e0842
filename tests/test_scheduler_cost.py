"""The scheduler's allocation rule and its cost model: cells, the pace, what is kept apart."""

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

EXAMPLE = {"A": [0.95, 0.90, 0.85], "B": [0.80, 0.60, 0.40], "C": [0.60, 0.50, 0.30]}


def test_design_example():
    surv = [survivals(a) for a in EXAMPLE.values()]
    assert [[round(s, 3) for s in row] for row in surv] == [[0.95, 0.855, 0.727], [0.8, 0.48, 0.192], [0.6, 0.3, 0.09]]
    assert " ".join("ABC"[r] + str(j) for r, j in rank(surv)) == "A1 A2 B1 A3 C1 B2 C2 B3 C3"
    assert allocate(surv, 4) == [3, 1, 0]
    assert allocate(surv, 0) == [0, 0, 0] and allocate(surv, 9) == [3, 3, 3]


def test_ties_go_by_request_then_position():
    assert rank([[0.5, 0.5], [0.5]]) == [(0, 1), (0, 2), (1, 1)]
    assert allocate([[0.5, 0.5], [0.5]], 2) == [2, 0]


def _oracle(surv, budget):
    """Every prefix-closed allocation of exactly `budget` positions; the best total survival."""
    best, winners = -1.0, []
    for lengths in itertools.product(*(range(len(row) + 1) for row in surv)):
        if sum(lengths) != budget:
            continue
        total = sum(sum(row[:n]) for row, n in zip(surv, lengths))
        if total > best + 1e-12:
            best, winners = total, [list(lengths)]
        elif abs(total - best) <= 1e-12:
            winners.append(list(lengths))
    return best, winners


@pytest.mark.parametrize("seed", range(40))
def test_allocation_matches_brute_force(seed):
    rng = random.Random(seed)
    levels = [0.2, 0.5, 0.5, 0.8, 1.0]  # repeated values make ties
    surv = [survivals([rng.choice(levels) if seed % 2 else rng.random() for _ in range(rng.randint(1, 4))])
            for _ in range(rng.randint(1, 4))]
    for budget in range(sum(len(r) for r in surv) + 1):
        lengths = allocate(surv, budget)
        best, winners = _oracle(surv, budget)
        assert sum(lengths) == budget
        assert lengths in winners, (surv, budget, lengths, best)


def test_cost_model_keeps_only_complete_rounds():
    cm = CostModel()
    cm.observe((1, 0, 0), 0.010)
    cm.observe((1, 0, 0), 0.011)  # commits the first: one round late
    assert cm.table() == {Cell(1, 0, 0): 0.010}
    cm.interrupt("cancel")  # the second round turned out interrupted
    cm.commit()
    assert cm.table() == {Cell(1, 0, 0): 0.010} and cm.set_apart[-1][2] == "cancel"
    for t in (0.010, 0.012, 0.011, 0.5):  # 0.5 is a stall
        cm.observe((1, 0, 0), t)
    cm.commit()
    # the fourth round reads a pace of 1.1 against the cell's median (0.010): every figure × 1.1
    assert cm.pace == pytest.approx(1.1) and cm.table() == {Cell(1, 0, 0): pytest.approx(0.011)}
    assert cm.set_apart[-1][2] == "stall"
    cm.observe((1, 1, 1), 0.02)
    for _ in range(MAX_AGE - 1):
        cm.observe((1, 0, 0), 0.010)
    cm.commit()
    assert cm.counts() == {Cell(1, 0, 0): WINDOW, Cell(1, 1, 1): 1}
    cm.observe((1, 0, 0), 0.010)
    cm.commit()  # (1, 1, 1)'s one round was measured MAX_AGE rounds ago: it expires
    assert cm.counts() == {Cell(1, 0, 0): WINDOW}
    kept = CostModel()  # a cell of MIN_SAMPLES rounds keeps them, priced at today's pace
    for _ in range(MIN_SAMPLES):
        kept.observe((1, 1, 1), 0.02)
    for _ in range(MAX_AGE):
        kept.observe((1, 0, 0), 0.010)
    for _ in range(PACE_WINDOW):
        kept.observe((1, 0, 0), 0.012)
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
            cm.observe((4, 4, 1), 0.24)
        for _ in range(gap):
            cm.observe((4, 0, 0), 0.12)
        cm.observe((4, 4, 1), fresh)
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
            cm.observe((1, 0, 0), 0.0087)
        for _ in range(4):
            cm.observe((1, 8, 8), 0.0184)
        for _ in range(STALE_GAP + 1):
            cm.observe((1, 0, 0), 0.0060)
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
    def run(spell: list[tuple[tuple, float]]) -> CostModel:
        cm = CostModel()
        for _ in range(6):
            for _ in range(4):
                cm.observe((1, 0, 0), 0.0060)
            cm.observe((1, 1, 1), 0.0130)
            cm.observe((1, 5, 5), 0.0155)
        for key, t in spell:
            cm.observe(key, t)
        cm.commit()
        return cm
    slow = run([((1, 0, 0), 0.0095)] * 20)
    assert slow.pace == pytest.approx(0.0095 / 0.0060)
    assert slow.table()[Cell(1, 5, 5)] == pytest.approx(0.0155 * 0.0095 / 0.0060)
    assert decide([[0.6] * 5], 1, slow.table(), 8, counts=slow.counts()).budget == 0
    raw = {Cell(1, 0, 0): 0.0095, Cell(1, 1, 1): 0.0130, Cell(1, 5, 5): 0.0155}
    assert decide([[0.6] * 5], 1, raw, 8, counts={Cell(1, 0, 0): 20, Cell(1, 1, 1): 6, Cell(1, 5, 5): 6}).budget > 0  # it drafted
    back = run([((1, 0, 0), 0.0095)] * 20 + [((1, 0, 0), 0.0060)] * 20)
    assert back.pace == pytest.approx(1.0) and back.table()[Cell(1, 5, 5)] == pytest.approx(0.0155)
    drafting = run([((1, 5, 5), 0.0155 * 1.4)] * 20)
    assert drafting.table()[Cell(1, 0, 0)] == pytest.approx(0.0060 * 1.4)

def test_a_cell_that_starts_anew_keeps_nothing_of_the_rounds_it_dropped():
    """A tiny model's first drafting rounds cost 6× plain, its steady ones 1.2×: the cell started
    anew holds its one fresh round, which expires after MAX_AGE rounds like any figure of fewer
    than MIN_SAMPLES rounds; the dear rounds do not come back."""
    cm = CostModel()
    for _ in range(3):
        cm.observe((1, 0, 0), 0.003)
    for _ in range(5):
        cm.observe((1, 1, 1), 0.020)
    for _ in range(STALE_GAP + 1):
        cm.observe((1, 0, 0), 0.003)
    cm.observe((1, 1, 1), 0.004)
    cm.commit()
    assert cm.counts()[Cell(1, 1, 1)] == 1 and cm.table()[Cell(1, 1, 1)] == pytest.approx(0.004)
    for _ in range(MAX_AGE):
        cm.observe((1, 0, 0), 0.003)
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
            cm.observe((1, 0, 0), 0.036)
        for _ in range(5):
            cm.observe((1, 1, 1), 0.0535)
        for _ in range(60):
            cm.observe((1, 0, 0), plain_now)
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
        recent.observe((1, 0, 0) if t != 0.0535 else (1, 1, 1), t)
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
                cm.observe((1, 0, 0), 0.031)
            cm.observe((1, 1, 1), 0.046)
        for _ in range(30):
            cm.observe((1, 0, 0), 0.041)
        for _ in range(after):
            cm.observe((1, 1, 1), 0.046)
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
        wild.observe((1, 0, 0), 0.031)
    for _ in range(5):
        wild.observe((1, 1, 1), 0.046 * 5)
    for _ in range(STALE_GAP + 2):
        wild.observe((1, 1, 1), 0.046)
    wild.commit()
    assert wild.table()[Cell(1, 0, 0)] == pytest.approx(0.031 / PACE_BOUND)
    plain_only = CostModel()  # nothing drafted since: the plain cell keeps its own rounds
    for _ in range(STALE_GAP + 2):
        plain_only.observe((1, 0, 0), 0.031)
    plain_only.observe((1, 1, 1), 0.046)
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
            cm.observe((1, 0, 0), t)
        for _ in range(drafting):
            cm.observe((1, 1, 1), 0.0058, draft_s=0.0021)
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
            cm.observe((4, 4, 1), 0.180)
        for _ in range(FEW_ROUNDS):  # measured often enough to keep its figure (see the next test)
            cm.observe((4, 0, 0), 0.105)
            cm.observe((4, 12, 3), 0.382)
        for _ in range(STALE_GAP + 8):
            cm.observe((4, 8, 2), 0.151)
        if fresh is not None:
            cm.observe((4, 4, 1), fresh)
        cm.commit()
        return cm
    rates = [[0.53, 0.46, 0.48, 0.40]] * 4
    early = CostModel()
    for _ in range(5):
        early.observe((4, 4, 1), 0.180)
    for _ in range(5):
        early.observe((4, 8, 2), 0.151)
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
            cm.observe((1, 0, 0), 0.0326)
        for _ in range(k2_rounds):
            cm.observe((1, 2, 2), 0.095)
        for _ in range(gap):
            cm.observe((1, 1, 1), 0.047)
        cm.commit()
        return cm
    def depth(cm: CostModel) -> int:
        return decide(rates, 1, cm.table(), 16, counts=cm.counts()).allocation[0]
    assert depth(run(3, STALE_GAP)) == 1  # the dear figure stands while it is recent
    stale = run(3, STALE_GAP + 2)
    assert stale.counts()[Cell(1, 2, 2)] == 0 and depth(stale) >= 2
    stale.observe((1, 2, 2), 0.066)  # the fresh round: cheaper, the cell starts anew
    stale.commit()
    assert stale.table()[Cell(1, 2, 2)] == pytest.approx(0.066) and depth(stale) >= 2
    assert depth(run(FEW_ROUNDS, STALE_GAP + 2)) == 1  # measured often enough: its figure stands
    # ... in all: at α = 0.6 each fresh round, cheaper than the figure, started the cell anew, so it
    # never reached FEW_ROUNDS and was tried again every ~40 rounds for a whole run (k = 2 at 64 ms)
    retried = run(3, STALE_GAP + 2)
    for _ in range(FEW_ROUNDS - 3):
        retried.observe((1, 2, 2), 0.080)  # dearer than its neighbours imply, cheaper than its figure
        for _ in range(STALE_GAP + 2):
            retried.observe((1, 1, 1), 0.047)
        retried.commit()
    assert retried.counts()[Cell(1, 2, 2)] > 0  # measured FEW_ROUNDS times in all: its figure stands (0: priced by neighbours)
    dear_k1 = CostModel()
    for _ in range(4):
        dear_k1.observe((1, 0, 0), 0.030)
    for _ in range(MIN_SAMPLES):
        dear_k1.observe((1, 1, 1), 0.120)
    for _ in range(STALE_GAP + 2):
        dear_k1.observe((1, 0, 0), 0.030)
    dear_k1.commit()
    assert dear_k1.counts()[Cell(1, 1, 1)] == MIN_SAMPLES  # the first depth is not re-priced
    assert decide([[0.3] * 8], 1, dear_k1.table(), 16, counts=dear_k1.counts()).budget == 0


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
    s.cost.cells = {(1, 0, 0): [(1, 0.0367)] * 3, (1, 1, 1): [(1, 0.0461)] * 9}
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
    s.cost.cells = {(1, 0, 0): [(1, 0.038)], (1, 1, 1): [(1, 0.044)] * 9}
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
