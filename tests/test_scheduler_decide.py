"""The decision (worker/scheduler/decide.py) and how a table is read for it
(worker/scheduler/table.py): budgets, reach, probes, switching costs."""

from __future__ import annotations

import math

import pytest

from worker.round import Cell
from worker.scheduler import (DRAFT_LEAD, FREE_SIT_OUT, HOPELESS_EVERY, MIN_SAMPLES, PROBE_EVERY, CostModel, Probe, Scheduler,
                              decide, estimate, plausible_acceptance, probe_interval, survivals)
from worker.scheduler.decide import _best


def test_speculation_switches_off_when_it_does_not_pay():
    cheap = {Cell(1, 0, 0): 1.0, Cell(1, 1, 1): 1.05, Cell(1, 2, 2): 1.1, Cell(1, 3, 3): 1.15}
    assert decide([[0.9, 0.9, 0.9, 0.9]], 1, cheap, 8).budget >= 3
    costly = {Cell(1, 0, 0): 1.0, Cell(1, 1, 1): 1.9, Cell(1, 2, 2): 2.8}
    assert decide([[0.9, 0.9, 0.9]], 1, costly, 8).budget == 0
    assert decide([[0.05, 0.05]], 1, cheap, 8).budget == 0
    assert decide([[0.05]], 1, cheap, 8, probe=True).budget == 1
    first = decide([[0.5]], 1, {}, 8)  # nothing measured: start plain
    assert first.budget == 0 and [c.b for c in first.candidates] == [0]


def test_deeper_drafts_are_tried_past_a_costly_first_depth():
    """Batched verify pads every row to the deepest draft: the first depth costs most, later ones
    little. Measured only that far, the scheduler still tries deeper depths (optimistically
    priced), and a measured deeper depth that pays is then chosen on its own figure."""
    rates = [[0.9] * 4 for _ in range(4)]
    measured = {Cell(4, 0, 0): 0.28, Cell(4, 1, 1): 0.41, Cell(4, 4, 1): 0.45}
    d = decide(rates, 4, measured, 16)
    assert d.allocation == [4, 4, 4, 4] and max(c.d for c in d.candidates) == 4
    deeper = {**measured, Cell(4, 8, 2): 0.50, Cell(4, 12, 3): 0.55, Cell(4, 16, 4): 0.60}
    assert decide(rates, 4, deeper, 16).allocation == [4, 4, 4, 4]
    costly = {**measured, Cell(4, 8, 2): 1.2}
    assert decide(rates, 4, costly, 16).budget <= 4  # measured: a second depth does not pay


def test_a_depth_that_pays_past_depths_that_do_not_is_reached():
    """The H200's 0.8 B draft on the 9 B target (bench gpu): a plain round 5.8 ms, one of k = 1
    14.6 ms; at α = 0.95 k = 1 and 2 lose to plain rounds and k = 4 paid 1.33×. A reach of one
    depth past the deepest measured stopped at k = 2 and adaptive stayed plain (0.71 of k = 4):
    every depth is a candidate, priced by extrapolation until measured."""
    table = {Cell(1, 0, 0): 0.0058, Cell(1, 1, 1): 0.0146}
    d = decide([[0.95] * 8], 1, table, 16, draft_step=0.0021)
    assert d.budget >= 4 and [c.d for c in d.candidates] == list(range(9))
    by_depth = {c.d: c.objective for c in d.candidates}
    assert by_depth[1] < by_depth[0] < by_depth[d.budget]
    measured = {**table, Cell(1, 8, 8): 0.060}  # a deep round measured dear: plain again
    assert decide([[0.95] * 8], 1, measured, 16, draft_step=0.0021).budget == 0


