"""Reading a cost table: a cell's cost from its own rounds, its neighbours' or another N's
(interpolated, bounded by cells that do more work); docs/scheduler.md, "The cost table"."""

from __future__ import annotations

from typing import Mapping, Union

from worker.round import Cell
from worker.scheduler.cost import MIN_SAMPLES, CostModel, _dominates

Steps = Union[float, Mapping[int, float], None]  # drafting seconds a depth: by N, or one figure (logs before)

PAD_SPAN = 8  # tokens a verify's slope must span to price padding: over fewer, a BLAS stair (the CPU's one request:
              # 3 → 4 tokens 22 ms, 4 → 5 nearly free)


def step_at(draft_step: Steps, n: int) -> float | None:
    """The drafting seconds a depth of rounds with n requests: one figure given for every N (logs
    written before the steps by N), else n's (None: none measured)."""
    return draft_step.get(n) if isinstance(draft_step, Mapping) else draft_step


def _cells(table: dict[Cell, float], n: int) -> list[tuple[int, int, float]]:
    """The (B, D, cost) of every cell of N requests."""
    return [(key.b, key.d, v) for key, v in table.items() if key.n == n]


def _along(points: dict[int, float], x: int) -> float:
    """Linear between the nearest measured neighbours; the nearest one outside their range."""
    below = [p for p in points if p <= x]
    above = [p for p in points if p >= x]
    if below and above:
        lo, hi = max(below), min(above)
        return points[lo] if lo == hi else points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[min(above)] if above else points[max(below)]


def _from_other_n(table: dict[Cell, float], n: int, d: int) -> float | None:
    """Depth d as measured (or interpolated between measured depths) with the nearest other number
    of requests, scaled by the ratio of the two plain rounds: the tail of a batch (N falling as
    requests end) need not explore anew."""
    plain = table.get(Cell(n, 0, 0))
    if plain is None:
        return None
    others = sorted({k.n for k in table} - {n}, key=lambda x: (abs(x - n), x))
    for other in others:
        base = table.get(Cell(other, 0, 0))
        by_depth: dict[int, float] = {}
        for _, kd, v in _cells(table, other):
            by_depth[kd] = min(v, by_depth.get(kd, v))
        if base and max(by_depth) >= d:
            return _along(by_depth, d) * plain / base
    return None


def _stand_in(table: dict[Cell, float], n: int) -> int | None:
    """For N requests of which nothing is measured (a batch's tail), the nearest other N whose
    plain round is: its rounds of the same drafts a request price this N's (see `_interpolate`)."""
    if _cells(table, n):
        return None
    plain = [k.n for k in table if (k.b, k.d) == (0, 0)]
    return min(plain, key=lambda x: (abs(x - n), x), default=None)


def _reach(table: dict[Cell, float], n: int) -> int:
    """The deepest depth a decision may choose: one past the deepest measured with these N
    requests, or the deepest measured with another N when both plain rounds are known."""
    if (other := _stand_in(table, n)) is not None:
        return _reach(table, other)
    own = max((kd for _, kd, _ in _cells(table, n)), default=-1) + 1
    if Cell(n, 0, 0) not in table:
        return own
    shared = [k.d for k in table if Cell(k.n, 0, 0) in table]
    return max([own] + shared)


def padding(table: dict[Cell, float], n: int, draft_step: Steps = None) -> float:
    """What a depth more adds to the verify of n requests, every row computed at the round's widest
    width: n tokens at the cheapest a verify token has cost between two drafting depths of any N
    (their drafting, that N's `draft_step` a depth, else n's, taken out; a drafting round's fixed
    cost cancels), over PAD_SPAN tokens or more (fewer: a stair) from n tokens a forward up (a
    forward's cost rises no slower past them); 0 where nothing shows it. Compute-bound, a row drafting 8 among 32 costs
    like every row at width 9; memory-bound, next to nothing."""
    slopes = _token_slopes(table, n, draft_step)
    return n * max(0.0, min(slopes)) if slopes else 0.0


def _token_slopes(table: dict[Cell, float], n: int, draft_step: Steps) -> list[float]:
    """What a verify token cost between two drafting depths of each N, over PAD_SPAN tokens or
    more from n tokens a forward up (see `padding`)."""
    verify: dict[tuple[int, int], float] = {}  # (N, D): the cheapest round's verify
    for k, v in table.items():
        if k.d:
            step = step_at(draft_step, k.n) or step_at(draft_step, n) or 0.0
            verify[k.n, k.d] = min(v - k.d * step, verify.get((k.n, k.d), v))
    return [(verify[m, hi] - verify[m, lo]) / (m * (hi - lo)) for m, lo in verify for m2, hi in verify
            if m2 == m and hi > lo and m * (1 + lo) >= n and m * (hi - lo) >= PAD_SPAN]


