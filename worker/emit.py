"""What a request's tokens become: text deltas through its streaming detokenizer and stop
strings, its end (EOS, a stop, its length, the context's end) and its metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from protocol import messages as m
from worker import thinking
from worker.batch.rows import Phase, Row, RowOutcome
from worker.grammar import Grammar
from worker.sampling import Chosen
from worker.state.reuse import Plan
from worker.text import StopMatcher, StreamingDetokenizer


@dataclass
class QueuedRequest:
    """A request the engine holds, from its submit to its release."""

    id: str
    req: m.GenerateRequest
    prompt: list[int]
    received: float
    phase: Phase = Phase.WAITING
    row: Optional[Row] = None  # its row of the batch, while admitted
    detok: Optional[StreamingDetokenizer] = None
    stop: Optional[StopMatcher] = None
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the text emitted (what its client may resend)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    finished: Optional[m.Finished] = None
    plan: Optional[Plan] = None  # prefix reuse (worker/state/reuse.py)
    grammar: Optional[Grammar] = None  # the output's grammar (response_format, forced tool calls)
    reserved: int = 0  # bytes of the KV budget its worst case holds while admitted
    thinking: bool = False  # its generation starts inside a think block
    dropped: tuple[int, int] = (0, 0)  # messages and prompt tokens its context policy left out


class Emitter:
    """Turns rows' outcomes into events."""

    def __init__(self, tokenizer, totals, draft_id: Optional[str], think: Optional[thinking.ThinkFormat] = None):
        """`think`: the served model's think format (None: it does not think)."""
        self.tokenizer, self.totals, self.draft_id, self.think = tokenizer, totals, draft_id, think
        self.eos_ids = set(tokenizer.eos_token_ids)

    def start(self, r: QueuedRequest, events: list) -> None:
        r.detok = StreamingDetokenizer(self.tokenizer, r.prompt)
        r.stop = StopMatcher(r.req.stop)
        events.append(m.Started(r.id, len(r.prompt)))
        if r.req.echo:  # completions: the prompt's text first
            events.append(m.TextDelta(r.id, r.detok.text_of(r.prompt), []))

    def tokens(self, r: QueuedRequest, outcome: RowOutcome, events: list, context_limit: int) -> bool:
        """Emits a round's tokens for the request; True when one of them ended it."""
        joint = r.req.mode == "joint"
        for i, token in enumerate(outcome.tokens):
            lp = outcome.chosen[i] if i < len(outcome.chosen) else None
            drafted = outcome.drafted[i] if joint and i < len(outcome.drafted) else (False if joint else None)
            if self._token(r, token, lp, drafted, events, context_limit):
                return True
        return False

    def _token(self, r: QueuedRequest, token: int, lp: Optional[Chosen], drafted: Optional[bool], events: list,
               context_limit: int) -> bool:
        now = time.perf_counter()
        if not r.tokens:
            r.first_token_at = now
        r.last_token_at = now
        r.tokens.append(token)
        self.totals.generated_tokens += 1
        self.totals.recent.append(now)
        if token in self.eos_ids and not r.req.ignore_eos:
            return self.finish(r, "stop", events)
        text, stopped = r.stop.feed(r.detok.add(token))
        if text or not stopped:
            r.text.append(text)
            events.append(m.TextDelta(r.id, text, [token], None if lp is None else [self._logprob(lp)],
                                      None if drafted is None else [drafted]))
        if stopped:
            return self.finish(r, "stop", events, flush=False)
        if len(r.tokens) >= r.req.max_tokens or len(r.prompt) + len(r.tokens) >= context_limit:
            return self.finish(r, "length", events)
        return False

    def _logprob(self, c: Chosen) -> m.TokenLogprob:
        def text(t: int) -> str:
            return self.tokenizer.decode([t])

        top = [m.TopLogprob(text(t), lp, list(text(t).encode())) for t, lp in c.top]
        return m.TokenLogprob(text(c.token), c.logprob, list(text(c.token).encode()), top)

    def finish(self, r: QueuedRequest, reason: str, events: list, flush: bool = True) -> bool:
        """Emits the end of a request (the caller releases it)."""
        if flush and r.detok is not None:
            text, stopped = r.stop.feed(r.detok.flush())
            tail = text if stopped else text + r.stop.flush()
            if tail:
                r.text.append(tail)
                events.append(m.TextDelta(r.id, tail, []))
        r.finished = m.Finished(r.id, reason, self.metrics(r), stop_sequence=r.stop.hit if r.stop else None)
        events.append(r.finished)
        return True

    def metrics(self, r: QueuedRequest) -> m.RequestMetrics:
        n = len(r.tokens)
        span = r.last_token_at - r.first_token_at
        out = m.RequestMetrics(
            mode=r.req.mode, prompt_tokens=len(r.prompt), completion_tokens=n,
            reused_tokens=r.plan.reused if r.plan else 0,
            cycles=n, ttft_s=(r.first_token_at - r.received) if n else 0.0,
            decode_tps=(n - 1) / span if n > 1 and span > 0 else 0.0,
            reasoning_tokens=thinking.reasoning_tokens(self.think, r.thinking, r.tokens),
            dropped_messages=r.dropped[0], dropped_tokens=r.dropped[1],
        )
        s = r.row.stats if r.row is not None else None
        if s is not None:
            out.draft, out.cycles, out.drafted, out.accepted = self.draft_id, s.cycles, s.drafted, s.accepted
            out.rollbacks, out.recovery_s = s.rollbacks, s.recovery_s
            out.budget_mean = s.drafted / s.cycles if s.cycles else 0.0
        return out
