"""A row of the batch: its phase (one state machine), what its caches hold and what it waits to
emit; and the typed results a round hands the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Union

import mlx.core as mx

from worker.batch.slots import Rolling
from worker.sampling import Chosen, RowSampling


class Phase(str, Enum):
    """A request's life in the worker."""

    WAITING = "waiting"  # queued, not admitted
    PREFILL = "prefill"  # a row: its prompt fed a chunk a round
    DECODE = "decode"  # a row: a token a round, or a verified draft
    DONE = "done"  # ended (finished, cancelled or failed); its row has left the batch


EDGES = {Phase.WAITING: {Phase.PREFILL, Phase.DONE}, Phase.PREFILL: {Phase.DECODE, Phase.DONE},
         Phase.DECODE: {Phase.DONE}, Phase.DONE: set()}


def advance(phase: Phase, to: Phase) -> Phase:
    """The phase after an edge; an edge the life does not have is a bug."""
    if to not in EDGES[phase]:
        raise RuntimeError(f"a request cannot go from {phase.value} to {to.value}")
    return to


Token = Union[int, tuple[mx.array, int]]  # a known token, or element i of an array still computing


@dataclass
class Pending:
    """The token a row feeds next (its caches hold every token before it): the target's own
    choice, still computing or known, and its log-probabilities when asked; `emit`: not yet
    emitted (False for a prompt's last token)."""

    token: Token
    emit: bool = True
    logprobs: Optional[mx.array] = None

    def value(self) -> int:
        if isinstance(self.token, int):
            return self.token
        array, i = self.token
        return int(array[i].item())


@dataclass
class CycleStats:
    """A joint row's cycles: drafted, accepted, recovered."""

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    recovery_s: float = 0.0
    accepted_at: list = field(default_factory=list)  # per draft position: [accepted, proposed]

    def add(self, s: "CycleStats") -> None:
        """Adds another row's cycles (the worker's totals)."""
        self.cycles, self.drafted, self.accepted = self.cycles + s.cycles, self.drafted + s.drafted, self.accepted + s.accepted
        self.rollbacks, self.recovery_s = self.rollbacks + s.rollbacks, self.recovery_s + s.recovery_s
        while len(self.accepted_at) < len(s.accepted_at):
            self.accepted_at.append([0, 0])
        for mine, (a, t) in zip(self.accepted_at, s.accepted_at):
            mine[0] += a
            mine[1] += t

    def record(self, k: int, n: int) -> None:
        self.cycles += 1
        self.drafted += k
        self.accepted += n
        self.rollbacks += n < k
        while len(self.accepted_at) < k:
            self.accepted_at.append([0, 0])
        for j in range(min(n + 1, k)):  # positions up to the first rejection were tried
            self.accepted_at[j][1] += 1
            self.accepted_at[j][0] += j < n


# choose(logits [V], output position of the proposal) -> (token: [1] or a known int, draft probabilities [V] or None)
Chooser = Callable[[mx.array, int], tuple[Union[mx.array, int], Optional[mx.array]]]
# accept(drafted, verify logits [k+1, V], output position of d1, the logits' argmax where read) -> (accepted, own token)
Acceptor = Callable[[list[int], mx.array, int, Optional[list[int]]], tuple[int, int]]
# a prompt boundary reached: (length, target caches, draft caches or None, draft length)
Boundary = Callable[[int, list, Optional[list], int], None]


@dataclass
class Row:
    """One request in the batch."""

    id: str
    prompt: list[int]
    sampling: RowSampling
    key: Callable[[], mx.array]  # its random keys, one a draw: the same alone or batched
    joint: bool = False
    phase: Phase = Phase.PREFILL
    seq: list[int] = field(default_factory=list)  # the prompt, then every token read
    fed: int = 0  # prompt tokens the target's caches hold, while it prefills
    draft_fed: int = 0  # ... and the draft's
    pending: Optional[Pending] = None
    boundaries: list[int] = field(default_factory=list)  # prompt lengths where a snapshot is kept
    on_boundary: Optional[Boundary] = None
    stats: Optional[CycleStats] = None  # joint rows
    chooser: Optional[Chooser] = None  # the draft's choice (benchmarks: by construction)
    acceptor: Optional[Acceptor] = None  # the verify's acceptance (benchmarks: by construction)
    drafted_once: bool = False
    rolling: Optional[Rolling] = None  # decodes past the context over a window (worker/batch/slots.py)

    def __post_init__(self):
        if not self.seq:
            self.seq = list(self.prompt)

    @property
    def output_position(self) -> int:
        """Output index of the pending token (0: the first generated token)."""
        return len(self.seq) - len(self.prompt)


@dataclass
class RowOutcome:
    """What a round gave one row: tokens to emit (with their log-probabilities when asked and
    whether the draft proposed each)."""

    id: str
    tokens: list[int] = field(default_factory=list)
    chosen: list[Chosen] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
