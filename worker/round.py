"""The round contract: what the engine and the scheduler exchange each round.

A round gives every active request one cycle. Before it, each joint request states where it
stands (`RowState`); the scheduler answers with a draft length per request (`RoundPlan`); after
it, the round is reported whole (`RoundReport`): its time, each cycle's drafts and acceptance, and
what was set apart from the cost table and why (`SetApart`). Cost cells are keyed by `Cell`.
The round itself is worker/batch/runner.py's `play`. Pure Python, no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

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
