"""Probes while drafting is off: what one drafts (a few rows, a little, inside an ordinary round)
and how often they come; docs/scheduler.md, "Exploration"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from worker.round import FREE_SIT_OUT, Cell
from worker.scheduler.allocation import POSITIONS
from worker.scheduler.cost import MIN_SAMPLES
from worker.scheduler.table import Steps, _reach, estimate, padding, step_at

PROBE_ROWS = 8  # a probe drafts for one joint request in this many (at least one) ...
PROBE_DEPTH = 2  # ... from 1 to this deep, in turn (two depths measured show the padding: table.padding)
PROBE_SHARE = 0.02  # probes (and plain explorations) come as often as keeps their expected loss under this share
PROBE_EVERY = 16  # with speculation off and nothing measured, probe this often
FEW_OBSERVED = 16.0  # position-1 observations over the long run under which ...
UNCERTAIN_SHARE = 0.10  # ... probes may cost this share of plain time (PROBE_SHARE's 5×), where a plausible
                        # acceptance (the observations' upper bound) would let drafting lead plain rounds by ...
UNCERTAIN_LEAD = 1.25  # ... this (EXPLORE_MARGIN's lead); elsewhere PROBE_SHARE (a near-perfect draft's small lead)
PLAUSIBLE_Z = 4.0  # that bound: the Wilson interval's upper end, this many deviations out, of every position's counts
MAX_FOLLOW_HIT = 0.9  # the chance of a probe's hit that prices its follow-ups at most (9 rounds)
HOPELESS_EVERY = 16384  # plain rounds between probes where no depth would pay with every draft accepted


@dataclass(frozen=True)
class Probe:
    """What a probe drafts: for each joint request, the survivals of the positions it drafts
    (none where it drafts nothing for it)."""

    rows: tuple[tuple[float, ...], ...]

    @classmethod
    def of(cls, survival: Sequence[Sequence[float]], lengths: Sequence[int]) -> "Probe":
        return cls(tuple(tuple(s[:k]) for s, k in zip(survival, lengths)))

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]

    @property
    def gain(self) -> float:
        """Accepted drafts expected."""
        return sum(map(sum, self.rows))

    def beaten(self) -> float:
        """The chance that it accepts more drafts than expected (`gain`): what a follow-up takes."""
        dist = {0: 1.0}
        for s in (r for r in self.rows if r):
            p = [1.0 - s[0]] + [s[j] - (s[j + 1] if j + 1 < len(s) else 0.0) for j in range(len(s))]
            out: dict[int, float] = {}
            for total, q in dist.items():
                for j, pj in enumerate(p):
                    out[total + j] = out.get(total + j, 0.0) + q * pj
            dist = out
        return sum(q for total, q in dist.items() if total > self.gain + 1e-9)


def probe_count(joint: int) -> int:
    """Requests a probe drafts for, of `joint` with room: one in PROBE_ROWS, at least one."""
    return max(1, math.ceil(joint / PROBE_ROWS)) if joint else 0


def probe_lengths(survival: Sequence[Sequence[float]], rows: Sequence[int], depth: int = PROBE_DEPTH) -> list[int]:
    """A probe's draft length per request: `depth` for each of `rows`, no deeper than its room."""
    chosen = set(rows)
    return [min(depth, len(s)) if r in chosen else 0 for r, s in enumerate(survival)]


