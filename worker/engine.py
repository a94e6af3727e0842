"""The model loop: a bounded FIFO of requests; each step admits what fits and runs one round
(worker/round.py): a cycle for every active request.

No sockets here: `submit` and `cancel` are plain calls that any thread may make, `step` runs on
the one MLX thread and returns the events it produced. worker/proc.py moves them over sockets.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from protocol import messages as m
from worker import blas_threads, memory
from worker.baseline import BaselineBatch, BaselineRow
from worker.joint.batch import joint_round
from worker.joint.decoder import CycleStats, JointDecoder
from worker.joint.draft import Drafter
from worker.loader import LoadedModel
from worker.joint.guests import round_groups
from worker.joint.parked import Parking
from worker.round import Row, plan_round, run_round
from worker.scheduler import Scheduler
from worker.state.reuse import Plan, PrefixCache, Start
from worker.grammar import Compiler, Grammar, GrammarInvalid, request_grammar
from worker.sampling import Chosen, SamplingInvalid, sampling_for
from worker.text import PromptInvalid, StopMatcher, StreamingDetokenizer, render_prompt


@dataclass
class EngineConfig:
    max_active: int = 16  # requests decoded at once, in one batch
    max_waiting: int = 64  # requests queued behind them; the gateway bounds it first
    prefill_step: int = 512
    draft_budget: Optional[int] = None  # fixed tokens drafted per joint cycle; None: adaptive
    max_round_budget: int = 16  # adaptive: drafted tokens in one round, all requests together
    decision_log: Optional[str] = None  # adaptive: JSON lines of every budget decision
    batch_verify: bool = True  # joint requests of a round share batched draft and verify forwards
    recovery: str = "fast"  # "fast" (per-position states) or "replay" (checkpoint and re-feed)
    park: bool = True  # joint rows drafting nothing decode in the baseline batch (docs/design.md, "Parked joint rows")
    kv_budget: Optional[int] = None  # bytes the admitted requests' caches may take at most; None: memory.default_budget
    defaults: m.SamplingDefaults = field(default_factory=m.SamplingDefaults)  # for omitted sampling fields


class RequestError(Exception):
    """A request the worker refuses before it is queued (maps to an HTTP status)."""

    def __init__(self, code: str, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.code, self.message, self.status, self.param = code, message, status, param


@dataclass
class QueuedRequest:
    """A request the engine holds, from its submit to its release."""

    id: str
    req: m.GenerateRequest
    prompt: list[int]
    received: float
    decoder: Optional["BaselineRow | JointDecoder"] = None
    detok: Optional[StreamingDetokenizer] = None
    stop: Optional[StopMatcher] = None
    tokens: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    done: bool = False
    finished: Optional[m.Finished] = None
    last_token_at: float = 0.0
    plan: Optional[Plan] = None  # prefix reuse (worker/state/reuse.py)
    grammar: Optional[Grammar] = None  # the output's grammar (response_format, forced tool calls)
    reserved: int = 0  # bytes of the KV budget its worst case holds while admitted
    chosen: list[Chosen] = field(default_factory=list)  # log-probabilities of the tokens being emitted
    drafted: list[bool] = field(default_factory=list)  # joint: which of them the draft proposed


class _Totals:
    """Counters since the worker started (the stats snapshot's)."""

    def __init__(self):
        self.requests = self.finished = self.prompt_tokens = self.generated_tokens = 0
        self.recent: deque = deque(maxlen=256)  # token timestamps
        self.joint = CycleStats()  # summed over released joint requests


def cache_identity(lm: LoadedModel, draft_id: Optional[str] = None) -> str:
    """Identity under which cached state is valid (per-request thinking mode is mixed in later)."""
    parts = [lm.revision, lm.chat_template or "", lm.quantization, draft_id or "no-draft"]
    if lm.sharding:  # a distributed group's shards: world size and how the model is split
        parts.append(lm.sharding)
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


class Engine:
    def __init__(self, lm: LoadedModel, config: Optional[EngineConfig] = None, draft: Optional[LoadedModel] = None,
                 drafter_factory=None, reuse: Optional[PrefixCache] = None):
        """drafter_factory(request_id, prompt) -> Drafter replaces the draft model's own drafter
        (benchmarks: the controlled-acceptance draft; never served). reuse: exact prefix reuse."""
        config = config or EngineConfig()
        self.lm, self.config, self.draft, self.reuse = lm, config, draft, reuse
        self.drafter_factory = drafter_factory
        self.draft_id = f"{draft.model_id}@{draft.revision}" if draft else None
        self.eos_ids = set(lm.tokenizer.eos_token_ids)
        self._lock = threading.Condition()
        self._waiting: deque[QueuedRequest] = deque()
        self._cancels: set[str] = set()
        self._active: list[QueuedRequest] = []
        self.totals = _Totals()
        self.scheduler = Scheduler(config.draft_budget, config.max_round_budget, config.decision_log)
        self.baseline = BaselineBatch(lm.model, config.prefill_step, config.max_active)
        self.parking = Parking(self.baseline) if config.park else None
        self.cache_cost = memory.cache_cost(lm.model)
        self.draft_cost = memory.cache_cost(draft.model) if draft else memory.CacheCost(0, 0)
        self.kv_budget = config.kv_budget or memory.default_budget(
            memory.weights_bytes(lm.model) + (memory.weights_bytes(draft.model) if draft else 0))
        self._reserved = 0  # bytes the admitted requests' worst cases hold
        self._params = _n_params(lm.model)  # what a prompt token's prefill costs, for blas_threads
        self._draft_params = _n_params(draft.model) if draft else 0
        self.vocab_size = len(getattr(lm.tokenizer, "_tokenizer", lm.tokenizer))
        self.grammars = Compiler(lm.tokenizer)

    # ---- any thread ----

    def submit(self, request_id: str, req: m.GenerateRequest) -> int:
        """Tokenizes and queues a request; returns its prompt length or raises RequestError."""
        if req.mode == "joint" and self.draft is None:
            raise RequestError("joint_unavailable", "`mode` \"joint\" needs a draft model; this server has none (start launch-stack with --draft)", param="mode")
        try:
            sampling_for(req, self.config.defaults, self.vocab_size)  # fills omitted fields; checks token ids
        except SamplingInvalid as e:
            raise RequestError("invalid_token_id", str(e), param=e.param) from None
        try:
            prompt = render_prompt(self.lm.tokenizer, req, self.vocab_size)
        except PromptInvalid as e:
            raise RequestError("invalid_prompt", str(e), param="prompt") from None
        except Exception as e:  # a template may raise on odd conversations
            raise RequestError("invalid_prompt", f"the prompt could not be rendered: {e}", param="messages") from None
        if not prompt:
            raise RequestError("invalid_prompt", "the prompt is empty after tokenization", param="prompt")
        if len(prompt) >= self.lm.context_limit:
            raise RequestError(
                "context_length_exceeded",
                f"the prompt has {len(prompt)} tokens; this model's context limit is {self.lm.context_limit}",
                param="messages" if req.messages is not None else "prompt",
            )
        need = self._worst_case(req, prompt)
        if need > self.kv_budget:
            raise RequestError(
                "kv_budget_exceeded",
                f"the prompt ({len(prompt)} tokens) and max_tokens ({req.max_tokens}) need up to {need} bytes of "
                f"cache; this server admits at most {self.kv_budget} (launch-stack --kv-budget)", param="max_tokens")
        plan = self.reuse.plan(req, prompt) if self.reuse else None
        grammar = self._grammar(req)
        self._enqueue(QueuedRequest(request_id, req, prompt, time.perf_counter(), plan=plan, grammar=grammar))
        return len(prompt)

    def _enqueue(self, r: QueuedRequest) -> None:
        """Queues a checked request (a distributed group's rank 0 stages it for every rank)."""
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise RequestError("queue_full", "the worker's waiting line is full", status=429)
            self._waiting.append(r)
            self.totals.requests += 1
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify()

    def wait_for_work(self, timeout: float) -> bool:
        with self._lock:
            if not self.has_work():
                self._lock.wait(timeout)
            return self.has_work()

    def has_work(self) -> bool:
        return bool(self._active or self._waiting or self._cancels)

    def active_count(self) -> int:
        return len(self._active)

    def stats(self, pid: int) -> m.StatsSnapshot:
        t = self.totals
        now = time.perf_counter()
        recent = [x for x in list(t.recent) if now - x < 5.0]
        tps = (len(recent) - 1) / (now - recent[0]) if len(recent) > 1 and now > recent[0] else 0.0
        return m.StatsSnapshot(
            process="worker", pid=pid, time=time.time(), queue_depth=len(self._waiting),
            active=len(self._active), requests_total=t.requests, requests_finished=t.finished,
            prompt_tokens_total=t.prompt_tokens, generated_tokens_total=t.generated_tokens,
            tokens_per_s=tps, drafted_total=t.joint.drafted, accepted_total=t.joint.accepted,
            cycles_total=t.joint.cycles, rollbacks_total=t.joint.rollbacks, recovery_s_total=t.joint.recovery_s,
            **(self.reuse.stats_fields() if self.reuse else {}),
        )

    # ---- the MLX thread ----

    def step(self) -> list:
        """Applies cancels, admits waiting requests, decodes one token for each active one."""
        events: list = []
        self._apply_cancels(events)
        with mx.stream(generation_stream):  # mlx-lm's own: the joint path runs where generate_step does
            self._admit(events)
            self._round(events)
        if not self._active:  # idle: the decision log's held-back records go out now
            self.scheduler.flush_log()
        return events

    def _round(self, events: list) -> None:
        """One round: a cycle for every active request, joint rows' draft lengths from the
        scheduler, joint rows batched; the round's report feeds the scheduler."""
        by_id = {r.id: r for r in self._active}
        rows = [Row(r.id, r.decoder, self._tokens_left(r)) for r in self._active]
        sr = plan_round(rows, self.scheduler, self.config.batch_verify)
        if self.parking:
            self.parking.apply(sr, lambda row, e: self._fail(by_id[row.request_id], e, events))
        lacking = [by_id[s.request_id] for s in sr.states if s.lacks_prompt and sr.plan.k(s.request_id)]
        joint_starts = [r.decoder for r in self._active if r.req.mode == "joint" and not r.decoder.started]
        blas_threads.use(self._params * (self.baseline.prefill_next() + sum(d.prefill_next + 1 for d in joint_starts))
                         + self._draft_params * sum(len(r.prompt) for r in lacking))  # a draft's first cycle prefills it

        def emit(row: Row, tokens: list[int]) -> int:
            r, kept = by_id[row.request_id], 0
            r.chosen = list(getattr(r.decoder, "chosen", []))
            r.drafted = list(getattr(r.decoder, "drafted", []))
            for token in tokens:
                kept += 1
                if self._on_token(r, token, events):
                    break
            return kept

        report = run_round(sr, emit, lambda row, e: self._fail(by_id[row.request_id], e, events),
                           round_groups(sr, self.baseline, joint_round))
        for r in [r for r in self._active if r.done]:
            r.finished.metrics = self._metrics(r)  # with the last cycle's recovery
            self._release(r)
        self.scheduler.observe(report)

    def _tokens_left(self, r: QueuedRequest) -> int:
        return min(r.req.max_tokens - len(r.tokens), self.lm.context_limit - len(r.prompt) - len(r.tokens))

    def _apply_cancels(self, events: list) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            waiting = [r for r in self._waiting if r.id in cancels]
            for r in waiting:
                self._waiting.remove(r)
        for r in waiting:
            events.append(m.Finished(r.id, "cancelled", self._metrics(r)))
        self.totals.finished += len(waiting)  # they never reach _release
        for r in [r for r in self._active if r.id in cancels]:
            self._finish(r, "cancelled", events)
            self._release(r)

    def _alone_and_plain_first(self) -> bool:
        """A new joint request's first cycles are likely plain and unbatched: a fixed k of 0, or
        the adaptive scheduler whose last decision drafted nothing, and no other joint request
        active or waiting to batch with (docs/design.md, "Pipelined plain cycles")."""
        with self._lock:
            others = any(w.req.mode == "joint" for w in self._waiting)
        others = others or any(a.req.mode == "joint" for a in self._active)
        plain = self.config.draft_budget == 0 or (self.config.draft_budget is None and not self.scheduler.drafting)
        return plain and not (self.config.batch_verify and others)

    def _grammar(self, req: m.GenerateRequest) -> Optional[Grammar]:
        """The request's output grammar, checked against the served tokenizer (400 naming the schema)."""
        try:
            grammar = request_grammar(req)
            if grammar is not None:
                self.grammars.check(grammar)
            return grammar
        except GrammarInvalid as e:
            raise RequestError("invalid_schema", e.message, param=e.param) from None

    def _worst_case(self, req: m.GenerateRequest, prompt: list[int]) -> int:
        """Bytes a request's caches may take: its prompt and max_tokens, within the context."""
        tokens = min(len(prompt) + req.max_tokens, self.lm.context_limit)
        cost = self.cache_cost + self.draft_cost if req.mode == "joint" else self.cache_cost
        return cost.worst_case(tokens)

    def _admit(self, events: list) -> None:
        """Admits waiting requests in order while a row is free and the head's worst case fits."""
        while len(self._active) < self.config.max_active:
            with self._lock:
                if not self._waiting:
                    return
                r = self._waiting[0]
                r.reserved = self._worst_case(r.req, r.prompt)
                if self._reserved + r.reserved > self.kv_budget:
                    return  # it waits for the admitted to release theirs
                self._waiting.popleft()
            self._reserved += r.reserved
            r.decoder = self._decoder(r)
            r.detok = StreamingDetokenizer(self.lm.tokenizer, r.prompt)
            r.stop = StopMatcher(r.req.stop)
            self.totals.prompt_tokens += len(r.prompt)
            self._active.append(r)
            events.append(m.Started(r.id, len(r.prompt)))
            if r.req.echo:  # completions: the prompt's text first
                events.append(m.TextDelta(r.id, r.detok.text_of(r.prompt), []))

    def _decoder(self, r: QueuedRequest) -> "BaselineRow | JointDecoder":
        """The request's decoder, on caches that hold the longest prefix reuse has of its prompt.
        Either prefills the rest a chunk a round, its boundary snapshots kept as the chunks reach
        them."""
        req, reuse = r.req, self.reuse if r.plan else None
        sampling = sampling_for(req, self.config.defaults, self.vocab_size)
        if r.grammar is not None:  # last: no processor after it re-allows a token
            sampling.processors.append(self.grammars.processor(r.grammar))
        if req.mode == "joint":
            s = reuse.restored(r.plan, r.prompt, True) if reuse else Start()
            drafter = (self.drafter_factory(r.id, r.prompt) if self.drafter_factory
                       else Drafter(self.draft.model, self.config.recovery, self.config.prefill_step,
                                    s.draft_cache, r.prompt[: s.draft_pos]))
            kept = (lambda b, cache, d: reuse.keep_joint_boundary(r.plan, r.prompt[:b], cache, d)) if reuse else None
            return JointDecoder(self.lm.model, drafter, r.prompt, sampling.params, req.seed, self.config.recovery,
                                self.config.prefill_step, s.cache, s.pos, self._alone_and_plain_first(), sampling,
                                reuse.boundaries(r.plan, s.pos, len(r.prompt)) if reuse else (), kept)
        if reuse is None:
            return BaselineRow(self.baseline, r.prompt, 0.0, 1.0, None, sampling=sampling)
        s = reuse.restored(r.plan, r.prompt, False)
        return BaselineRow(self.baseline, r.prompt, 0.0, 1.0, None, s.cache, s.pos,
                           reuse.boundaries(r.plan, s.pos, len(r.prompt)),
                           lambda b, cache: reuse.keep_boundary(r.plan, r.prompt[:b], cache), sampling=sampling)

    def _on_token(self, r: QueuedRequest, token: int, events: list) -> bool:
        """Handles one emitted token; True when it ended the request."""
        now = time.perf_counter()
        if not r.tokens:
            r.first_token_at = now
        r.last_token_at = now
        r.tokens.append(token)
        self.totals.generated_tokens += 1
        self.totals.recent.append(now)
        if token in self.eos_ids and not r.req.ignore_eos:
            return self._finish(r, "stop", events)
        text, stopped = r.stop.feed(r.detok.add(token))
        lp = [self._token_logprob(r.chosen.pop(0))] if r.chosen else None
        drafted = [r.drafted.pop(0) if r.drafted else False] if r.req.mode == "joint" else None
        if text or not stopped:
            events.append(m.TextDelta(r.id, text, [token], lp, drafted))
        if stopped:
            return self._finish(r, "stop", events, flush=False)
        if len(r.tokens) >= r.req.max_tokens or len(r.prompt) + len(r.tokens) >= self.lm.context_limit:
            return self._finish(r, "length", events)
        return False

    def _token_logprob(self, c: Chosen) -> m.TokenLogprob:
        def text(t: int) -> str:
            return self.lm.tokenizer.decode([t])

        top = [m.TopLogprob(text(t), lp, list(text(t).encode())) for t, lp in c.top]
        return m.TokenLogprob(text(c.token), c.logprob, list(text(c.token).encode()), top)

    def _finish(self, r: QueuedRequest, reason: str, events: list, flush: bool = True) -> bool:
        """Emits the end of a request; the caller releases it after recovering its state."""
        if flush and r.detok is not None:
            text, stopped = r.stop.feed(r.detok.flush())
            tail = text if stopped else text + r.stop.flush()
            if tail:
                events.append(m.TextDelta(r.id, tail, []))
        r.done = True
        r.finished = m.Finished(r.id, reason, self._metrics(r))
        events.append(r.finished)
        return True

    def _fail(self, r: QueuedRequest, exc: Exception, events: list) -> None:
        self._release(r)
        events.append(m.Error(r.id, "generation_failed", f"generation failed: {type(exc).__name__}: {exc}", 500))

    def _release(self, r: QueuedRequest) -> None:
        self.scheduler.forget(r.id)
        if self.parking:
            self.parking.forget(r.id)
        self._reserved -= r.reserved
        r.reserved = 0
        if r in self._active:
            self._active.remove(r)
        if r.decoder is not None and r.decoder.stats is not None:
            self.totals.joint.add(r.decoder.stats)
        if r.plan is not None and r.finished and r.finished.finish_reason in ("stop", "length") and r.decoder is not None:
            self.reuse.keep_generation(r.plan, r.decoder.held())  # of the tokens the target cache consumed
        if r.decoder is not None:
            r.decoder.close()
            r.decoder = None
        self.totals.finished += 1

    def _metrics(self, r: QueuedRequest) -> m.RequestMetrics:
        n = len(r.tokens)
        span = r.last_token_at - r.first_token_at
        out = m.RequestMetrics(
            mode=r.req.mode, prompt_tokens=len(r.prompt), completion_tokens=n,
            reused_tokens=r.plan.reused if r.plan else 0,
            cycles=n, ttft_s=(r.first_token_at - r.received) if n else 0.0,
            decode_tps=(n - 1) / span if n > 1 and span > 0 else 0.0,
        )
        if r.decoder is not None and r.decoder.stats is not None:
            s = r.decoder.stats
            out.draft, out.cycles, out.drafted, out.accepted = self.draft_id, s.cycles, s.drafted, s.accepted
            out.rollbacks, out.recovery_s = s.rollbacks, s.recovery_s
            out.budget_mean = s.drafted / s.cycles if s.cycles else 0.0
        return out

    def warmup(self) -> None:
        """Runs the shapes serving uses (prefill chunk, one-token decode) once before READY."""
        req = m.GenerateRequest(messages=[m.Message("user", "Hello")], max_tokens=4, temperature=0.0)
        self.submit("warmup", req)
        if self.draft is not None:
            self.submit("warmup-joint", m.GenerateRequest(messages=req.messages, max_tokens=8, temperature=0.0, mode="joint"))
        while self.has_work():
            self.step()
        self.totals = _Totals()