def test_one_slow_first_round_does_not_price_a_cell_out():
    """A cell of fewer than MIN_SAMPLES rounds costs at most what its neighbours imply, so one
    slow first round does not keep k = 1 from being measured again; with enough rounds its own
    median stands."""
    table = {Cell(1, 0, 0): 0.010, Cell(1, 1, 1): 0.050}
    assert decide([[0.6]], 1, table, 8, counts={Cell(1, 0, 0): 9, Cell(1, 1, 1): 1}).budget == 1
    assert decide([[0.6]], 1, table, 8, counts={Cell(1, 0, 0): 9, Cell(1, 1, 1): MIN_SAMPLES}).budget == 0


def test_a_round_costs_no_more_than_a_measured_one_doing_more_work():
    """Noise can leave a shallower cell dearer than a deeper one; the deeper one bounds it (only
    once it has MIN_SAMPLES rounds)."""
    table = {Cell(4, 0, 0): 0.30, Cell(4, 4, 1): 0.46, Cell(4, 8, 2): 0.38}
    counts = {Cell(4, 0, 0): 9, Cell(4, 4, 1): 5, Cell(4, 8, 2): 5}
    d = decide([[0.6, 0.0]] * 4, 4, table, 16, counts=counts)
    assert d.allocation == [1, 1, 1, 1]
    assert next(c.cost for c in d.candidates if c.b == 4) == 0.38
    thin = {**counts, Cell(4, 8, 2): 1}
    assert next(c.cost for c in decide([[0.6, 0.0]] * 4, 4, table, 16, counts=thin).candidates if c.b == 4) == 0.46


def test_a_shrinking_batch_starts_from_what_the_larger_one_measured():
    table = {Cell(4, 0, 0): 0.28, Cell(4, 4, 1): 0.40, Cell(4, 16, 4): 0.60, Cell(3, 0, 0): 0.21}
    d = decide([[0.9] * 4 for _ in range(3)], 3, table, 16)
    assert d.allocation == [4, 4, 4]  # depth 4 at once, priced 0.60 × 0.21 / 0.28
    assert any(c.d == 4 and abs(c.cost - 0.45) < 1e-9 for c in d.candidates)
    # nothing of 3 measured: 4's rounds of the same drafts a request price it (its plain round stands in for 3's)
    d = decide([[0.9] * 4 for _ in range(3)], 3, {Cell(4, 0, 0): 0.28, Cell(4, 16, 4): 0.60}, 16)
    assert d.allocation == [4, 4, 4] and d.candidates[0].cost == 0.28
    assert any(c.d == 4 and c.cost == 0.60 for c in d.candidates)
    assert decide([[0.1] * 4 for _ in range(3)], 3, {Cell(4, 0, 0): 0.28, Cell(4, 16, 4): 0.60}, 16).budget == 0  # where it does not pay
    one = {Cell(4, 0, 0): 0.08, Cell(4, 12, 3): 0.15, Cell(4, 16, 4): 0.17}  # α = 0.9 ×4 on this CPU; a lone tail request
    assert estimate(one, 1, 4, 4) == 0.17 and estimate(one, 1, 3, 3) == 0.15 and estimate(one, 1, 0, 0) == 0.08
    assert decide([[0.9] * 8], 1, one, 16).allocation[0] >= 4  # (deeper ones extrapolated, as at any N)
    assert estimate({}, 1, 0, 0) is None  # nothing measured at all: start plain


def test_a_depth_past_a_dear_step_is_priced_at_the_cheapest_step_seen():
    """CPU costs are staircases (here 48 → 60 → 93 ms for depths 0, 1, 2; depth 4 measured later
    at 121): past the deepest measured depth the next one is priced at the cheapest step per depth
    measured so far, so at acceptance 0.9 deeper depths are tried; where every step is dear they
    are not."""
    table = {Cell(1, 0, 0): 0.048, Cell(1, 1, 1): 0.060, Cell(1, 2, 2): 0.093}
    d = decide([[0.9] * 8], 1, table, 8)
    assert any(c.d == 3 and abs(c.cost - 0.105) < 1e-9 for c in d.candidates)
    assert d.budget >= 3
    linear = {Cell(1, 0, 0): 0.048, Cell(1, 1, 1): 0.080, Cell(1, 2, 2): 0.112}
    assert decide([[0.9] * 8], 1, linear, 8).budget < 3


