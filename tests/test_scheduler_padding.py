"""A row's draft length weighs the padding it imposes on the others (worker/scheduler/table.py,
`padding`): every row of a batched round is computed at the round's widest width, so on a
compute-bound machine one row drafting 8 among 32 costs like every row at width 9, and on a
memory-bound one next to nothing."""

from __future__ import annotations

import json

import pytest

from worker.round import Cell
from worker.scheduler import HOPELESS_EVERY, decide, estimate, probe_interval, replay
from worker.scheduler.table import PAD_SPAN, padding

# bench/simulator.py's CPU_BATCH with 32 rows (ms): plain 132; one row drafting 1 (width 2 for every
# row) 4 + 256 + 11.5; one row drafting 2, 4 + 384 + 17
CPU_32 = {Cell(32, 0, 0): 0.132, Cell(32, 1, 1): 0.2715, Cell(32, 2, 2): 0.405}
CPU_STEP = 0.0055  # its draft step (the drafting round's fixed 6 ms aside)
# GPU_BATCH with 32 rows: plain 7.46; four rows drafting 1 or 2, memory-bound (the verify as plain)
GPU_32 = {Cell(32, 0, 0): 0.00746, Cell(32, 4, 1): 0.01100, Cell(32, 4, 2): 0.01254}
GPU_STEP = 0.00154


def test_a_narrow_deep_cell_costs_like_every_row_at_its_width_where_compute_bound():
    width = padding(CPU_32, 32, CPU_STEP)
    assert abs(width - 0.128) < 1e-9  # 32 tokens a depth at the verify's 4 ms a token
    narrow, wide = estimate(CPU_32, 32, 8, 8, draft_step=CPU_STEP), estimate(CPU_32, 32, 256, 8, draft_step=CPU_STEP)
    every_row_at_9 = 0.004 + 32 * 9 * 0.004 + 0.006 + 8 * 0.0055  # the simulator's round of 32 rows at width 9
    assert narrow == wide and 0.9 * every_row_at_9 < narrow < 1.1 * every_row_at_9
    # the prior before: a depth past the deepest measured at no more than a draft step: 0.36 of it
    old = estimate(CPU_32, 32, 8, 8, draft_step=CPU_STEP, pad=False)
    assert old < 0.4 * every_row_at_9


def test_a_deep_cell_stays_nearly_free_where_memory_bound():
    assert padding(GPU_32, 32, GPU_STEP) < 1e-12  # the verify of width 3 cost what width 2 did
    deep = estimate(GPU_32, 32, 8, 8, draft_step=GPU_STEP)
    assert abs(deep - estimate(GPU_32, 32, 8, 8, draft_step=GPU_STEP, pad=False)) < 1e-12
    assert abs(deep - (0.01254 + 6 * GPU_STEP)) < 1e-12


def test_a_stair_over_few_tokens_prices_no_padding():
    """One request's verify is a staircase (the CPU: 3 → 4 tokens 22 ms, 4 → 5 nearly free): a slope
    over fewer than PAD_SPAN tokens is a stair, and the deeper depths keep their optimistic price."""
    one = {Cell(1, 0, 0): 0.0306, Cell(1, 1, 1): 0.0443, Cell(1, 2, 2): 0.0682, Cell(1, 3, 3): 0.0863}
    assert padding(one, 1, 0.002) == 0.0 and PAD_SPAN > 3
    four = {Cell(4, 0, 0): 0.09, Cell(4, 4, 1): 0.11, Cell(4, 8, 2): 0.135, Cell(4, 12, 3): 0.16}
    assert padding(four, 4) == 4 * (0.16 - 0.11) / 8  # depths 1 and 3 span 8 tokens; consecutive ones 4


def test_a_smaller_batch_is_padded_as_the_larger_one_measured():
    """Slopes measured with more requests price a smaller N (a forward's cost rises no slower past
    more tokens); with fewer, they would not price a larger one (below, a forward is memory-bound)."""
    table = {**CPU_32, Cell(8, 0, 0): 0.036}
    assert abs(padding(table, 8, CPU_STEP) - 8 * 0.004) < 1e-9
    small = {Cell(2, 0, 0): 0.032, Cell(2, 2, 1): 0.043, Cell(2, 10, 5): 0.060, Cell(32, 0, 0): 0.132}
    assert padding(small, 32) == 0.0


def test_drafting_that_padding_prices_out_is_probed_rarely():
    """Eight rows on the compute-bound CPU: once two depths show the verify's 4 ms a token, no
    depth pays even with every draft accepted, and probes come every HOPELESS_EVERY rounds;
    priced without the padding, depth 3 looked like it could."""
    table = {Cell(8, 0, 0): 0.036, Cell(8, 8, 1): 0.083, Cell(8, 16, 2): 0.124}
    counts = dict.fromkeys(table, 8)
    assert probe_interval(table, 8, counts, first=[0.9] * 8, draft_step=0.012) == HOPELESS_EVERY
    assert decide([[0.9] * 8] * 8, 8, table, 64, counts=counts, draft_step=0.012).budget == 0


