"""A joint row parked in the baseline batch: while the plan drafts nothing for it, its plain
cycles are rows of the batch's one forward (worker/baseline.py) instead of forwards of its own
(docs/design.md, "Parked joint rows")."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from worker.baseline import BaselineBatch
from worker.round import Row, ScheduledRound, SetApart
from worker.joint.sampling import token_probs
from worker.sampling import RowSampling
from worker.state.checkpoint import RecordingArraysCache

PARK_AFTER = 2  # plans running that draft nothing for a row that drafted before it parks (a probe does not move it)


@dataclass
class Seat:
    """What the batch holds of a parked row: its sampling and the tokens it delivered."""

    batch: BaselineBatch
    sampling: RowSampling
    uid: int = -1
    delivered: list[tuple[int, object]] = field(default_factory=list)  # (token, log-probabilities)

    def deliver(self, token: int, logprobs) -> None:
        self.delivered.append((token, logprobs))

    def boundary_reached(self, cache) -> None:
        pass  # a parked row joins with one token: no boundary inside it

    def take(self) -> list[tuple[int, object]]:
        got, self.delivered = self.delivered, []
        return got


def batch_sampling(sampling: RowSampling, key_fn: Callable[[], mx.array]) -> RowSampling:
    """The row's sampling in the batch: its processors and log-probabilities, and a sampler
    drawing as its plain cycles do (the distribution of token_probs, one key of the joint
    cycles' stream a token), so a seeded row samples the same parked or not."""
    out = replace(sampling)
    params = sampling.params
    if not params.greedy:
        # one row's [V], as a plain cycle draws it: categorical draws otherwise from a [1, V] with one key
        out.sampler = lambda logprobs: mx.random.categorical(mx.log(token_probs(logprobs[0], params)), key=key_fn())[None]
    return out


def recording(cache: list) -> list:
    """A cache taken out of the batch, with the recurrent layers the joint cycle records."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache) and not isinstance(c, RecordingArraysCache):
            r = RecordingArraysCache(len(c.cache))
            r.cache = list(c.cache)
            c = r
        out.append(c)
    return out


@dataclass
class Parking:
    """Which joint rows decode in the baseline batch: while other rows run, one the plan drafts
    nothing for parks (at once if it never drafted, else after PARK_AFTER plans running); one
    the plan drafts for leaves."""

    batch: BaselineBatch
    plain_plans: dict[str, int] = field(default_factory=dict)  # by request: plans running that drafted nothing

    def apply(self, sr: ScheduledRound, fail: Callable[[Row, Exception], None]) -> None:
        """Parks and unparks by the round's plan, before it runs; a round in which a row moved is
        no sample of its cell. A row that fails to move ends alone and leaves the round."""
        moved, failed = False, set()
        drafted = {s.request_id: s.has_drafted for s in sr.states}
        for row in [r for r in sr.rows if r.request_id in drafted]:
            k, d = sr.plan.k(row.request_id), row.decoder
            plain = 0 if k else self.plain_plans.get(row.request_id, 0) + 1
            self.plain_plans[row.request_id] = plain
            try:
                if d.parked and k:
                    d.unpark()
                    moved = True
                elif not d.parked and plain >= (PARK_AFTER if drafted[row.request_id] else 1) and len(sr.rows) > 1:
                    d.park(self.batch)
                    moved = True
            except Exception as e:  # one request's failure must not take the others down
                failed.add(row.request_id)
                fail(row, e)
        sr.rows = [r for r in sr.rows if r.request_id not in failed]
        sr.states = [s for s in sr.states if s.request_id not in failed]
        if moved:
            sr.reason = sr.reason or SetApart.BATCH_SWITCH

    def forget(self, request_id: str) -> None:
        self.plain_plans.pop(request_id, None)