def test_a_depth_past_the_deepest_measured_costs_at_least_a_draft_step():
    """On this CPU a verify of 5 tokens costs what one of 3 does, so past k = 2 a depth costs
    little more than its draft step (the controlled draft's: a few ms). The cheapest step seen
    (13.7 ms, plain to k = 1) priced k = 4 at 100 ms where the fixed k = 4 engine's rounds cost
    ~86, and α = 0.9 on one request stayed at k = 1 (0.89 of k = 4). With the draft step measured
    per depth, a depth past the deepest measured is priced at no more than a draft step a depth
    more: deeper depths are tried; where acceptance does not pay for them, they are not."""
    table = {Cell(1, 0, 0): 0.0306, Cell(1, 1, 1): 0.0443, Cell(1, 2, 2): 0.0682, Cell(1, 3, 3): 0.0863}
    counts = {Cell(1, 0, 0): 32, Cell(1, 1, 1): 32, Cell(1, 2, 2): 32, Cell(1, 3, 3): 3}
    high, low = [[0.86] * 8], [[0.6] * 8]
    assert decide(high, 1, table, 16, counts=counts).budget == 1
    d = decide(high, 1, table, 16, counts=counts, draft_step=0.002)
    assert d.budget >= 4 and any(c.b == 4 and abs(c.cost - 0.0883) < 1e-9 for c in d.candidates)
    assert decide(low, 1, table, 16, counts=counts, draft_step=0.002).budget == 1
    cm = CostModel()
    cm.observe(Cell(1, 2, 2), 0.070, draft_s=0.016)
    cm.observe(Cell(1, 4, 4), 0.090, draft_s=0.036)
    cm.observe(Cell(1, 4, 4), 0.095, draft_s=0.040)
    cm.interrupt("cancel")  # an interrupted round's drafting is no sample either
    cm.observe(Cell(1, 0, 0), 0.030)
    cm.commit()
    assert cm.draft_step(1) == pytest.approx(0.0085) and cm.draft_step(4) is None