def depth_limit(table: dict[Cell, float], n: int, draft_step: Steps = None) -> int | None:
    """The deepest draft a decision for n requests may choose while nothing shows what a depth
    more adds to their verify (no `padding` measured) and they fill a forward of PAD_SPAN tokens:
    one past the deepest measured with n requests (or the N standing in for them); None: any."""
    if n < PAD_SPAN or _token_slopes(table, n, draft_step):
        return None
    m = _stand_in(table, n) or n
    return max((kd for _, kd, _ in _cells(table, m)), default=0) + 1


def estimate(table: dict[Cell, float], n: int, b: int, d: int, counts: dict[Cell, int] | None = None,
             draft_step: Steps = None, pad: bool = True, rising: bool = False) -> float | None:
    """Cost of a round from a table (`CostModel.table()`, or a logged one); None when nothing of this N is known.

    A round never costs more than a measured one that does more work (at least as many tokens
    and as deep, with `counts`: one of MIN_SAMPLES rounds or more), and a cell of fewer than
    MIN_SAMPLES rounds costs at most what its neighbours imply: one slow first round (a
    neighbour's load, a first allocation) must not price a cell out of ever being measured again.
    `draft_step`: the measured drafting seconds a depth, by N (see `_interpolate`); `pad`: a depth past
    the deepest measured costs at least its `padding` (False: as logs written before it were); `rising`:
    see `_interpolate` (False: as logs written before it were).
    """
    cost = _interpolate(table, n, b, d, draft_step, pad, rising)
    key = Cell(n, b, d)
    if cost is not None and counts is not None and key in table and counts.get(key, 0) < MIN_SAMPLES:
        others = _interpolate({k: v for k, v in table.items() if k != key}, n, b, d, draft_step, pad, rising)
        cost = cost if others is None else min(cost, others)
    bounds = [v for k, v in table.items() if _dominates(k, n, b, d) and (counts is None or counts.get(k, 0) >= MIN_SAMPLES)]
    return min([cost] + bounds) if cost is not None else None


def _interpolate(table: dict[Cell, float], n: int, b: int, d: int, draft_step: Steps = None,
                 pad: bool = True, rising: bool = False) -> float | None:
    """A cell's own figure; else along B among cells of its (N, D), else along D from the cheapest
    cell of each measured depth; past the deepest measured depth from the nearest other N that
    measured it (scaled by the plain rounds' ratio), else at the cheapest step per depth measured
    so far (one drafting depth measured: PRIOR_SLOPE × the plain round), and no more than
    `draft_step` a depth more. Optimistic, so that a deeper draft that might pay gets tried; but
    with `pad`, past the deepest measured depth a depth costs at least its `padding`. With
    `rising`, the steps are those between drafting depths that rose (one depth measured under the
    one before, within their noise, priced every depth past it at nothing), else the prior."""
    exact = table.get(Cell(n, b, d))
    if exact is not None:
        return exact
    cells = _cells(table, n)
    if not cells:
        other = _stand_in(table, n)  # its plain round stands in for this N's until one is measured:
        # the ratios between candidates, which decide, carry over (an N's rounds cost about in proportion)
        return None if other is None else _interpolate(table, other, b * other // n, d, draft_step, pad, rising)
    same_d = {kb: v for kb, kd, v in cells if kd == d}
    if same_d:
        return _along(same_d, b)
    by_depth: dict[int, float] = {}
    for _, kd, v in cells:
        by_depth[kd] = min(v, by_depth.get(kd, v))
    deepest = max(by_depth)
    if d < deepest:
        return _along(by_depth, d)
    width = padding(table, n, draft_step) if pad else 0.0
    if d > deepest and (scaled := _from_other_n(table, n, d)) is not None:
        return max(scaled, by_depth[deepest] + width * (d - deepest))
    depths = sorted(by_depth)
    steps = [(by_depth[b] - by_depth[a]) / (b - a) for a, b in zip(depths, depths[1:])]
    if rising:  # a depth no dearer than the one before is noise: drafting steps only, and only those that cost
        steps = [x for x, a in zip(steps, depths) if a >= 1 and x > 0]
    if sum(x >= 1 for x in depths) >= 2 and steps:  # the cheapest step per depth measured so far
        slope = max(0.0, min(steps))
    else:
        slope = CostModel.PRIOR_SLOPE * by_depth.get(0, by_depth[min(by_depth)])
    if (step := step_at(draft_step, n)) is not None:  # a depth more costs at most its draft step ...
        slope = min(slope, step)
    return by_depth[deepest] + max(slope, width) * (d - deepest)  # ... or the padding it adds, if more
