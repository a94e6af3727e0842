"""The round contract: what the engine, the scheduler and the decoders exchange each round.

A round gives every active request one cycle. Before it, each joint request states where it
stands (`RowState`); the scheduler answers with a draft length per request (`RoundPlan`); after
it, the round is reported whole (`RoundReport`): its time, each cycle's drafts and acceptance, and
what was set apart from the cost table and why (`SetApart`). Cost cells are keyed by `Cell`.
`plan_round` and `run_round` are the round itself: the engine, `verity bench gpu` and the
simulator all run it. Pure Python, no MLX: decoders bring the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

CATCH_UP_LAG = 4  # a draft that must first feed more than this many tokens is catching up
PIPELINE_WARM_ROUNDS = 4  # pipelined plain rounds after drafting that cost more than steady ones (the start among them)
FREE_SIT_OUT = CATCH_UP_LAG - 2  # plain rounds a draft can sit out and draft without a catch-up (a drafting cycle leaves it 2 behind)


class SetApart(str, Enum):
    """Why a round's time (or part of it) is kept out of the cost table. The values are the
    decision log's words."""

    DRAFT_PREFILL = "draft prefill"  # a draft first feeds the prompt
    DRAFT_CATCH_UP = "draft catch-up"  # ... or the cycles it sat out
    LOOK_AHEAD_DISCARDED = "look-ahead discarded"  # a batched round throws away a forward computed ahead
    LOOK_AHEAD_TAKEN = "look-ahead taken"  # a drafting cycle waits for that forward's token instead
    PLAIN_PIPELINE_START = "plain pipeline start"  # unbatched plain cycles start their pipeline
    PLAIN_PIPELINE_WARM_UP = "plain pipeline warm-up"  # ... and its next rounds run dear
    FIRST_PLAIN_ROUNDS = "first plain rounds"  # a request's own start, before it ever drafted
    LAST_PLAIN_ROUND = "last plain round"  # computes nothing ahead: only the wait for its token
    PREFILL_OR_ERROR = "prefill or error"  # a request prefilled or failed in the round
    BATCH_SWITCH = "batch switch"  # a joint row moved into the baseline batch or out of it
    STALL = "stall"  # many times its cell's median

    def __str__(self) -> str:
        return self.value


CATCH_UP = (SetApart.DRAFT_PREFILL, SetApart.DRAFT_CATCH_UP)  # what a probe pays besides its round
PIPELINE = (SetApart.PLAIN_PIPELINE_START, SetApart.PLAIN_PIPELINE_WARM_UP)  # what stopping costs, pipelined


class Cell(NamedTuple):
    """A cost-table cell: N requests, B drafted tokens in all, D the deepest draft."""

    n: int
    b: int
    d: int

    def key(self) -> str:
        """As the decision log writes it."""
        return f"{self.n},{self.b},{self.d}"

    @classmethod
    def parse(cls, key: str) -> "Cell":
        n, b, d = key.split(",")
        return cls(int(n), int(b), int(d))


@dataclass
class Paid:
    """A switching cost paid on its own: its time, and the tokens and pieces a catch-up fed."""

    seconds: float = 0.0
    tokens: int = 0
    pieces: int = 0

    def add(self, other: "Paid") -> "Paid":
        return Paid(self.seconds + other.seconds, self.tokens + other.tokens, self.pieces + other.pieces)


@dataclass(frozen=True)
class RowState:
    """A joint request before a round, as the scheduler reads it."""

    request_id: str
    room: int  # the most drafts its cycle can still use (tokens left, less the one a cycle adds)
    lag: int = 0  # tokens its draft must feed before its first proposal
    lacks_prompt: bool = False  # its draft has not consumed the whole prompt yet
    ahead: bool = False  # its pipelined plain cycles computed the next forward ahead
    plain_run: int = 0  # pipelined plain cycles since its pipeline (re)started
    has_drafted: bool = False  # it drafted at least once
    last: bool = False  # its next token is its last

    @property
    def behind(self) -> bool:
        """Drafting now would first pay a catch-up: the prompt, or the cycles it sat out."""
        return self.lacks_prompt or self.lag > CATCH_UP_LAG

    @property
    def feed(self) -> int:
        """Tokens its draft would feed apart before drafting now (0: none)."""
        return max(0, self.lag - 1) if self.lag > CATCH_UP_LAG else 0


@dataclass(frozen=True)
class RoundInput:
    rows: list[RowState]  # the joint requests of the round
    n_requests: int  # every request of the round, baseline ones too
    pipelined: bool = False  # plain cycles of these rows run pipelined (unbatched)


@dataclass(frozen=True)
class RoundPlan:
    budgets: dict[str, int]  # draft length per joint request

    def k(self, request_id: str) -> int:
        return self.budgets.get(request_id, 0)

    @property
    def drafted(self) -> int:
        return sum(self.budgets.values())


@dataclass(frozen=True)
class CycleReport:
    request_id: str
    k: int  # drafted
    accepted: int


@dataclass
class RoundReport:
    """A round as it ran: `seconds` less what was paid apart; `reason` None: a complete round."""

    seconds: float
    reason: SetApart | None = None
    apart: dict[SetApart, Paid] = field(default_factory=dict)
    draft_s: float = 0.0  # what of it the drafting took
    cycles: list[CycleReport] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.reason is None


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
