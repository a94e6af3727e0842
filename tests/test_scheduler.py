"""The draft-budget scheduler: allocation rule, cost model, decisions, replay, and exactness
of several joint requests decoded together under it."""

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
    assert cm.table() == {"1,0,0": 0.010}
    cm.interrupt("cancel")  # the second round turned out interrupted
    cm.commit()
    assert cm.table() == {"1,0,0": 0.010} and cm.set_apart[-1][2] == "cancel"
    for t in (0.010, 0.012, 0.011, 0.5):  # 0.5 is a stall
        cm.observe((1, 0, 0), t)
    cm.commit()
    # the fourth round reads a pace of 1.1 against the cell's median (0.010): every figure × 1.1
    assert cm.pace == pytest.approx(1.1) and cm.table() == {"1,0,0": pytest.approx(0.011)}
    assert cm.set_apart[-1][2] == "stall"
    cm.observe((1, 1, 1), 0.02)
    for _ in range(MAX_AGE - 1):
        cm.observe((1, 0, 0), 0.010)
    cm.commit()
    assert cm.counts() == {"1,0,0": WINDOW, "1,1,1": 1}
    cm.observe((1, 0, 0), 0.010)
    cm.commit()  # (1, 1, 1)'s one round was measured MAX_AGE rounds ago: it expires
    assert cm.counts() == {"1,0,0": WINDOW}
    kept = CostModel()  # a cell of MIN_SAMPLES rounds keeps them, priced at today's pace
    for _ in range(MIN_SAMPLES):
        kept.observe((1, 1, 1), 0.02)
    for _ in range(MAX_AGE):
        kept.observe((1, 0, 0), 0.010)
    for _ in range(PACE_WINDOW):
        kept.observe((1, 0, 0), 0.012)
    kept.commit()
    assert kept.counts()["1,1,1"] == MIN_SAMPLES and kept.table()["1,1,1"] == pytest.approx(0.024)
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
    assert late.table()["4,4,1"] == 0.15 and late.counts()["4,4,1"] == 1
    assert soon.table()["4,4,1"] == 0.24 and soon.counts()["4,4,1"] == 6
    assert dearer.table()["4,4,1"] == 0.24 and dearer.counts()["4,4,1"] == 6
    assert decide([[0.5]] * 4, 4, late.table(), 16, counts=late.counts())["budget"] == 4


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
    assert one.pace == 1.0 and one.table()["1,8,8"] == pytest.approx(0.0184)  # not 0.0184 / 0.0087 × 0.0060
    assert enough.table()["1,8,8"] == pytest.approx(0.0184 / 0.0087 * 0.0060)
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
    assert slow.table()["1,5,5"] == pytest.approx(0.0155 * 0.0095 / 0.0060)
    assert decide([[0.6] * 5], 1, slow.table(), 8, counts=slow.counts())["budget"] == 0
    raw = {"1,0,0": 0.0095, "1,1,1": 0.0130, "1,5,5": 0.0155}
    assert decide([[0.6] * 5], 1, raw, 8, counts={"1,0,0": 20, "1,1,1": 6, "1,5,5": 6})["budget"] > 0  # it drafted
    back = run([((1, 0, 0), 0.0095)] * 20 + [((1, 0, 0), 0.0060)] * 20)
    assert back.pace == pytest.approx(1.0) and back.table()["1,5,5"] == pytest.approx(0.0155)
    drafting = run([((1, 5, 5), 0.0155 * 1.4)] * 20)
    assert drafting.table()["1,0,0"] == pytest.approx(0.0060 * 1.4)

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
    assert cm.counts()["1,1,1"] == 1 and cm.table()["1,1,1"] == pytest.approx(0.004)
    for _ in range(MAX_AGE):
        cm.observe((1, 0, 0), 0.003)
    cm.commit()
    assert "1,1,1" not in cm.table()


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
    assert slow.table()["1,0,0"] == pytest.approx(0.044, rel=0.01)
    assert slow.table()["1,1,1"] == pytest.approx(0.0535 * 0.044 / 0.036, rel=0.03)
    assert fast.table()["1,1,1"] == pytest.approx(0.0535 * 0.030 / 0.036, rel=0.03)
    assert same.table() == {"1,0,0": pytest.approx(0.036), "1,1,1": pytest.approx(0.0535)}
    assert decide([[0.35]], 1, slow.table(), 8, counts=slow.counts())["budget"] == 0
    assert decide([[0.6]], 1, fast.table(), 8, counts=fast.counts())["budget"] == 1
    assert decide([[0.6]], 1, {"1,0,0": 0.030, "1,1,1": 0.0535}, 8)["budget"] == 0  # unscaled, it would not
    recent = CostModel()
    for t in [0.036] * WINDOW + [0.0535] * 5 + [0.044] * (STALE_GAP - 1):
        recent.observe((1, 0, 0) if t != 0.0535 else (1, 1, 1), t)
    recent.commit()
    assert recent.table()["1,1,1"] == pytest.approx(0.0535 * 0.044 / 0.036, rel=0.03)


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
    assert late.table()["1,0,0"] == pytest.approx(0.031, rel=0.02)
    assert decide([[0.3]], 1, late.table(), 8, counts=late.counts())["budget"] == 0
    assert soon.table()["1,0,0"] == pytest.approx(0.031, rel=0.02)  # the pace, before the rounds are stale
    assert decide([[0.3]], 1, soon.table(), 8, counts=soon.counts())["budget"] == 0
    assert soon.pace == pytest.approx(1.0) and run(PACE_WINDOW // 2 - 1).pace == pytest.approx(0.041 / 0.031)
    wild = CostModel()  # a cell's first rounds 5× its steady ones move the pace PACE_BOUND at most
    for _ in range(8):
        wild.observe((1, 0, 0), 0.031)
    for _ in range(5):
        wild.observe((1, 1, 1), 0.046 * 5)
    for _ in range(STALE_GAP + 2):
        wild.observe((1, 1, 1), 0.046)
    wild.commit()
    assert wild.table()["1,0,0"] == pytest.approx(0.031 / PACE_BOUND)
    plain_only = CostModel()  # nothing drafted since: the plain cell keeps its own rounds
    for _ in range(STALE_GAP + 2):
        plain_only.observe((1, 0, 0), 0.031)
    plain_only.observe((1, 1, 1), 0.046)
    plain_only.commit()
    assert plain_only.table()["1,0,0"] == pytest.approx(0.031)


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
    assert few.table()["1,0,0"] == pytest.approx(0.0052)
    assert decide([[0.5]], 1, few.table(), 8, counts=few.counts())["budget"] == 1
    assert enough.table()["1,0,0"] == pytest.approx(0.0058 - 0.0021)
    assert decide([[0.5]], 1, enough.table(), 8, counts=enough.counts())["budget"] == 0
    steady = run(0.002, 2 * MIN_SAMPLES)
    assert steady.table()["1,0,0"] == pytest.approx(0.002)


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
    assert early.counts()["4,4,1"] == 5  # within STALE_GAP: the bound stands
    assert estimate(early.table(), 4, 4, 1, early.counts()) == pytest.approx(0.151)  # no dearer than k = 2
    stale = run()
    assert stale.counts()["4,4,1"] == 0 and stale.table()["4,4,1"] == pytest.approx(0.180)
    assert decide(rates, 4, stale.table(), 16, counts=stale.counts())["allocation"] == [1, 1, 1, 1]
    cheaper, confirmed = run(0.125), run(0.180)
    assert cheaper.table()["4,4,1"] == pytest.approx(0.125) and cheaper.counts()["4,4,1"] == 1
    assert decide(rates, 4, cheaper.table(), 16, counts=cheaper.counts())["allocation"] == [1, 1, 1, 1]
    assert confirmed.counts()["4,4,1"] == 6
    assert decide(rates, 4, confirmed.table(), 16, counts=confirmed.counts())["allocation"] == [2, 2, 2, 2]


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
        return decide(rates, 1, cm.table(), 16, counts=cm.counts())["allocation"][0]
    assert depth(run(3, STALE_GAP)) == 1  # the dear figure stands while it is recent
    stale = run(3, STALE_GAP + 2)
    assert stale.counts()["1,2,2"] == 0 and depth(stale) >= 2
    stale.observe((1, 2, 2), 0.066)  # the fresh round: cheaper, the cell starts anew
    stale.commit()
    assert stale.table()["1,2,2"] == pytest.approx(0.066) and depth(stale) >= 2
    assert depth(run(FEW_ROUNDS, STALE_GAP + 2)) == 1  # measured often enough: its figure stands
    # ... in all: at α = 0.6 each fresh round, cheaper than the figure, started the cell anew, so it
    # never reached FEW_ROUNDS and was tried again every ~40 rounds for a whole run (k = 2 at 64 ms)
    retried = run(3, STALE_GAP + 2)
    for _ in range(FEW_ROUNDS - 3):
        retried.observe((1, 2, 2), 0.080)  # dearer than its neighbours imply, cheaper than its figure
        for _ in range(STALE_GAP + 2):
            retried.observe((1, 1, 1), 0.047)
        retried.commit()
    assert retried.counts()["1,2,2"] > 0  # measured FEW_ROUNDS times in all: its figure stands (0: priced by neighbours)
    dear_k1 = CostModel()
    for _ in range(4):
        dear_k1.observe((1, 0, 0), 0.030)
    for _ in range(MIN_SAMPLES):
        dear_k1.observe((1, 1, 1), 0.120)
    for _ in range(STALE_GAP + 2):
        dear_k1.observe((1, 0, 0), 0.030)
    dear_k1.commit()
    assert dear_k1.counts()["1,1,1"] == MIN_SAMPLES  # the first depth is not re-priced
    assert decide([[0.3] * 8], 1, dear_k1.table(), 16, counts=dear_k1.counts())["budget"] == 0


def test_plain_rounds_are_measured_again_while_drafting():
    """Nothing measures plain rounds while drafting pays on paper: a plain figure from one early
    round (36.7 ms where steady ones cost 33) kept one request drafting at α = 0.3, 8% below plain
    decoding. A drafting decision gives way to plain rounds every plain_probe_interval rounds (at
    least PLAIN_GAP): two where plain rounds are pipelined (the first restarts the pipeline and is
    set apart), and the fresh figure decides; not where drafting leads by EXPLORE_MARGIN or more,
    which no stale plain figure flips. Replay reproduces the choice from the log."""
    d = decide([[0.3]], 1, {"1,0,0": 0.0367, "1,1,1": 0.0461}, 8)
    assert d["budget"] == 1 and d["candidates"][1]["gain"] == pytest.approx(1.3)
    assert plain_probe_interval(d, 1) == PLAIN_GAP  # its loss, 1.2 ms a round, is small
    assert plain_probe_interval(d, 1, restart=0.08, discard=0.006) == 100  # (0.086 + 5 × 1.2 ms) / (2% of 0.0461)
    assert decide([[0.3]], 1, {"1,0,0": 0.0367, "1,1,1": 0.0461}, 8, explore_plain=True)["allocation"] == [0]
    assert decide([[0.9]], 1, {"1,0,0": 0.0367, "1,1,1": 0.0461}, 8, explore_plain=True)["allocation"] == [1]  # a 1.5× lead
    assert decide([[0.05]], 1, {"1,0,0": 0.0367, "1,1,1": 0.0461}, 8, probe=True, explore_plain=True)["allocation"] == [1]
    log = io.StringIO()
    s = Scheduler()
    s._log = log
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
    assert s.cost.table()["1,0,0"] == 0.033
    assert replay(log.getvalue().splitlines()) == []


def _observe_pipelined_plain(s: Scheduler, budgets: list[int], costs: tuple[float, float, float]) -> None:
    """A pipelined plain round as the engine reports it: the first after drafting starts the
    pipeline, the next ones warm it up (all set apart, PIPELINE_WARM_ROUNDS in all), then steady."""
    run = len(budgets) - next((i + 1 for i in reversed(range(len(budgets))) if budgets[i]), 0)
    if run < PIPELINE_WARM_ROUNDS:
        s.observe_round(costs[min(run, 1)], False, PIPELINE_REASONS[min(run, 1)])
    else:
        s.observe_round(costs[2], True)


def test_a_plain_cell_of_few_rounds_is_measured_again_soon():
    """An engine's first plain round (38 ms, against 31 ms steady) was the plain cell's only one,
    and k = 1 (44 ms) drafted 100 rounds at α = 0.3 before PLAIN_GAP let plain rounds be measured
    again. While the plain cell has fewer than MIN_SAMPLES rounds, plain rounds are explored
    every FEW_PLAIN_GAP drafting rounds, and the fresh figures stop the drafting."""
    log = io.StringIO()
    s = Scheduler()
    s._log = log
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
    assert budgets[-FEW_PLAIN_GAP:] == [0] * FEW_PLAIN_GAP and s.cost.counts()["1,0,0"] >= MIN_SAMPLES
    assert replay(log.getvalue().splitlines()) == []


def test_speculation_switches_off_when_it_does_not_pay():
    cheap = {"1,0,0": 1.0, "1,1,1": 1.05, "1,2,2": 1.1, "1,3,3": 1.15}
    assert decide([[0.9, 0.9, 0.9, 0.9]], 1, cheap, 8)["budget"] >= 3
    costly = {"1,0,0": 1.0, "1,1,1": 1.9, "1,2,2": 2.8}
    assert decide([[0.9, 0.9, 0.9]], 1, costly, 8)["budget"] == 0
    assert decide([[0.05, 0.05]], 1, cheap, 8)["budget"] == 0
    assert decide([[0.05]], 1, cheap, 8, probe=True)["budget"] == 1
    first = decide([[0.5]], 1, {}, 8)  # nothing measured: start plain
    assert first["budget"] == 0 and [c["B"] for c in first["candidates"]] == [0]


def test_deeper_drafts_are_tried_past_a_costly_first_depth():
    """Batched verify pads every row to the deepest draft: the first depth costs most, later ones
    little. Measured only that far, the scheduler still tries deeper depths (optimistically
    priced), and a measured deeper depth that pays is then chosen on its own figure."""
    rates = [[0.9] * 4 for _ in range(4)]
    measured = {"4,0,0": 0.28, "4,1,1": 0.41, "4,4,1": 0.45}
    d = decide(rates, 4, measured, 16)
    assert d["allocation"] == [4, 4, 4, 4] and max(c["D"] for c in d["candidates"]) == 4
    deeper = dict(measured, **{"4,8,2": 0.50, "4,12,3": 0.55, "4,16,4": 0.60})
    assert decide(rates, 4, deeper, 16)["allocation"] == [4, 4, 4, 4]
    costly = dict(measured, **{"4,8,2": 1.2})
    assert decide(rates, 4, costly, 16)["budget"] <= 4  # measured: a second depth does not pay


def test_a_depth_that_pays_past_depths_that_do_not_is_reached():
    """The H200's 0.8 B draft on the 9 B target (bench gpu): a plain round 5.8 ms, one of k = 1
    14.6 ms; at α = 0.95 k = 1 and 2 lose to plain rounds and k = 4 paid 1.33×. A reach of one
    depth past the deepest measured stopped at k = 2 and adaptive stayed plain (0.71 of k = 4):
    every depth is a candidate, priced by extrapolation until measured."""
    table = {"1,0,0": 0.0058, "1,1,1": 0.0146}
    d = decide([[0.95] * 8], 1, table, 16, draft_step=0.0021)
    assert d["budget"] >= 4 and [c["D"] for c in d["candidates"]] == list(range(9))
    by_depth = {c["D"]: c["objective"] for c in d["candidates"]}
    assert by_depth[1] < by_depth[0] < by_depth[d["budget"]]
    measured = dict(table, **{"1,8,8": 0.060})  # a deep round measured dear: plain again
    assert decide([[0.95] * 8], 1, measured, 16, draft_step=0.0021)["budget"] == 0


def test_one_slow_first_round_does_not_price_a_cell_out():
    """A cell of fewer than MIN_SAMPLES rounds costs at most what its neighbours imply, so one
    slow first round does not keep k = 1 from being measured again; with enough rounds its own
    median stands."""
    table = {"1,0,0": 0.010, "1,1,1": 0.050}
    assert decide([[0.6]], 1, table, 8, counts={"1,0,0": 9, "1,1,1": 1})["budget"] == 1
    assert decide([[0.6]], 1, table, 8, counts={"1,0,0": 9, "1,1,1": MIN_SAMPLES})["budget"] == 0


def test_a_round_costs_no_more_than_a_measured_one_doing_more_work():
    """Noise can leave a shallower cell dearer than a deeper one; the deeper one bounds it (only
    once it has MIN_SAMPLES rounds)."""
    table = {"4,0,0": 0.30, "4,4,1": 0.46, "4,8,2": 0.38}
    counts = {"4,0,0": 9, "4,4,1": 5, "4,8,2": 5}
    d = decide([[0.6, 0.0]] * 4, 4, table, 16, counts=counts)
    assert d["allocation"] == [1, 1, 1, 1]
    assert next(c["cost"] for c in d["candidates"] if c["B"] == 4) == 0.38
    thin = dict(counts, **{"4,8,2": 1})
    assert next(c["cost"] for c in decide([[0.6, 0.0]] * 4, 4, table, 16, counts=thin)["candidates"] if c["B"] == 4) == 0.46


def test_a_shrinking_batch_starts_from_what_the_larger_one_measured():
    table = {"4,0,0": 0.28, "4,4,1": 0.40, "4,16,4": 0.60, "3,0,0": 0.21}
    d = decide([[0.9] * 4 for _ in range(3)], 3, table, 16)
    assert d["allocation"] == [4, 4, 4]  # depth 4 at once, priced 0.60 × 0.21 / 0.28
    assert any(c["D"] == 4 and abs(c["cost"] - 0.45) < 1e-9 for c in d["candidates"])
    # nothing of 3 measured: 4's rounds of the same drafts a request price it (its plain round stands in for 3's)
    d = decide([[0.9] * 4 for _ in range(3)], 3, {"4,0,0": 0.28, "4,16,4": 0.60}, 16)
    assert d["allocation"] == [4, 4, 4] and d["candidates"][0]["cost"] == 0.28
    assert any(c["D"] == 4 and c["cost"] == 0.60 for c in d["candidates"])
    assert decide([[0.1] * 4 for _ in range(3)], 3, {"4,0,0": 0.28, "4,16,4": 0.60}, 16)["budget"] == 0  # where it does not pay
    one = {"4,0,0": 0.08, "4,12,3": 0.15, "4,16,4": 0.17}  # α = 0.9 ×4 on this CPU; a lone tail request
    assert estimate(one, 1, 4, 4) == 0.17 and estimate(one, 1, 3, 3) == 0.15 and estimate(one, 1, 0, 0) == 0.08
    assert decide([[0.9] * 8], 1, one, 16)["allocation"][0] >= 4  # (deeper ones extrapolated, as at any N)
    assert estimate({}, 1, 0, 0) is None  # nothing measured at all: start plain


def test_a_batch_tail_explores_plain_only_where_drafting_leads_narrowly():
    """With fewer than MIN_SAMPLES plain rounds of an N, a due exploration is taken whatever the lead,
    except in a batch's tail (N under the most of the last PLAIN_GAP rounds): there its few rounds
    would all be explorations, and α = 0.9 ×4's tails decoded plain against leads of 1.26-1.50."""
    s = Scheduler()
    s.cost.cells = {(4, 0, 0): [(1, 0.08)] * 9, (4, 16, 4): [(1, 0.17)] * 9, (1, 0, 0): [(1, 0.03)]}
    s.cost.rounds = FEW_PLAIN_GAP + 1
    for _ in range(40):
        s.observe_cycle("old", 4, 4)
    assert min(s._decide(["a", "b", "c", "d"], 4, [False] * 4, [40] * 4)["allocation"]) >= 4
    tail = s._decide(["a"], 1, [False], [20])
    assert s._plain_due(1, 1)  # an exploration is due ...
    assert not tail["explored"] and tail["margin"] == EXPLORE_MARGIN and tail["allocation"][0] >= 4  # ... and not taken
    s.rounds += PLAIN_GAP + 1  # long since 4 were seen: one request is the steady state, explored whatever the lead
    steady = s._decide(["a"], 1, [False], [20])
    assert steady["margin"] is None and steady["explored"] and steady["allocation"] == [0]


def test_untried_positions_borrow_the_previous_position_estimate():
    good, bad = Scheduler(), Scheduler()
    for _ in range(20):
        good.observe_cycle("r", 1, 1)  # only position 1 was ever tried, always accepted
        bad.observe_cycle("r", 1, 0)
    g, b = good.acceptance["r"].rates(good.shared_rates()), bad.acceptance["r"].rates(bad.shared_rates())
    assert g[0] > 0.9 and g[1] > 0.8 and g[7] > 0.6  # untried, but likely as good as the first
    assert b[0] < 0.1 and max(b[1:]) < 0.4


def test_probes_come_as_often_as_their_expected_loss_allows():
    """A probe drafts one token for every request; it comes every FREE_SIT_OUT plain rounds where
    its expected loss is small (acceptance near where drafting pays), rarely where a probe costs
    much more than what it is expected to yield (a useless draft, a catch-up, a launch-bound GPU draft)."""
    assert probe_interval({}, 1) == PROBE_EVERY
    cpu = {"4,0,0": 0.123, "4,4,1": 0.160}  # the embedded model, 4 requests (bench sched)
    assert probe_interval(cpu, 4, first=[0.3] * 4) == FREE_SIT_OUT  # yields 5.2 tokens at 1.3× plain
    assert probe_interval(cpu, 4, first=[0.0] * 4) == 16  # (0.160 - 0.123) / (2% of 0.123), rounded up
    assert probe_interval(cpu, 4, catch_up=0.14, first=[0.0] * 4) == 72  # its drafts first catch up: 0.160 + 0.14
    assert probe_interval(cpu, 4, catch_up=0.14, first=[0.3] * 4, behind=True) == 58  # a draft is behind already
    one = {"1,0,0": 0.054, "1,1,1": 0.068}  # one request: plain rounds pipeline the next forward
    assert probe_interval(one, 1, first=[0.3]) == FREE_SIT_OUT
    assert probe_interval(one, 1, first=[0.3], discard=0.054) == 48  # a probe throws the forward ahead away: 0.068 + 0.054
    assert probe_interval(one, 1, first=[0.3], discard=0.054, restart=0.045) == 90  # ... and the plain round after restarts it
    slow = {"1,0,0": 0.009, "1,1,1": 0.020}  # a dear draft: a probe costs 2.2 plain rounds
    assert probe_interval(slow, 1, first=[0.0]) == 62  # (0.020 - 0.009) / (2% of 0.009), rounded up
    # a hit at 0.5 is followed by another probe, 1 more expected: (1 + 1) × (0.020 - 1.5 × 0.009) / (2% of 0.009)
    assert probe_interval(slow, 1, first=[0.5]) == 73
    gpu = {"1,0,0": 0.009, "1,1,1": 0.050}  # a launch-bound draft: 5.6 plain rounds, no acceptance pays
    assert probe_interval(gpu, 1, first=[0.5]) == probe_interval(gpu, 1, first=[1.0]) == HOPELESS_EVERY
    # the H200's rounds: k = 1 costs 3 plain rounds, and no depth within reach (2) pays; with the draft
    # step measured (1.5 ms), k = 8 costs at least k = 2's estimate + 6 × 1.5 ms for 9 tokens: worth probing
    h200 = {"1,0,0": 0.0065, "1,1,1": 0.0198}
    assert probe_interval(h200, 1, first=[0.95]) == HOPELESS_EVERY
    assert probe_interval(h200, 1, first=[0.95], draft_step=0.0015) < HOPELESS_EVERY
    # a tiny pair whose draft step (11 ms) costs more than a plain round (6.7 ms) stays hopeless
    tiny = {"1,0,0": 0.0067, "1,1,1": 0.0254}
    assert probe_interval(tiny, 1, first=[0.95], draft_step=0.011) == HOPELESS_EVERY
    d = decide([[0.05], [0.1], []], 3, {"3,0,0": 1.0, "3,2,1": 1.5}, 8, probe=True)
    assert d["allocation"] == [1, 1, 0] and d["budget"] == 2  # the third request has no room


def test_a_probe_drafts_the_best_drafting_allocation_where_it_is_deeper():
    """The H200's 0.8 B draft: k = 1 costs 2.3 plain rounds and k = 8 3.1, so a k = 1 probe can
    never pay and never observes the deeper positions; in simulation three early misses at
    positions 2-3 kept α = 0.8 plain for whole runs (0.68-0.78 of k = 8). A probe drafts what the
    best drafting candidate would (here 3 deep), at least one token for each request, and is
    priced by that candidate; where k = 1 is the best drafting candidate (the CPU), it is k = 1."""
    gpu = {"1,0,0": 0.0060, "1,1,1": 0.0140, "1,8,8": 0.0185}
    d = decide([[0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], 1, gpu, 8, probe=True)
    assert _best(d["candidates"])["B"] == 0 and d["allocation"] == [3]  # 2.0 tokens for 15.3 ms (interpolated)
    assert decide([[0.6] * 8], 1, gpu, 8)["allocation"] == [0]  # no probe: plain
    cpu = {"4,0,0": 0.123, "4,4,1": 0.160, "4,8,2": 0.230}
    assert decide([[0.2, 0.2]] * 4, 4, cpu, 8, probe=True)["allocation"] == [1, 1, 1, 1]
    deep = _best_drafting(d["candidates"])
    shallow = probe_interval(gpu, 1, first=[0.6])  # priced as a k = 1 probe: 14 ms for 1.6 tokens
    # 15.3 ms for 2.0 tokens loses less; each × 2.5, with the 1.5 probe rounds expected to follow hits at 0.6
    assert (shallow, probe_interval(gpu, 1, first=[0.6], drafting=deep)) == (92, 63)
    s = Scheduler()
    s.cost.cells = {(1, 0, 0): [(0, 0.009)] * 5, (1, 1, 1): [(0, 0.015)] * 5}
    for _ in range(100):
        s.observe_cycle("r", 1, 0)
    a = s.acceptance["r"].rates(s.shared_rates())[0]
    budgets = [s.plan(["r"], 1)[0] for _ in range(300)]
    first = math.ceil((0.015 - 0.009 * (1 + a)) / (0.02 * 0.009))
    assert a < 0.05 and budgets.index(1) == first and sum(budgets) == 300 // (first + 1)
    s.cost.cells[(1, 1, 1)] = [(0, 0.050)] * 5  # no acceptance would pay: no probe
    assert sum(s.plan(["r"], 1)[0] for _ in range(300)) == 0


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
    monkeypatch.setattr(scheduler, "MAX_HOLD", 0)  # decide every round: 32 tokens of ms rounds would hold most decisions
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


def test_a_depth_past_the_deepest_measured_costs_at_least_a_draft_step():
    """On this CPU a verify of 5 tokens costs what one of 3 does, so past k = 2 a depth costs
    little more than its draft step (the controlled draft's: a few ms). The cheapest step seen
    (13.7 ms, plain to k = 1) priced k = 4 at 100 ms where the fixed k = 4 engine's rounds cost
    ~86, and α = 0.9 on one request stayed at k = 1 (0.89 of k = 4). With the draft step measured
    per depth, a depth past the deepest measured is priced at no more than a draft step a depth
    more: deeper depths are tried; where acceptance does not pay for them, they are not."""
    table = {"1,0,0": 0.0306, "1,1,1": 0.0443, "1,2,2": 0.0682, "1,3,3": 0.0863}
    counts = {"1,0,0": 32, "1,1,1": 32, "1,2,2": 32, "1,3,3": 3}
    high, low = [[0.86] * 8], [[0.6] * 8]
    assert decide(high, 1, table, 16, counts=counts)["budget"] == 1
    d = decide(high, 1, table, 16, counts=counts, draft_step=0.002)
    assert d["budget"] >= 4 and any(c["B"] == 4 and abs(c["cost"] - 0.0883) < 1e-9 for c in d["candidates"])
    assert decide(low, 1, table, 16, counts=counts, draft_step=0.002)["budget"] == 1
    cm = CostModel()
    cm.observe((1, 2, 2), 0.070, draft_s=0.016)
    cm.observe((1, 4, 4), 0.090, draft_s=0.036)
    cm.observe((1, 4, 4), 0.095, draft_s=0.040)
    cm.interrupt("cancel")  # an interrupted round's drafting is no sample either
    cm.observe((1, 0, 0), 0.030)
    cm.commit()
    assert cm.draft_step(1) == pytest.approx(0.0085) and cm.draft_step(4) is None


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


def test_a_depth_past_a_dear_step_is_priced_at_the_cheapest_step_seen():
    """CPU costs are staircases (here 48 → 60 → 93 ms for depths 0, 1, 2; depth 4 measured later
    at 121): past the deepest measured depth the next one is priced at the cheapest step per depth
    measured so far, so at acceptance 0.9 deeper depths are tried; where every step is dear they
    are not."""
    table = {"1,0,0": 0.048, "1,1,1": 0.060, "1,2,2": 0.093}
    d = decide([[0.9] * 8], 1, table, 8)
    assert any(c["D"] == 3 and abs(c["cost"] - 0.105) < 1e-9 for c in d["candidates"])
    assert d["budget"] >= 3
    linear = {"1,0,0": 0.048, "1,1,1": 0.080, "1,2,2": 0.112}
    assert decide([[0.9] * 8], 1, linear, 8)["budget"] < 3


def test_starting_to_draft_pays_the_drafts_catch_up():
    """A draft that sat out must first catch up: spread over SWITCH_HORIZON rounds, that once-off
    cost keeps a near-tie from starting to draft, and does not count once the draft keeps up."""
    table, counts = {"1,0,0": 0.010, "1,1,1": 0.011}, {"1,0,0": 9, "1,1,1": 9}
    assert decide([[0.2]], 1, table, 8, counts=counts)["budget"] == 1
    assert decide([[0.2]], 1, table, 8, counts=counts, behind=[True], switch_s=0.05)["budget"] == 0
    assert decide([[0.2]], 1, table, 8, counts=counts, behind=[False], switch_s=0.05)["budget"] == 1
    assert decide([[0.9]], 1, table, 8, counts=counts, behind=[True], switch_s=0.05)["budget"] >= 1
    two = decide([[0.2], [0.3]], 2, {"2,0,0": 0.010, "2,1,1": 0.011}, 8, counts={"2,0,0": 9, "2,1,1": 9},
                 behind=[True, False], switch_s=0.05)
    assert two["allocation"] == [0, 1]  # the request whose draft keeps up drafts; the other waits


def test_near_break_even_the_mode_in_use_persists():
    """One request's plain rounds are pipelined: stopping restarts the pipeline (a round that
    computes two forwards) and starting again throws the forward computed ahead away. Both are
    spread over SWITCH_HORIZON rounds, so near break-even a drafting request keeps drafting and a
    plain one stays plain, instead of paying both at every wobble of its estimate."""
    table, counts = {"1,0,0": 0.050, "1,1,1": 0.070}, {"1,0,0": 9, "1,1,1": 9}
    assert decide([[0.38]], 1, table, 8, counts=counts)["budget"] == 0  # 1.38 / 0.070 < 1 / 0.050
    assert decide([[0.38]], 1, table, 8, counts=counts, stop_s=0.08)["budget"] == 1
    s = Scheduler()
    s.cost.cells = {(1, 0, 0): [(0, 0.050)] * 9, (1, 1, 1): [(0, 0.070)] * 9}
    s.cost.set_apart.extend([((1, 0, 0), 0.130, "plain pipeline start"), ((1, 1, 1), 0.040, "look-ahead discarded")])
    for i in range(200):
        s.observe_cycle(f"old{i // 50}", 1, int(i % 8 < 3))  # 3 of 8 accepted
    assert s.plan(["r"], 1, pipelined=True) == [1]  # it drafted last round: it goes on
    s._held = None
    assert s.plan(["r"], 1, ahead=[True], pipelined=True) == [0]  # it ran plain: it stays so
    s._held = None
    assert s.plan(["r"], 1) == [0]  # batched plain rounds are not pipelined: no hysteresis


def test_no_request_drafts_past_its_remaining_tokens():
    """A cycle emits its accepted drafts and one more token, so a request with r tokens left can
    use at most r - 1 drafts: fixed k and the adaptive allocation are both capped there."""
    fixed = Scheduler(fixed=4)
    assert fixed.plan(["a", "b"], 2, room=[2, 0]) == [2, 0]
    assert fixed.plan(["a"], 1) == [4]
    s = Scheduler()
    table = {"2,0,0": 0.010, "2,2,1": 0.0105, "2,4,2": 0.011, "2,8,4": 0.012}
    s.cost.cells = {tuple(map(int, k.split(","))): [(1, v)] * 9 for k, v in table.items()}
    for _ in range(40):
        s.observe_cycle("a", 4, 4)
        s.observe_cycle("b", 4, 4)
    free = s.plan(["a", "b"], 2)
    assert min(free) >= 3
    assert s.plan(["a", "b"], 2, room=[1, 0]) == [1, 0]


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
    monkeypatch.setattr(scheduler, "FEW_OBSERVED", 0.0)
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
    assert cm.table()["1,0,0"] == pytest.approx(0.100)
    s = Scheduler(log_path=str(tmp_path / "log.jsonl"))
    s.cost.cells = {(1, 0, 0): [(1, 0.100)] * 2, (1, 3, 3): [(1, 0.150)] * 9}
    s.cost.rounds = FEW_PLAIN_GAP + 1
    for _ in range(40):
        s.observe_cycle("old", 3, 3)
    d = s._decide(["r"], 1, [False], [40])
    lead = _best(d["candidates"])["objective"] / d["candidates"][0]["objective"]
    assert lead > EXPLORE_MARGIN and d["explored"] and d["allocation"] == [0]
    s.cost.cells[(1, 0, 0)] = [(1, 0.100)] * MIN_SAMPLES  # enough plain rounds: the margin holds
    assert not s._decide(["r"], 1, [False], [40])["explored"]


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
    assert counts["1,8,8"] == 3 and table["1,8,8"] == pytest.approx(0.338)
    assert sorted(why for _, _, why in s.cost.set_apart) == ["draft catch-up"] * 3 + ["look-ahead taken"] * 3
    assert s.cost.catch_up_seconds(1) == pytest.approx(0.0058)
