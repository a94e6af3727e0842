"""The never-lose rule: per number of requests N, the tokens per second that drafting rounds
(probes among them) realised, against plain rounds of the same N, over a sliding window; where
drafting loses beyond noise, drafting stops for that N for a cooldown that doubles on each
repeated failure, then a probe tries again; docs/scheduler.md, "Never lose"."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from worker.round import SetApart

LOSE_WINDOW = 24  # drafting rounds of an N (probes counted) weighed against its plain rounds ...
SPAN = 4 * LOSE_WINDOW  # ... of the last this many rounds (an older text's rounds, and probes far apart, drop out)
PLAIN_KEPT = 32  # plain rounds of an N they are weighed against (their median)
MIN_JUDGED = 8  # drafting rounds the window holds before it judges
MIN_PLAIN = 3  # ... and plain rounds
LOSS_MARGIN = 0.03  # drafting stops where it delivers less than (1 - this) of plain's tokens/s ...
LOSS_Z = 2.0  # ... by more than this many standard errors of noise: acceptance's (a drafted token is accepted or
              # not: variance 1/4 at most) and time's (the plain rounds' own spread, theirs and the window's rounds')
COOLDOWN = 32  # rounds of that N a first stop lasts; each repeated failure doubles it ...
MAX_COOLDOWN = 1024  # ... up to this
# what drafting costs besides its own rounds: a round set apart for one of these counts with the drafting
# rounds (its time, its tokens), as a user feels it. The batch engine pays none of them; the rule needs none.
SWITCHING = (SetApart.DRAFT_PREFILL, SetApart.DRAFT_CATCH_UP, SetApart.LOOK_AHEAD_DISCARDED, SetApart.LOOK_AHEAD_TAKEN,
             SetApart.PLAIN_PIPELINE_START, SetApart.PLAIN_PIPELINE_WARM_UP, SetApart.BATCH_SWITCH)


@dataclass(frozen=True)
class WindowState:
    """Where the rule stands for one N: the window's drafting rounds (`probes` of them probes),
    what they and the plain rounds realised (tokens/s at the machine's pace then; None: too few
    to tell), its loss share (1 - drafting ÷ plain) and the bound it was judged against, and the
    stop: rounds of it left, repeated failures, the next stop's length."""

    n: int
    rounds: int
    probes: int
    drafting_rate: float | None
    plain_rate: float | None
    loss: float | None
    bound: float | None
    stopped_left: int
    failures: int
    cooldown: int

    def to_log(self) -> dict:
        return {"n": self.n, "rounds": self.rounds, "probes": self.probes, "drafting_rate": self.drafting_rate,
                "plain_rate": self.plain_rate, "loss": self.loss, "bound": self.bound,
                "stopped_left": self.stopped_left, "failures": self.failures, "cooldown": self.cooldown}


@dataclass
class _PerN:
    drafting: deque = field(default_factory=lambda: deque(maxlen=LOSE_WINDOW))  # (round, tokens, seconds, drafted, probe)
    plain: deque = field(default_factory=lambda: deque(maxlen=PLAIN_KEPT))  # seconds
    stopped_left: int = 0
    failures: int = 0
    passed: int = 0  # drafting rounds judged since the last stop without a loss


class NeverLose:
    """The rule's state, by N. `observe` takes each round that counts (its seconds normalised to
    the machine's pace, what it paid apart included); `stopped` says whether drafting is off for
    an N, and counts the stop's rounds down. When a stop ends, the decision's own rule resumes:
    the rounds the stop sat out count toward the next probe, which is then due."""

    def __init__(self):
        self.by_n: dict[int, _PerN] = {}
        self.round = 0  # the last round observed (the scheduler's count)

    def _at(self, n: int) -> _PerN:
        return self.by_n.setdefault(n, _PerN())

    def observe(self, n: int, round_: int, tokens: int, seconds: float, drafted: int, probe: bool,
                switched: bool = False) -> WindowState | None:
        """Round `round_` of n requests, which drafted `drafted` tokens (`probe`: a probe) and
        delivered `tokens`: a complete plain one, or one that drafted or whose cost drafting
        caused (`switched`: set apart for one of SWITCHING); returns the state where this round
        stopped drafting (None otherwise)."""
        at, self.round = self._at(n), round_
        if not drafted and not switched:
            at.plain.append(seconds)
            return None
        at.drafting.append((round_, tokens, seconds, drafted, probe))
        state = self.state(n)
        if state.loss is None or state.loss <= state.bound:
            at.passed += state.loss is not None
            if at.passed >= LOSE_WINDOW:  # a whole window without a loss: a later stop is a first one
                at.failures = 0
            return None
        at.failures += 1
        at.stopped_left, at.passed = self._cooldown(at.failures), 0
        at.drafting.clear()  # judged anew after the stop
        return replace(state, stopped_left=at.stopped_left, failures=at.failures, cooldown=self._cooldown(at.failures + 1))

    def stopped(self, n: int) -> bool:
        """Drafting is stopped for n requests this round (a round planned: one of the stop's)."""
        at = self.by_n.get(n)
        if at is None or not at.stopped_left:
            return False
        at.stopped_left -= 1
        return True

    def state(self, n: int) -> WindowState:
        at = self._at(n)
        recent = [(t, s, b, p) for r, t, s, b, p in at.drafting if r > self.round - SPAN]
        rounds, probes = len(recent), sum(p for *_, p in recent)
        rate = plain_rate = loss = bound = None
        if rounds:
            rate = sum(t for t, *_ in recent) / sum(s for _, s, *_ in recent)
        if len(at.plain) >= MIN_PLAIN:
            plain = sorted(at.plain)
            median = plain[len(plain) // 2]
            plain_rate = n / median
            spread = 1.4826 * sorted(abs(x - median) for x in plain)[len(plain) // 2] / median  # a round's time, relative
        if rate is not None and plain_rate is not None and rounds >= MIN_JUDGED:
            spent = sum(s for _, s, *_ in recent)
            noise = sum((spread * s) ** 2 + b / 4 / plain_rate ** 2 for _, s, b, _ in recent) / spent ** 2
            noise += (1.2533 * spread) ** 2 / len(plain)  # the plain median's own
            loss, bound = 1.0 - rate / plain_rate, LOSS_MARGIN + LOSS_Z * math.sqrt(noise)
        return WindowState(n, rounds, probes, rate, plain_rate, loss, bound, at.stopped_left, at.failures,
                           self._cooldown(at.failures + 1))

    @staticmethod
    def _cooldown(failures: int) -> int:
        return min(MAX_COOLDOWN, COOLDOWN * 2 ** max(0, failures - 1))
