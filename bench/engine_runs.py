"""Requests run through verity's engine (worker/engine.py, the code the worker serves with) for the
benches: submitted, stepped to their end, their tokens timed as they come out, and what their
rounds cost as the scheduler was told it.

A bench keeps one engine a configuration for its whole run, as a server keeps its scheduler;
per-run figures are differences of the engine's totals before and after the run.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from protocol import messages as m
from worker.batch.rows import CycleStats
from worker.engine import Controls, Engine, EngineConfig
from worker.loader import LoadedModel
from worker.round import RoundReport
from worker.scheduler import Scheduler

_IDS = itertools.count()  # request ids: every run a new request, as a server's


class IdsTokenizer:
    """The tokenizer of a random-weight model fed token ids (bench gpu's shapes): no text, no EOS."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eos_token_ids = vocab_size, set()

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    def decode(self, ids: list[int]) -> str:
        return ""


def served(model, vocab_size: int, name: str, context_limit: int = 32768) -> LoadedModel:
    """A built model as the engine takes a loaded one."""
    return LoadedModel(model, IdsTokenizer(vocab_size), name, "random", "none", context_limit, None)


class TimedScheduler(Scheduler):
    """The engine's scheduler, also summing what its rounds reported: every round's time, and the
    drafting rounds' time and draft time (the runner times a draft on the CPU every round, on a
    GPU one drafting round in DRAFT_TIMED_EVERY: `draft_share` reads the rounds it timed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_s = self.drafting_s = self.timed_s = self.draft_s = 0.0

    def observe(self, report: RoundReport) -> None:
        self.round_s += report.seconds
        if any(c.k for c in report.cycles):
            self.drafting_s += report.seconds
            if report.draft_s > 0:
                self.timed_s += report.seconds
                self.draft_s += report.draft_s
        super().observe(report)


def engine(target: LoadedModel, draft: Optional[LoadedModel] = None, k: Optional[int] = None,
           recovery: str = "fast", log: Optional[str] = None, controls: Optional[Controls] = None,
           max_active: int = 16) -> Engine:
    """An engine whose scheduler is a TimedScheduler (k: a fixed budget; None: adaptive)."""
    config = EngineConfig(max_active=max_active, draft_budget=k, decision_log=log, recovery=recovery)
    e = Engine(target, config, draft, controls)
    e.scheduler = TimedScheduler(k, config.max_round_budget, log)
    return e


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    first_at: float = 0.0  # perf_counter() of its first token's event
    last_at: float = 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time since it (prefill excluded)."""
        span = self.last_at - self.first_at
        return (len(self.tokens) - 1) / span if len(self.tokens) > 1 and span > 0 else math.nan


def request(prompt, n: int, mode: str) -> m.GenerateRequest:
    """Greedy, exactly n tokens; `prompt`: token ids, or a user message's text."""
    text = isinstance(prompt, str)
    return m.GenerateRequest(messages=[m.Message("user", prompt)] if text else None, prompt=None if text else list(prompt),
                             max_tokens=n, temperature=0.0, ignore_eos=True, mode=mode)


def generate(e: Engine, requests: list[m.GenerateRequest]) -> tuple[list[Generation], float]:
    """Submits the requests at once and steps the engine until it is idle: each one's tokens, in
    order, and the wall time."""
    t0 = time.perf_counter()
    ids = [f"r{next(_IDS)}" for _ in requests]
    for rid, req in zip(ids, requests):
        e.submit(rid, req)
    out = {rid: Generation() for rid in ids}
    while e.has_work():
        for ev in e.step():
            if isinstance(ev, m.Error):
                raise RuntimeError(f"{ev.request_id}: {ev.message}")
            if isinstance(ev, m.TextDelta) and ev.token_ids:
                g, now = out[ev.request_id], time.perf_counter()
                g.first_at = g.first_at or now
                g.last_at = now
                g.tokens += ev.token_ids
    return [out[rid] for rid in ids], time.perf_counter() - t0


@dataclass
class Totals:
    """An engine's counters at one moment (what a run adds is the difference of two)."""

    joint: CycleStats
    round_s: float = 0.0
    drafting_s: float = 0.0
    timed_s: float = 0.0
    draft_s: float = 0.0

    @classmethod
    def of(cls, e: Engine) -> "Totals":
        s, j = e.scheduler, CycleStats()
        j.add(e.totals.joint)
        return cls(j, *(getattr(s, a, 0.0) for a in ("round_s", "drafting_s", "timed_s", "draft_s")))


@dataclass
class Run:
    """One generation's figures; the shares are of its drafting rounds' time."""

    tokens: list
    tps: float
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    recovery_s: float = 0.0
    accepted_at: list = field(default_factory=list)  # per draft position: [accepted, tried]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def budget_mean(self) -> float:
        return self.drafted / self.cycles if self.cycles else 0.0


def run_one(e: Engine, prompt, n: int, mode: str = "joint") -> Run:
    """One request of n tokens alone in the engine, timed from its first token."""
    before = Totals.of(e)
    (g,), _ = generate(e, [request(prompt, n, mode)])
    after = Totals.of(e)
    a, b = after.joint, before.joint
    at = [[x - (b.accepted_at[j][0] if j < len(b.accepted_at) else 0), t - (b.accepted_at[j][1] if j < len(b.accepted_at) else 0)]
          for j, (x, t) in enumerate(a.accepted_at)]
    drafting = after.drafting_s - before.drafting_s
    timed = after.timed_s - before.timed_s
    draft = (after.draft_s - before.draft_s) * drafting / timed if timed > 0 else 0.0
    recovery = a.recovery_s - b.recovery_s
    return Run(g.tokens, g.decode_tps, a.drafted - b.drafted, a.accepted - b.accepted, a.cycles - b.cycles,
               draft, max(0.0, drafting - draft - recovery), recovery, [x for x in at if x[1]])