def test_each_ns_own_draft_step_is_taken_out_of_its_depths():
    """The CPU's draft step grows with the rows (21 ms a depth at 4 rows, 25 at 8, 36 at 16, the
    embedded pair): 16 rows' step taken out of 8 rows' depths hid 8 rows' verify (2.3 ms a token
    where it costs 3.7), and 16 rows drafting 4 deep were priced at 0.29 s and chosen; they took
    0.52-0.55 s a round. With each N's own step they are priced at 0.38 s and left out."""
    table = {Cell(4, 0, 0): 0.0835, Cell(4, 4, 1): 0.1333, Cell(4, 8, 2): 0.1673, Cell(4, 12, 3): 0.1998,
             Cell(8, 0, 0): 0.1087, Cell(8, 8, 1): 0.1788, Cell(8, 16, 2): 0.2330, Cell(16, 0, 0): 0.1427}
    steps = {4: 0.0207, 8: 0.0248, 16: 0.036}
    assert padding(table, 16, steps) == pytest.approx(16 * ((0.2330 - 2 * 0.0248) - (0.1788 - 0.0248)) / 8)
    assert padding(table, 16, 0.036) == pytest.approx(16 * ((0.2330 - 2 * 0.036) - (0.1788 - 0.036)) / 8)
    assert estimate(table, 16, 64, 4, draft_step=0.036) == pytest.approx(0.288, abs=1e-3)
    assert estimate(table, 16, 64, 4, draft_step=steps) == pytest.approx(0.378, abs=1e-3)
    rates = [[0.65, 0.45, 0.45, 0.45, 0.45]] * 16
    assert decide(rates, 16, table, 64, draft_step=0.036).allocation == [4] * 16
    assert max(decide(rates, 16, table, 64, draft_step=steps).allocation) < 4


def test_a_log_written_before_the_padding_replays_with_the_prior_it_had():
    acceptance = [[0.95] * 8]
    old = decide(acceptance, 32, CPU_32, 8, draft_step=CPU_STEP, pad=False)
    new = decide(acceptance, 32, CPU_32, 8, draft_step=CPU_STEP)
    assert old.candidates != new.candidates
    rec = {"round": 1, "requests": ["a"], "n_requests": 32, "b_max": 8, "probe": False, "acceptance": acceptance,
           "cost_table": {c.key(): v for c, v in CPU_32.items()}, "cost_counts": None, "behind": [False],
           "switch_s": 0.0, "stop_s": 0.0, "explore_plain": False, "explore_margin": 1.25, "draft_step_s": CPU_STEP}
    assert replay([json.dumps({**rec, **old.to_log()})]) == []  # no "padding": the prior before
    assert replay([json.dumps({**rec, "padding": True, **new.to_log()})]) == []
    assert replay([json.dumps({**rec, **new.to_log()})]) != []


# gpu-batch N = 8, 4 rows joint, on an H100 (d147a28): depth 2 measured under depth 1, 3.7 ms a draft step
MIXED_8 = {Cell(8, 0, 0): 0.0081, Cell(8, 1, 1): 0.0222, Cell(8, 2, 2): 0.0211}
MIXED_STEP = {8: 0.00373}


def test_a_depth_measured_under_the_one_before_prices_no_depth_at_nothing():
    """Depth 2 measured under depth 1 (within their noise) priced every depth past it at nothing:
    depth 8 at depth 2's 21.1 ms, drafted at 34-51 ms a round. With `rising` only the drafting
    depths' rising steps count, none here: the prior's quarter of a plain round a depth, and plain
    rounds win. Where depths rise, the price is as before."""
    counts = dict.fromkeys(MIXED_8, 2) | {Cell(8, 0, 0): 19}
    free = estimate(MIXED_8, 8, 32, 8, counts, MIXED_STEP)
    rising = estimate(MIXED_8, 8, 32, 8, counts, MIXED_STEP, rising=True)
    assert free == pytest.approx(0.0211) and rising == pytest.approx(0.0211 + 6 * 0.25 * 0.0081)
    acceptance = [[0.77, 0.96, 0.92, 0.92, 0.92, 0.92, 0.92, 0.92]] * 4
    assert decide(acceptance, 8, MIXED_8, 32, counts=counts, draft_step=MIXED_STEP, lead=1.05).allocation == [8] * 4
    assert decide(acceptance, 8, MIXED_8, 32, counts=counts, draft_step=MIXED_STEP, lead=1.05, rising=True).budget == 0
    steady = {Cell(1, 0, 0): 0.0077, Cell(1, 1, 1): 0.0178, Cell(1, 2, 2): 0.0185, Cell(1, 4, 4): 0.0200}
    assert estimate(steady, 1, 6, 6, draft_step={1: 0.0052}, rising=True) == estimate(steady, 1, 6, 6, draft_step={1: 0.0052})
