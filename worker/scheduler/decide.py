"""The decision: the budget B that maximises tokens per second over the measured costs, with
probes while drafting is off and plain explorations while it is on; docs/scheduler.md, "The
decision", "Switching" and "Exploration"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from worker.round import PIPELINE_WARM_ROUNDS, Cell
from worker.scheduler.allocation import POSITIONS, allocate, rank, survivals
from worker.scheduler.probe import PROBE_DEPTH, PROBE_SHARE, probe_lengths
from worker.scheduler.table import Steps, depth_limit, estimate

SWITCH_HORIZON = 16  # rounds a switching cost (a catch-up, a discarded forward, a restart) is spread over
PLAIN_GAP = 64  # drafting rounds after which plain rounds are measured again, at the least
FEW_PLAIN_GAP = 8  # ... and while the plain cell has fewer than MIN_SAMPLES rounds
EXPLORE_MARGIN = 1.25  # ... where drafting leads plain by less than this
DRAFT_LEAD = 1.05  # a round drafts where that leads plain rounds by this at least (docs/scheduler.md, "The decision")


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

    @classmethod
    def from_log(cls, rec: dict) -> "Candidate":
        return cls(rec["B"], rec["D"], rec["cost"], rec["gain"], rec["objective"])


@dataclass(frozen=True)
class Decision:
    """A round's decision: each request's survivals, the budgets weighed, the one chosen and its
    draft length per request; `explored`: a drafting choice gave way to a plain exploration."""

    survival: list[list[float]]
    candidates: list[Candidate]
    budget: int
    allocation: list[int]
    explored: bool

    def to_log(self) -> dict:
        """As the decision log writes it (and `replay` compares it)."""
        return {"survival": self.survival, "candidates": [c.to_log() for c in self.candidates],
                "budget": self.budget, "allocation": self.allocation, "explored": self.explored}

    @classmethod
    def from_log(cls, rec: dict) -> "Decision":
        """A logged decision (a log from before `explored` was written: False)."""
        return cls(rec["survival"], [Candidate.from_log(c) for c in rec["candidates"]], rec["budget"],
                   rec["allocation"], rec.get("explored", False))


def decide(acceptance: Sequence[Sequence[float]], n_requests: int, table: dict[Cell, float], b_max: int,
           probe: bool = False, counts: dict[Cell, int] | None = None,
           behind: Sequence[bool] | None = None, switch_s: float = 0.0, stop_s: float = 0.0,
           explore_plain: bool = False, draft_step: Steps = None,
           explore_margin: float | None = EXPLORE_MARGIN, pad: bool = True,
           probe_rows: Sequence[int] | None = None, probe_depth: int = PROBE_DEPTH, halted: bool = False,
           step_by_step: bool = False, lead: float = 1.0, rising: bool = False) -> Decision:
    """B* = argmax over B in 0..b_max of (N + sum of the B largest survivals) / cost(N, B, D(B)).

    `acceptance` has one row per joint request (baseline requests count in N only). Candidates
    whose cost cannot be estimated are skipped; B = 0 is always a candidate, and so is every depth
    however far past the deepest measured (`estimate` extrapolates, optimistically). An allocation
    that drafts for a request whose draft is `behind` (it must first catch up, or its pipelined
    plain rounds computed a forward ahead that drafting throws away) pays `switch_s` spread over
    SWITCH_HORIZON rounds; B = 0 pays `stop_s`, what stopping costs, likewise. With `probe`, a
    round that would draft nothing drafts `probe_depth` for each of `probe_rows` (`probe_lengths`);
    None, as logs written before them: at least one token for each request, the best drafting
    candidate's allocation where wider. With `explore_plain`, a round that would draft drafts
    nothing where drafting leads by less than `explore_margin` (None: by any lead); `pad`: see
    `estimate`; `halted`: the never-lose rule stopped drafting (window.py): the round drafts
    nothing, probes neither; `step_by_step`: no deeper than `depth_limit` (False: as logs written
    before it were); `lead`: what drafting must lead plain rounds by (DRAFT_LEAD; 1.0: as logs
    written before it were); `rising`: extrapolate from the drafting depths' rising steps only
    (`estimate`; False: as logs written before it were). Returns the inputs' derived values and
    the choice, as logged and replayed.
    """
    surv = [survivals(a) for a in acceptance]
    ranked = rank(surv)
    candidates = []
    gain, lengths, d = float(n_requests), [0] * len(surv), 0
    deepest = depth_limit(table, n_requests, draft_step) if step_by_step else None
    for b in range(0, min(b_max, len(ranked)) + 1):
        if b:  # allocate(surv, b), built as B grows
            r, j = ranked[b - 1]
            gain += surv[r][j - 1]
            lengths[r], d = max(lengths[r], j), max(d, j)
        if deepest is not None and d > deepest:
            break  # B grows with D: every budget past here is deeper
        cost = estimate(table, n_requests, b, d, counts, draft_step, pad, rising)
        if cost is None and b == 0:
            cost = 1.0  # nothing measured yet: start plain, which measures B = 0
        if cost is not None:
            switching = switch_s / SWITCH_HORIZON if behind and any(k and x for k, x in zip(lengths, behind)) else 0.0
            switching += stop_s / SWITCH_HORIZON if b == 0 else 0.0
            candidates.append(Candidate(b, d, cost, gain, gain / (cost + switching)))
    plain = candidates[0]  # B = 0 is always the first candidate
    best = _best(candidates)
    if best.objective < lead * plain.objective:
        best = plain
    budget = best.b
    lengths = allocate(surv, budget)
    explored = bool(not halted and explore_plain and budget
                    and (explore_margin is None or best.objective < explore_margin * plain.objective))
    if explored or halted:
        lengths, budget = [0] * len(surv), 0
    elif probe and budget == 0 and ranked:
        lengths = _probe_allocation(surv, candidates, probe_rows, probe_depth)
        budget = sum(lengths)
    return Decision(surv, candidates, budget, lengths, explored)


def _probe_allocation(surv: list[list[float]], candidates: list[Candidate], probe_rows: Sequence[int] | None,
                      probe_depth: int) -> list[int]:
    """What a probe drafts: `probe_depth` for each of `probe_rows`; None (logs written before
    them): at least one token for each request with room, the best drafting candidate's allocation
    where wider."""
    if probe_rows is not None:
        return probe_lengths(surv, probe_rows, probe_depth)
    drafting = _best_drafting(candidates)
    widest = allocate(surv, drafting.b) if drafting else [0] * len(surv)
    return [max(k, int(bool(row))) for k, row in zip(widest, surv)]


def _best(candidates: list[Candidate]) -> Candidate:
    return max(candidates, key=lambda c: (c.objective, -c.b))  # equal objectives: the smaller budget


def _best_drafting(candidates: list[Candidate]) -> Candidate | None:
    """The best candidate that drafts: a probe drafts no deeper for a request than it would."""
    return _best([c for c in candidates if c.b]) if len(candidates) > 1 else None


def plain_probe_interval(d: Decision, n_requests: int, restart: float = 0.0, discard: float = 0.0) -> int:
    """Rounds between measurements of plain rounds while drafting (`d`: the drafting decision).
    Exploring costs the plain rounds' expected loss against the chosen configuration's time per
    token, a pipeline's `restart` where plain rounds are pipelined (the first PIPELINE_WARM_ROUNDS
    of them are set apart, the next measured) and the forward computed ahead that drafting again
    `discard`s; explorations come as often as keeps that under PROBE_SHARE of the time between
    them, and at most every PLAIN_GAP rounds."""
    cands = {c.b: c for c in d.candidates}
    best, plain = cands.get(d.budget), cands.get(0)
    if best is None or plain is None or not d.budget:
        return PLAIN_GAP
    rounds = 1 + PIPELINE_WARM_ROUNDS if restart else 1
    loss = restart + discard + rounds * max(0.0, plain.cost - n_requests * best.cost / best.gain)
    return max(PLAIN_GAP, math.ceil(loss / (PROBE_SHARE * best.cost)))