def probe_interval(table: dict[Cell, float], n_requests: int, counts: dict[Cell, int] | None = None,
                   catch_up: float | None = None, first: Sequence[float] = (), discard: float | None = None,
                   behind: bool = False, restart: float = 0.0, probe: Probe | None = None,
                   draft_step: Steps = None, plausible: float | None = None) -> int:
    """Plain rounds between probes. `first`: the joint requests' position-1 estimates; `probe`:
    what a probe drafts (None: one token for each of them). Its expected loss is its cell's cost
    less the plain time of the tokens it expects (N + its gain), plus `discard` (the forward
    computed ahead that a batched probe throws away), `restart` (what the plain rounds after it
    pay to start the pipeline again: the scheduler's stop seconds) and the probes expected to follow a
    hit; `catch_up`, what its drafts first feed, adds to it unless it comes within FREE_SIT_OUT
    rounds. Probes come as often as keeps that under PROBE_SHARE of the plain time between them:
    every FREE_SIT_OUT rounds where a probe costs next to nothing (and no draft is `behind`
    already), every HOPELESS_EVERY where no depth could pay (`_could_pay`). `plausible`: while
    the draft is uncertain (Scheduler: position 1 observed fewer than FEW_OBSERVED times), the
    most a position's acceptance plausibly is (`plausible_acceptance`); where drafting at it
    would lead plain rounds by UNCERTAIN_LEAD at some depth, probes may cost UNCERTAIN_SHARE of
    plain time, not PROBE_SHARE (every PROBE_EVERY rounds at the most)."""
    if probe is None:
        probe = Probe.of([[a] for a in first], [1] * len(first))
    plain = estimate(table, n_requests, 0, 0, counts)
    cost = estimate(table, n_requests, max(1, sum(probe.lengths)), max([1, *probe.lengths]), counts, draft_step)
    if not plain or cost is None or not first:
        return PROBE_EVERY
    trusted = _trusted(table, counts)
    if not _could_pay(trusted, n_requests, len(first), counts, plain, draft_step):
        return HOPELESS_EVERY
    expected = plain * (n_requests + probe.gain) / n_requests  # plain time for what a probe yields
    loss = cost - expected + (discard or 0.0) + restart + _follow_ups(probe) * max(0.0, cost - expected)
    if not behind and loss <= PROBE_SHARE * plain * (FREE_SIT_OUT + 1):
        every = FREE_SIT_OUT
    else:
        every = max(FREE_SIT_OUT + 1, math.ceil((loss + (catch_up or 0.0)) / (PROBE_SHARE * plain)))
    if plausible is not None and _could_pay(trusted, n_requests, len(first), counts, plain, draft_step, plausible,
                                            UNCERTAIN_LEAD):
        every = max(PROBE_EVERY, math.ceil(every * PROBE_SHARE / UNCERTAIN_SHARE))
    return every


def plausible_acceptance(accepted: float, tried: float, z: float = PLAUSIBLE_Z) -> float:
    """The most a position's acceptance plausibly is, `accepted` of `tried` drafts seen
    (every position's together): the upper end of their Wilson score interval, `z` deviations
    out; 1 where none was tried."""
    if tried <= 0:
        return 1.0
    p, q = accepted / tried, z * z / tried
    return min(1.0, (p + q / 2 + z * math.sqrt(p * (1 - p) / tried + q / (4 * tried))) / (1 + q))


def _follow_ups(probe: Probe) -> float:
    """Probe rounds expected to follow a probe (one follows each that accepted more drafts than
    expected, `Probe.beaten`, at most MAX_FOLLOW_HIT)."""
    hit = min(probe.beaten(), MAX_FOLLOW_HIT)
    return hit / (1.0 - hit)


def _trusted(table: dict[Cell, float], counts: dict[Cell, int] | None) -> dict[Cell, float]:
    """The cells a verdict of hopelessness rests on: plain ones, and drafting ones of MIN_SAMPLES
    rounds or more (every cell where `counts` is not given): one dear first round of any N must
    not stop probes for HOPELESS_EVERY rounds."""
    if counts is None:
        return table
    return {k: v for k, v in table.items() if not k.b or counts.get(k, 0) >= MIN_SAMPLES}


def _could_pay(table: dict[Cell, float], n: int, joint: int, counts: dict[Cell, int] | None, plain: float,
               draft_step: Steps = None, rate: float = 1.0, lead: float = 1.0) -> bool:
    """Whether drafting d tokens for each of `joint` requests, each position accepted at `rate`
    (1: all accepted), beats plain rounds (by `lead` times their tokens per second)
    at some depth d within reach (one past the deepest measured: the extrapolation past it is
    optimistic enough to make any draft look worth a probe) or, with the measured `draft_step`,
    at any depth up to POSITIONS priced at the least it can cost: the reach's round and a draft
    step and the padding it adds (`padding`) more a depth."""
    reach = _reach(table, n)
    own = step_at(draft_step, n)
    step = None if own is None else own + padding(table, n, draft_step)
    for d in range(1, POSITIONS + 1):
        if d <= reach:
            cost = estimate(table, n, joint * d, d, counts)
        elif step is not None and reach >= 2:
            cost = estimate(table, n, joint * reach, reach, counts) + (d - reach) * step
        else:
            break
        if cost is not None and (n + joint * sum(rate ** j for j in range(1, d + 1))) / cost > lead * n / plain:
            return True
    return False
