"""The old engine's round, for the simulator only: per-request decoders cycled one by one or in
groups (`plan_round`, `run_round`), which `python -m bench.simulator` replays on measured costs
to compare scheduler rules on the rounds earlier figures came from. The service runs
worker/batch/runner.py's `play`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from worker.round import (CATCH_UP_LAG, PIPELINE_WARM_ROUNDS, CycleReport, Paid, RoundInput, RoundPlan,  # noqa: F401
                          RoundReport, RowState, SetApart)


def set_apart(states: list[RowState], plan: RoundPlan, batched: bool) -> Optional[SetApart]:
    """Why a round of these joint rows is no sample of its cell (None: it is). A switching cost
    paid once would price every round of the shape as if it paid it. Costs the decoders pay on
    their own and time apart (a catch-up of more than CATCH_UP_LAG tokens, a discarded
    look-ahead) are no reason: the rest of the round is a round of its shape."""
    fed = [s for s in states if plan.k(s.request_id) and s.lag <= CATCH_UP_LAG]
    if any(s.lacks_prompt for s in fed):
        return SetApart.DRAFT_PREFILL
    restarts = [s for s in states if not batched and not plan.k(s.request_id)
                and (not s.ahead or s.plain_run < PIPELINE_WARM_ROUNDS)]
    if restarts and not any(s.has_drafted for s in restarts):
        return SetApart.FIRST_PLAIN_ROUNDS  # a request's own start, not what stopping costs
    if any(not s.ahead for s in restarts):
        return SetApart.PLAIN_PIPELINE_START
    if restarts:
        return SetApart.PLAIN_PIPELINE_WARM_UP
    if not batched and any(s.last and not plan.k(s.request_id) for s in states):
        return SetApart.LAST_PLAIN_ROUND
    return None


class Decoder(Protocol):
    """One request's generation as a round drives it: worker/baseline.py and
    worker/joint/decoder.py implement it, and the simulator's stand-ins."""

    @property
    def started(self) -> bool: ...

    def state(self, request_id: str, tokens_left: int) -> Optional[RowState]:
        """A started joint row's state (None: a row the scheduler only counts)."""

    def advance(self, k: int, last: bool) -> list[int]:
        """One cycle drafting k (the first call prefills and returns the first token)."""

    def commit(self, kept: int) -> None:
        """Keeps the first `kept` tokens of the last advance and recovers state to them."""

    @property
    def last_cycle(self) -> tuple[int, int]:
        """(drafted, accepted) of the last cycle."""

    @property
    def draft_s(self) -> float:
        """What its last drafting cycle's proposal took (0: not timed)."""

    def take_apart(self) -> dict[SetApart, Paid]:
        """The switching costs it paid on its own since the last call."""


@dataclass
class Row:
    request_id: str
    decoder: Decoder
    tokens_left: int


class Planner(Protocol):
    def plan_round(self, inp: RoundInput) -> RoundPlan: ...


@dataclass
class ScheduledRound:
    rows: list[Row]
    states: list[RowState]  # the joint rows'
    plan: RoundPlan
    batched: bool  # the joint rows cycle in batched forwards
    reason: Optional[SetApart]  # known before it runs

    @property
    def joint_ids(self) -> set[str]:
        return {s.request_id for s in self.states}


BatchFn = Callable[[list[Decoder], list[int]], list[list[int]]]  # (decoders, budgets) -> each one's tokens


@dataclass
class Group:
    """Rows that cycle together in batched forwards: `run` gives each its tokens."""

    ids: list[str]
    run: BatchFn


def plan_round(rows: list[Row], scheduler: Planner, batch_verify: bool = True) -> ScheduledRound:
    """The scheduler's plan for a round of these rows (in the engine's order)."""
    states = [s for r in rows if (s := r.decoder.state(r.request_id, r.tokens_left)) is not None]
    batched = batch_verify and len(states) > 0 and len(rows) > 1  # a joint row beside any other
    plan = scheduler.plan_round(RoundInput(states, len(rows), pipelined=not batched))
    reason = None if all(r.decoder.started for r in rows) else SetApart.PREFILL_OR_ERROR
    return ScheduledRound(rows, states, plan, batched, reason or set_apart(states, plan, batched))


def joint_group(sr: ScheduledRound, run: BatchFn) -> list[Group]:
    """The joint rows as one group, where the round batches them."""
    return [Group([s.request_id for s in sr.states], run)] if sr.batched else []


def run_round(sr: ScheduledRound, emit: Callable[[Row, list[int]], int], fail: Callable[[Row, Exception], None],
              groups: Sequence[Group] = (), clock: Callable[[], float] = time.perf_counter) -> RoundReport:
    """One cycle for every row: each group's rows together, the others one by one. `emit(row,
    tokens)` handles a cycle's tokens and returns how many it kept (fewer after a stop); `fail(row,
    error)` ends a row whose cycle raised, alone (a group's error ends the group's rows). The
    round's time leaves out what was paid apart."""
    for r in sr.rows:
        r.decoder.take_apart()  # what was paid since the last round (a snapshot's settle) is none of this one's
    t0 = clock()
    emitted, failed = _group_cycles(sr, groups, fail)
    cycles = []
    for r in sr.rows:
        if r.request_id in failed:
            continue
        try:
            tokens = emitted.get(r.request_id)
            if tokens is None:
                tokens = r.decoder.advance(sr.plan.k(r.request_id), r.tokens_left <= 1)
        except Exception as e:  # one request's failure must not take the others down
            failed.add(r.request_id)
            fail(r, e)
            continue
        r.decoder.commit(emit(r, tokens))
        if r.request_id in sr.joint_ids:
            cycles.append(CycleReport(r.request_id, *r.decoder.last_cycle))
    apart: dict[SetApart, Paid] = {}
    for r in sr.rows:
        for why, paid in r.decoder.take_apart().items():
            apart[why] = apart.get(why, Paid()).add(paid)
    draft_s = sum(r.decoder.draft_s for r in sr.rows if sr.plan.k(r.request_id))
    seconds = clock() - t0 - sum(p.seconds for p in apart.values())
    reason = sr.reason or (SetApart.PREFILL_OR_ERROR if failed else None)
    return RoundReport(seconds, reason, apart, draft_s, cycles)


def _group_cycles(sr: ScheduledRound, groups: Sequence[Group], fail: Callable[[Row, Exception], None]
                  ) -> tuple[dict[str, list[int]], set[str]]:
    """The groups' cycles: ({request id: emitted}, the ids that failed)."""
    by_id = {r.request_id: r for r in sr.rows}
    emitted, failed = {}, set()
    for g in groups:
        rows = [by_id[i] for i in g.ids if i in by_id]
        if not rows:
            continue
        try:
            out = g.run([r.decoder for r in rows], [sr.plan.k(r.request_id) for r in rows])
        except Exception as e:  # the group failed: each of its requests ends with the error
            for r in rows:
                fail(r, e)
            failed.update(r.request_id for r in rows)
            continue
        emitted.update((r.request_id, tokens) for r, tokens in zip(rows, out))
    return emitted, failed