def test_probes_come_as_often_as_their_expected_loss_allows():
    """A probe drafts one token for every request; it comes every FREE_SIT_OUT plain rounds where
    its expected loss is small (acceptance near where drafting pays), rarely where a probe costs
    much more than what it is expected to yield (a useless draft, a catch-up, a launch-bound GPU draft)."""
    assert probe_interval({}, 1) == PROBE_EVERY
    cpu = {Cell(4, 0, 0): 0.123, Cell(4, 4, 1): 0.160}  # the embedded model, 4 requests (bench sched)
    assert probe_interval(cpu, 4, first=[0.3] * 4) == FREE_SIT_OUT  # yields 5.2 tokens at 1.3× plain
    assert probe_interval(cpu, 4, first=[0.0] * 4) == 16  # (0.160 - 0.123) / (2% of 0.123), rounded up
    assert probe_interval(cpu, 4, catch_up=0.14, first=[0.0] * 4) == 72  # its drafts first catch up: 0.160 + 0.14
    # a draft is behind already (a probe accepting 2 or more of its 4 drafts, chance 0.35, is followed by another)
    assert probe_interval(cpu, 4, catch_up=0.14, first=[0.3] * 4, behind=True) == 57
    one = {Cell(1, 0, 0): 0.054, Cell(1, 1, 1): 0.068}  # one request: plain rounds pipeline the next forward
    assert probe_interval(one, 1, first=[0.3]) == FREE_SIT_OUT
    assert probe_interval(one, 1, first=[0.3], discard=0.054) == 48  # a probe throws the forward ahead away: 0.068 + 0.054
    assert probe_interval(one, 1, first=[0.3], discard=0.054, restart=0.045) == 90  # ... and the plain round after restarts it
    slow = {Cell(1, 0, 0): 0.009, Cell(1, 1, 1): 0.020}  # a dear draft: a probe costs 2.2 plain rounds
    assert probe_interval(slow, 1, first=[0.0]) == 62  # (0.020 - 0.009) / (2% of 0.009), rounded up
    # a hit at 0.5 is followed by another probe, 1 more expected: (1 + 1) × (0.020 - 1.5 × 0.009) / (2% of 0.009)
    assert probe_interval(slow, 1, first=[0.5]) == 73
    gpu = {Cell(1, 0, 0): 0.009, Cell(1, 1, 1): 0.050}  # a launch-bound draft: 5.6 plain rounds, no acceptance pays
    assert probe_interval(gpu, 1, first=[0.5]) == probe_interval(gpu, 1, first=[1.0]) == HOPELESS_EVERY
    # the H200's rounds: k = 1 costs 3 plain rounds, and no depth within reach (2) pays; with the draft
    # step measured (1.5 ms), k = 8 costs at least k = 2's estimate + 6 × 1.5 ms for 9 tokens: worth probing
    h200 = {Cell(1, 0, 0): 0.0065, Cell(1, 1, 1): 0.0198}
    assert probe_interval(h200, 1, first=[0.95]) == HOPELESS_EVERY
    assert probe_interval(h200, 1, first=[0.95], draft_step=0.0015) < HOPELESS_EVERY
    # a tiny pair whose draft step (11 ms) costs more than a plain round (6.7 ms) stays hopeless
    tiny = {Cell(1, 0, 0): 0.0067, Cell(1, 1, 1): 0.0254}
    assert probe_interval(tiny, 1, first=[0.95], draft_step=0.011) == HOPELESS_EVERY
    d = decide([[0.05], [0.1], []], 3, {Cell(3, 0, 0): 1.0, Cell(3, 2, 1): 1.5}, 8, probe=True)
    assert d.allocation == [1, 1, 0] and d.budget == 2  # the third request has no room


def test_one_dear_first_drafting_round_does_not_stop_the_probes():
    """A server's first drafting round, two warm-up rows on the CPU, took 2.3 plain rounds (112 ms
    beside 48): read alone it priced one row's drafting past paying with every draft accepted, and
    the lone request whose drafting pays 1.3x there stayed plain for its whole first run (probes
    every HOPELESS_EVERY rounds). Hopelessness rests on drafting cells of MIN_SAMPLES rounds."""
    table = {Cell(1, 0, 0): 0.0488, Cell(2, 0, 0): 0.0480, Cell(2, 1, 1): 0.1123}
    rounds = {Cell(1, 0, 0): 13, Cell(2, 0, 0): 4, Cell(2, 1, 1): 1}
    assert probe_interval(table, 1, rounds, first=[0.3]) < HOPELESS_EVERY
    uncertain = plausible_acceptance(1, 5)  # few observations yet: probes may cost UNCERTAIN_SHARE
    assert probe_interval(table, 1, rounds, first=[0.3], plausible=uncertain) == PROBE_EVERY
    measured = {**rounds, Cell(2, 1, 1): MIN_SAMPLES}
    assert probe_interval(table, 1, measured, first=[0.3], plausible=uncertain) == HOPELESS_EVERY

