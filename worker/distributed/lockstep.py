"""Every rank runs the same Engine step on its shard. Rank 0 (`LeaderEngine`) decides what
depends on time (which requests arrived, which were cancelled, each round's draft lengths) and
sends it before the step; the other ranks (`FollowerEngine`) apply it and run the step with
identical inputs, so their batched forwards meet in the same collectives and, the logits being
identical after each all_sum, emit the same tokens. Sampling is keyed per request: rank 0 gives
every request a seed."""

from __future__ import annotations

import logging
import secrets
from typing import Callable, Optional

import msgspec

from protocol import messages as m
from worker.distributed.link import Diverged, GroupBroken, Link, RoundBudgets, StepInput, Submitted, broken_group, digest
from worker.engine import Engine, EngineConfig, RequestError, QueuedRequest
from worker.loader import LoadedModel
from worker.round import RoundInput, RoundPlan

log = logging.getLogger("verity.worker")


class LeaderPlanner:
    """The scheduler of rank 0, whose every round plan goes to the other ranks."""

    def __init__(self, inner, link: Link):
        self.inner, self.link = inner, link

    def plan_round(self, inp: RoundInput) -> RoundPlan:
        plan = self.inner.plan_round(inp)
        if inp.rows:
            self.link.send(RoundBudgets(dict(plan.budgets)))
        return plan

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FollowerPlanner:
    """Rank 0's plans, received; nothing measured here decides anything."""

    def __init__(self, link: Link):
        self.link = link
        self.drafting = False  # rank 0's, set each step

    def plan_round(self, inp: RoundInput) -> RoundPlan:
        if not inp.rows:
            return RoundPlan({})
        msg = self.link.receive()
        ids = {r.request_id for r in inp.rows}

        if not isinstance(msg, RoundBudgets) or set(msg.budgets) != ids:
            raise Diverged(f"rank {self.link.rank}: rank 0's round plan is not for this rank's joint rows {sorted(ids)}")
        return RoundPlan(msg.budgets)

    def observe(self, report) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def flush_log(self) -> None:
        pass


class GroupEngine(Engine):
    """What every rank's engine does alike."""

    def _fail(self, r: QueuedRequest, exc: Exception, events: list) -> None:
        """A collective that failed mid-round takes the group down (launch-stack restarts it; the
        gateway ends the started requests as at a worker's death), not just the request."""
        if broken_group(exc):
            raise GroupBroken(f"a collective failed: {exc}") from exc
        super()._fail(r, exc, events)


class LeaderEngine(GroupEngine):
    """Rank 0: submissions and cancels are staged, then sent and applied at the start of a step."""

    def __init__(self, lm: LoadedModel, config: EngineConfig, draft: Optional[LoadedModel], link: Link):
        super().__init__(lm, config, draft)
        self.link = link
        self.scheduler = LeaderPlanner(self.scheduler, link)
        self._staged: list[QueuedRequest] = []
        self._staged_cancels: set[str] = set()
        self._digest = 0
        self.ranks: list[m.RankStatus] = []  # every rank's, for the stats

    def stats(self, pid: int) -> m.StatsSnapshot:
        snapshot = super().stats(pid)
        snapshot.ranks = self.ranks
        return snapshot

    def _enqueue(self, r: QueuedRequest, announce: Callable[[], None]) -> None:
        if r.req.seed is None:  # every rank samples the request with the same keys
            r.req = msgspec.structs.replace(r.req, seed=secrets.randbits(63))
        with self._lock:
            if len(self._waiting) + len(self._staged) >= self.config.max_waiting:
                raise RequestError("queue_full", "the worker's waiting line is full", status=429)
            announce()
            self._staged.append(r)
            self.totals.requests += 1
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._staged_cancels.add(request_id)
            self._lock.notify()

    def has_work(self) -> bool:
        return super().has_work() or bool(self._staged or self._staged_cancels)

    def wait_for_work(self, timeout: float) -> bool:
        if super().wait_for_work(timeout):
            return True
        self.link.send(StepInput(idle=True))  # the heartbeat the other ranks' watchdogs wait for
        return False

    def step(self) -> list:
        with self._lock:
            new, self._staged = self._staged, []
            cancels, self._staged_cancels = self._staged_cancels, set()
            self._waiting.extend(new)
            self._cancels |= cancels
        self.link.send(StepInput([Submitted(r.id, r.req, r.prompt) for r in new], sorted(cancels),
                                 self.scheduler.drafting, self._digest, reuse=self.reuse is not None))
        events = super().step()
        self._digest = digest(events)
        self.link.moved()
        return events

    def stop_followers(self) -> None:
        self.link.send(StepInput(stop=True))


class FollowerEngine(GroupEngine):
    """Ranks 1..N-1: no sockets; each step is rank 0's, replayed on this rank's shard."""

    def __init__(self, lm: LoadedModel, config: EngineConfig, draft: Optional[LoadedModel], link: Link):
        super().__init__(lm, config, draft)
        self.link = link
        self.scheduler = FollowerPlanner(link)
        self._digest = 0
        self.prefix_cache = None  # this rank's snapshots, on while rank 0 says so (after its warm-up)

    def run(self) -> int:
        """Follows rank 0 until it says stop (0); raises when the group breaks."""
        while True:
            msg = self.link.receive()
            if not isinstance(msg, StepInput):
                raise Diverged(f"rank {self.link.rank}: a round plan came where a step was due")
            if msg.stop:
                return 0
            if msg.idle:
                continue
            if msg.digest != self._digest:
                raise Diverged(f"rank {self.link.rank} emitted other tokens than rank 0 in the last step")
            self._apply(msg)
            self._digest = digest(self.step())
            self.link.moved()

    def _apply(self, msg: StepInput) -> None:
        self.reuse = self.prefix_cache if msg.reuse else None
        for s in msg.submitted:  # checked, tokenized and compiled here as on rank 0
            if self.submit(s.request_id, s.request) != len(s.prompt) or self._waiting[-1].prompt != s.prompt:
                raise Diverged(f"rank {self.link.rank} tokenized request {s.request_id} otherwise than rank 0")
        with self._lock:
            self._cancels.update(msg.cancels)
        self.scheduler.drafting = msg.drafting

    def _enqueue(self, r: QueuedRequest, announce: Callable[[], None]) -> None:
        with self._lock:  # rank 0 checked the room
            announce()
            self._waiting.append(r)
            self.totals.requests += 1
