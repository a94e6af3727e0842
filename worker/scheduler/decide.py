"""The decision: the budget B that maximises tokens per second over the measured costs, with
probes while drafting is off and plain explorations while it is on; docs/scheduler.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from worker.round import FREE_SIT_OUT, PIPELINE_WARM_ROUNDS, Cell
from worker.scheduler.allocation import allocate, rank, survivals
from worker.scheduler.cost import (EXPLORE_MARGIN, HOPELESS_EVERY, MAX_FOLLOW_HIT, PLAIN_GAP, PROBE_EVERY,
                                   PROBE_SHARE, SWITCH_HORIZON)
from worker.scheduler.table import _reach, estimate

POSITIONS = 8  # deepest draft of one request


@dataclass(frozen=True)
class Candidate:
    """A budget B the decision weighed: its deepest draft D, estimated cost, expected tokens."""

    b: int
    d: int
    cost: float
    gain: float
    objective: float

    def to_log(self) -> dict:
        return {"B": self.b, "D": self.d, "cost": self.cost, "gain": self.gain, "objective": self.objective}


@dataclass(frozen=True)
class Decision:
    survival: list[list[float]]
    candidates: list[Candidate]
    budget: int
    allocation: list[int]
    explored: bool

    def to_log(self) -> dict:
        """As the decision log writes it (and `replay` compares it)."""
        return {"survival": self.survival, "candidates": [c.to_log() for c in self.candidates],
                "budget": self.budget, "allocation": self.allocation, "explored": self.explored}


def decide(acceptance: Sequence[Sequence[float]], n_requests: int, table: dict[Cell, float], b_max: int,
           probe: bool = False, counts: dict[Cell, int] | None = None,
           behind: Sequence[bool] | None = None, switch_s: float = 0.0, stop_s: float = 0.0,
           explore_plain: bool = False, draft_step: float | None = None,
           explore_margin: float | None = EXPLORE_MARGIN) -> Decision:
    """B* = argmax over B in 0..b_max of (N + sum of the B largest survivals) / cost(N, B, D(B)).

    `acceptance` has one row per joint request (baseline requests count in N only). Candidates
    whose cost cannot be estimated are skipped; B = 0 is always a candidate. A depth however far
    past the deepest measured is a candidate (`estimate` extrapolates, optimistically, until its
    own rounds price it): where the next depth does not pay and a deeper one does, a reach of one
    depth past the deepest measured never got there (a 0.8 B draft on a GPU at acceptance 0.95: k = 1
    and 2 lose to plain rounds, k = 4 pays 1.33×; adaptive stayed plain, 0.71 of k = 4). An allocation that drafts for a request whose draft is
    `behind` (it must first catch up on the prompt or on the cycles it sat out) pays that once:
    `switch_s` spread over SWITCH_HORIZON rounds is added to its cost, so noise in a near-tie
    does not start drafting that costs more to start than it gains (`behind` also marks a request
    whose pipelined plain rounds computed a forward ahead, which drafting throws away). Likewise
    `stop_s`, what stopping costs (one request's plain rounds restart their pipeline), spread
    over SWITCH_HORIZON rounds, is added to B = 0: the mode changes only for a clear gain, since
    every change pays both once. With `probe`, a round that
    would draft nothing drafts one token for each request, so acceptance keeps being observed;
    with `explore_plain`, a round that would draft drafts nothing where drafting leads by less than
    `explore_margin` (None: by any lead), so plain rounds keep being measured (see `plain_probe_interval`).
    Returns the inputs' derived values and the choice, as logged and replayed.
    """
    surv = [survivals(a) for a in acceptance]
    ranked = rank(surv)
    candidates = []
    gain = float(n_requests)
    for b in range(0, min(b_max, len(ranked)) + 1):
        if b:
            r, j = ranked[b - 1]
            gain += surv[r][j - 1]
        lengths = allocate(surv, b)
        d = max(lengths, default=0)
        cost = estimate(table, n_requests, b, d, counts, draft_step)
        if cost is None and b == 0:
            cost = 1.0  # nothing measured yet: start plain, which measures B = 0
        if cost is not None:
            switching = switch_s / SWITCH_HORIZON if behind and any(k and x for k, x in zip(lengths, behind)) else 0.0
            switching += stop_s / SWITCH_HORIZON if b == 0 else 0.0
            candidates.append(Candidate(b, d, cost, gain, gain / (cost + switching)))
    best = _best(candidates)
    budget = best.b
    lengths = allocate(surv, budget)
    plain = candidates[0]  # B = 0 is always the first candidate
    explored = bool(explore_plain and budget and (explore_margin is None or best.objective < explore_margin * plain.objective))
    if explored:
        lengths, budget = [0] * len(surv), 0
    elif probe and budget == 0 and ranked:
        drafting = _best_drafting(candidates)
        widest = allocate(surv, drafting.b) if drafting else [0] * len(surv)
        lengths = [max(k, int(bool(row))) for k, row in zip(widest, surv)]  # at least one token for each request with room
        budget = sum(lengths)
    return Decision(surv, candidates, budget, lengths, explored)


def _best(candidates: list[Candidate]) -> Candidate:
    return max(candidates, key=lambda c: (c.objective, -c.b))  # equal objectives: the smaller budget


def _best_drafting(candidates: list[Candidate]) -> Candidate | None:
    """The best candidate that drafts (what a probe drafts: where k = 1 costs nearly what k = 8
    does, as the 0.8 B draft's rounds do on a GPU, a k = 1 probe can never pay, loses more than
    a deep one, and never observes the deeper positions that decide whether drafting pays)."""
    return _best([c for c in candidates if c.b]) if len(candidates) > 1 else None


def probe_interval(table: dict[Cell, float], n_requests: int, counts: dict[Cell, int] | None = None,
                   catch_up: float | None = None, first: Sequence[float] = (), discard: float | None = None,
                   behind: bool = False, restart: float = 0.0, drafting: Candidate | None = None,
                   draft_step: float | None = None) -> int:
    """Plain rounds between probes. A probe drafts at least one token for each joint request
    (`first`: their position-1 estimates), so a change of text shows in one round, not one
    request's in turn, and the drafting round's cost is measured again; it drafts the best drafting
    candidate's allocation where that is wider (`drafting`: that candidate of the last decision,
    its cost and gain). Its expected loss is its cost less the plain time of the tokens it expects
    (N + the sum of `first`, or the candidate's gain); probes come as often as keeps
    that under PROBE_SHARE of the plain time between them. Near where drafting pays a probe costs
    next to nothing and comes every FREE_SIT_OUT rounds, before any draft would have to catch up
    (unless one is `behind` already: a new request's draft lacks its prompt); else the probe's
    draft first catches up on the rounds it sat out, and `catch_up`, the median such catch-up,
    adds to its cost: a useless draft, or a launch-bound one on a GPU, is probed rarely.
    Unbatched plain rounds compute the next forward ahead; a batched probe throws it away:
    `discard`, the median such forward, adds to its cost too (an unbatched one takes its token),
    and so does `restart`, what the plain rounds after it pay to start the pipeline again
    (Scheduler._stop_seconds; left out, a useless draft was probed once a request and adaptive
    ran at 0.91 of baseline). Where no depth within reach would beat plain rounds even
    with every draft accepted, acceptance cannot change the decision, and probes come every
    HOPELESS_EVERY rounds (a tiny pair whose draft costs as much as its target lost 4% to probes
    and their catch-ups on requests of 1,536 tokens; a launch-bound draft on a GPU)."""
    plain, probe = estimate(table, n_requests, 0, 0, counts), estimate(table, n_requests, max(1, len(first)), 1, counts)
    if not plain or probe is None or not first:
        return PROBE_EVERY
    if not _could_pay(table, n_requests, len(first), counts, plain, draft_step):
        return HOPELESS_EVERY
    expected = plain * (n_requests + sum(first)) / n_requests  # plain time for what a probe yields
    if drafting is not None and drafting.b > len(first):
        probe, expected = drafting.cost, plain * drafting.gain / n_requests
    loss = probe - expected + (discard or 0.0) + restart + _follow_ups(first) * max(0.0, probe - expected)
    if not behind and loss <= PROBE_SHARE * plain * (FREE_SIT_OUT + 1):
        return FREE_SIT_OUT
    return max(FREE_SIT_OUT + 1, math.ceil((loss + (catch_up or 0.0)) / (PROBE_SHARE * plain)))


def _follow_ups(first: Sequence[float]) -> float:
    """Probe rounds expected to follow a probe (one follows each that any draft hit, chance
    1 - Π(1 - a1)): at acceptance 0.6 on a GPU a probe was three rounds, not one, and, priced as one,
    probes cost plain decoding 4-5%."""
    miss = math.prod(1.0 - min(a, 1.0) for a in first)
    hit = min(1.0 - miss, MAX_FOLLOW_HIT)
    return hit / (1.0 - hit)


def _could_pay(table: dict[Cell, float], n: int, joint: int, counts: dict[Cell, int] | None, plain: float,
               draft_step: float | None = None) -> bool:
    """Whether drafting d tokens for each of `joint` requests, all accepted, beats plain rounds
    at some depth d within reach (one past the deepest measured: the extrapolation past it is
    optimistic enough to make any draft look worth a probe) or, with the measured `draft_step`,
    at any depth up to POSITIONS priced at the least it can cost: the reach's round and a draft
    step more a depth (a GPU's k = 1 cost 3 plain rounds and k = 8 3.5; from k = 1 alone no
    depth within reach paid, and in simulation acceptance 0.95 stayed plain for whole runs: 0.66 of k = 8)."""
    reach = _reach(table, n)
    for d in range(1, POSITIONS + 1):
        if d <= reach:
            cost = estimate(table, n, joint * d, d, counts)
        elif draft_step is not None and reach >= 2:
            cost = estimate(table, n, joint * reach, reach, counts) + (d - reach) * draft_step
        else:
            break
        if cost is not None and (n + joint * d) / cost > n / plain:
            return True
    return False


def plain_probe_interval(d: Decision, n_requests: int, restart: float = 0.0, discard: float = 0.0) -> int:
    """Rounds between measurements of plain rounds while drafting (`d`: the drafting decision).
    Nothing else measures them then, and a figure from another spell keeps drafting that loses or
    stops drafting that pays. Exploring costs the plain rounds' expected loss against the chosen
    configuration's time per token, a pipeline's `restart` where plain rounds are pipelined (the
    first PIPELINE_WARM_ROUNDS of them are set apart, the next measured) and the forward computed ahead that drafting
    again `discard`s; explorations come as often as keeps that under PROBE_SHARE of the time
    between them, and at most every PLAIN_GAP rounds."""
    cands = {c.b: c for c in d.candidates}
    best, plain = cands.get(d.budget), cands.get(0)
    if best is None or plain is None or not d.budget:
        return PLAIN_GAP
    rounds = 1 + PIPELINE_WARM_ROUNDS if restart else 1
    loss = restart + discard + rounds * max(0.0, plain.cost - n_requests * best.cost / best.gain)
    return max(PLAIN_GAP, math.ceil(loss / (PROBE_SHARE * best.cost)))