def test_a_lone_request_probes_the_best_drafting_allocation():
    """The H200's 0.8 B draft: k = 1 costs 2.3 plain rounds and k = 8 3.1, so a k = 1 probe can
    never pay and never observes the deeper positions; in simulation three early misses at
    positions 2-3 kept α = 0.8 plain for whole runs (0.68-0.78 of k = 8). Where the round is one
    request, its probe is the whole round and drafts what the best drafting candidate would (here
    3 deep), priced as such; a log written before probes were few rows (no `probe_rows`) replays
    that rule for every request: at least one token each."""
    gpu = {Cell(1, 0, 0): 0.0060, Cell(1, 1, 1): 0.0140, Cell(1, 8, 8): 0.0185}
    acceptance = [0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    d = decide([acceptance], 1, gpu, 8, probe=True)
    assert _best(d.candidates).b == 0 and d.allocation == [3]  # 2.0 tokens for 15.3 ms (interpolated)
    assert decide([acceptance], 1, gpu, 8, probe=True, probe_rows=[0], probe_depth=3).allocation == [3]
    assert decide([[0.6] * 8], 1, gpu, 8).allocation == [0]  # no probe: plain
    cpu = {Cell(4, 0, 0): 0.123, Cell(4, 4, 1): 0.160, Cell(4, 8, 2): 0.230}
    assert decide([[0.2, 0.2]] * 4, 4, cpu, 8, probe=True).allocation == [1, 1, 1, 1]
    shallow = probe_interval(gpu, 1, first=[0.6])  # priced as a k = 1 probe: 14 ms for 1.6 tokens
    deep = Probe.of([survivals(acceptance)], [3])  # 15.3 ms for 2.05 tokens loses less, and is followed less often
    assert (shallow, probe_interval(gpu, 1, first=[0.6], probe=deep)) == (92, 36)
    s = Scheduler()
    s.cost.cells = {Cell(1, 0, 0): [(0, 0.009)] * 5, Cell(1, 1, 1): [(0, 0.015)] * 5}
    for _ in range(100):
        s.observe_cycle("r", 1, 0)
    a = s.acceptance["r"].rates(s.shared_rates())[0]
    budgets = [s.plan(["r"], 1)[0] for _ in range(300)]
    first = math.ceil((0.015 - 0.009 * (1 + a)) / (0.02 * 0.009))
    assert a < 0.05 and budgets.index(1) == first and sum(budgets) == 300 // (first + 1)
    s.cost.cells[Cell(1, 1, 1)] = [(0, 0.050)] * 5  # no acceptance would pay: no probe
    assert sum(s.plan(["r"], 1)[0] for _ in range(300)) == 0


def test_starting_to_draft_pays_the_drafts_catch_up():
    """A draft that sat out must first catch up: spread over SWITCH_HORIZON rounds, that once-off
    cost keeps a near-tie from starting to draft, and does not count once the draft keeps up."""
    table, counts = {Cell(1, 0, 0): 0.010, Cell(1, 1, 1): 0.011}, {Cell(1, 0, 0): 9, Cell(1, 1, 1): 9}
    assert decide([[0.2]], 1, table, 8, counts=counts).budget == 1
    assert decide([[0.2]], 1, table, 8, counts=counts, behind=[True], switch_s=0.05).budget == 0
    assert decide([[0.2]], 1, table, 8, counts=counts, behind=[False], switch_s=0.05).budget == 1
    assert decide([[0.9]], 1, table, 8, counts=counts, behind=[True], switch_s=0.05).budget >= 1
    two = decide([[0.2], [0.3]], 2, {Cell(2, 0, 0): 0.010, Cell(2, 1, 1): 0.011}, 8, counts={Cell(2, 0, 0): 9, Cell(2, 1, 1): 9},
                 behind=[True, False], switch_s=0.05)
    assert two.allocation == [0, 1]  # the request whose draft keeps up drafts; the other waits


def test_near_break_even_the_mode_in_use_persists():
    """One request's plain rounds are pipelined: stopping restarts the pipeline (a round that
    computes two forwards) and starting again throws the forward computed ahead away. Both are
    spread over SWITCH_HORIZON rounds, so near break-even a drafting request keeps drafting and a
    plain one stays plain, instead of paying both at every wobble of its estimate."""
    table, counts = {Cell(1, 0, 0): 0.050, Cell(1, 1, 1): 0.070}, {Cell(1, 0, 0): 9, Cell(1, 1, 1): 9}
    assert decide([[0.38]], 1, table, 8, counts=counts).budget == 0  # 1.38 / 0.070 < 1 / 0.050
    assert decide([[0.38]], 1, table, 8, counts=counts, stop_s=0.08).budget == 1
    s = Scheduler()
    s.cost.cells = {Cell(1, 0, 0): [(0, 0.050)] * 9, Cell(1, 1, 1): [(0, 0.070)] * 9}
    s.cost.set_apart.extend([(Cell(1, 0, 0), 0.130, "plain pipeline start"), (Cell(1, 1, 1), 0.040, "look-ahead discarded")])
    for i in range(200):
        s.observe_cycle(f"old{i // 50}", 1, int(i % 8 < 3))  # 3 of 8 accepted
    assert s.plan(["r"], 1, pipelined=True) == [1]  # it drafted last round: it goes on
    s._held = None
    assert s.plan(["r"], 1, ahead=[True], pipelined=True) == [0]  # it ran plain: it stays so
    s._held = None
    assert s.plan(["r"], 1) == [0]  # batched plain rounds are not pipelined: no hysteresis


def test_a_batch_whose_padding_is_unknown_drafts_one_depth_past_its_deepest():
    """Eight rows on the CPU with nothing but plain rounds measured at 8 and one drafting depth at
    4: the prior priced 8 rows drafting 2-3 deep at 0.15-0.17 s (a depth costs one draft step where
    no padding is known); 3 deep took 0.28-0.36 s, chosen four times in a run. Where a batch fills
    PAD_SPAN tokens and no padding is measured, a decision goes one depth past its N's deepest,
    whose round then shows what a depth adds."""
    table = {Cell(4, 0, 0): 0.0905, Cell(4, 4, 1): 0.1403, Cell(8, 0, 0): 0.1030, Cell(16, 0, 0): 0.1415}
    steps = {4: 0.0246, 8: 0.0237, 16: 0.0299}
    rates = [[0.52, 0.58, 0.58, 0.58]] * 8
    assert decide(rates, 8, table, 32, draft_step=steps, lead=DRAFT_LEAD).allocation == [2] * 8  # priced 0.15 s
    assert decide(rates, 8, table, 32, draft_step=steps, step_by_step=True, lead=DRAFT_LEAD).budget == 0  # 1 deep at most: no lead
    drafted = {**table, Cell(8, 8, 1): 0.17, Cell(8, 16, 2): 0.24}  # two depths of 8 rows: the padding is known
    assert decide(rates, 8, drafted, 32, draft_step=steps, step_by_step=True, lead=DRAFT_LEAD).budget == 0
    one = {Cell(1, 0, 0): 0.007, Cell(1, 1, 1): 0.012}  # one row fills no PAD_SPAN: extrapolated as before
    assert decide([[0.9] * 8], 1, one, 16, draft_step=0.0015, step_by_step=True).allocation == [8]


def test_drafting_must_lead_plain_rounds_by_a_margin():
    """Drafting chosen at a lead of 1.00-1.05 lost on the CPU (4 rows at k = 1: 1.7-1.9 plain
    rounds for 1.6-1.75 tokens a row): a lead under the spread of a few rounds' estimates is a
    loss once the estimates' errors are counted. A round drafts where it leads by DRAFT_LEAD."""
    table = {Cell(4, 0, 0): 0.080, Cell(4, 4, 1): 0.140}  # 4 rows at k = 1: 1.75 plain rounds
    for alpha, lead, budget in ((0.80, 1.029, 0), (0.85, 1.057, 4)):
        assert (4 + 4 * alpha) / 0.140 / (4 / 0.080) == pytest.approx(lead, abs=1e-3)
        assert decide([[alpha]] * 4, 4, table, 16, lead=DRAFT_LEAD).budget == budget
    assert decide([[0.80]] * 4, 4, table, 16).budget == 4  # as logs written before it decided
