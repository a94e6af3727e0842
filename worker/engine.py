"""The model loop: a bounded FIFO of requests; each step admits what fits and runs one round of
the batch (worker/batch/): a chunk of each joining row's prompt, then one forward of every
decoding row, its draft length planned by the scheduler.

No sockets here: `submit` and `cancel` are plain calls that any thread may make, `step` runs on
the one MLX thread and returns the events it produced. worker/proc.py moves them over sockets.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from protocol import messages as m
from worker import blas_threads, memory, thinking
from worker.batch.rows import Acceptor, Chooser, CycleStats, Phase, Row, RowOutcome, advance
from worker.batch.runner import BatchRunner, play
from worker.batch.timing import PlainRounds
from worker.context import ContextPolicy, ContextRefused, rolling_refusal
from worker.emit import Emitter, QueuedRequest
from worker.kernels import fast_draft
from worker.grammar import Compiler, Grammar, GrammarInvalid
from worker.joint.sampling import make_key_fn
from worker.kvformat import NATIVE, KVFormat
from worker.loader import LoadedModel
from worker.residency import empty_weights
from worker.sampling import SamplingInvalid, sampling_for
from worker.scheduler import POSITIONS, Scheduler
from worker.scheduler.cost import CostModel
from worker.state.reuse import Held, Plan, PrefixCache, Start
from worker.text import PromptInvalid, answer_message, render_prompt

CALIBRATE_ROWS = 4  # the BLAS's threads are timed at one row and this many (worker/blas_threads.py)
CALIBRATE_ROUNDS = 4  # timed plain rounds at each (rows, threads)
# MLX keeps freed buffers for reuse, and a batch's growing contexts leave ever larger ones behind:
# they go back this often, as mlx-lm's BatchGenerator does, and whenever the batch empties
CLEAR_CACHE_ROUNDS = 512


@dataclass
class EngineConfig:
    max_active: int = 16  # requests decoded at once, in one batch
    max_waiting: int = 64  # requests queued behind them; the gateway bounds it first
    prefill_step: int = 512
    draft_budget: Optional[int] = None  # fixed tokens drafted per joint cycle; None: adaptive
    max_round_budget: Optional[int] = None  # adaptive: drafted tokens in one round at most (None: by the rows)
    decision_log: Optional[str] = None  # adaptive: JSON lines of every budget decision
    recovery: str = "fast"  # "fast" (per-position states) or "replay" (the kept tokens fed again)
    kv_budget: Optional[int] = None  # bytes the admitted requests' caches may take at most; None: memory.default_budget
    kv: KVFormat = NATIVE  # the target's attention KV (--kv-bits, --kv-group-size); the draft's stays native
    max_context: Optional[int] = None  # tokens of prompt and answer at most (None: the model's limit)
    context_overflow: str = "refuse"  # a request past it, unless it asks otherwise (worker/context.py)
    defaults: m.SamplingDefaults = field(default_factory=m.SamplingDefaults)  # for omitted sampling fields
    max_thinking_tokens: Optional[int] = None  # a thinking model's think block is closed after this many (None: never)


class RequestError(Exception):
    """A request the worker refuses before it is queued (maps to an HTTP status)."""

    def __init__(self, code: str, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.code, self.message, self.status, self.param = code, message, status, param


@dataclass
class Extension:
    """A finished answer as its next turn will resend it (PrefixCache.continuation), to prefill
    between the turns; `req`: the request that made it."""

    req: m.GenerateRequest
    plan: Plan
    tokens: list[int]
    floor: int  # the prefix a snapshot must give (its prompt's last message): else it is not worth it


class _Totals:
    """Counters since the worker started (the stats snapshot's)."""

    def __init__(self):
        self.requests = self.finished = self.prompt_tokens = self.generated_tokens = 0
        self.recent: deque = deque(maxlen=256)  # token timestamps
        self.joint = CycleStats()  # summed over released joint requests


def cache_identity(lm: LoadedModel, draft_id: Optional[str] = None, kv: KVFormat = NATIVE) -> str:
    """Identity under which cached state is valid (per-request thinking mode is mixed in later):
    the target's KV format among it, so no snapshot is restored into another format."""
    parts = [lm.revision, lm.chat_template or "", lm.quantization, draft_id or "no-draft", f"kv={kv.name}"]
    if lm.sharding:  # a distributed group's shards: world size and how the model is split
        parts.append(lm.sharding)
    if lm.adapter:  # a LoRA adapter changes every state the weights make
        parts.append(f"adapter={lm.adapter}")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


# (request id, prompt) -> the draft's chooser and the verify's acceptor (benchmarks: acceptance by construction)
Controls = Callable[[str, list[int]], tuple[Optional[Chooser], Optional[Acceptor]]]
Announce = Callable[[m.Queued], None]  # sends a request's Queued event (worker/proc.py: to the outbox)


class Engine:
    def __init__(self, lm: LoadedModel, config: Optional[EngineConfig] = None, draft: Optional[LoadedModel] = None,
                 controls: Optional[Controls] = None, reuse: Optional[PrefixCache] = None):
        """`controls`: replaces the draft's choices and the acceptance (benchmarks; never served).
        reuse: exact prefix reuse."""
        config = config or EngineConfig()
        self.lm, self.config, self.draft, self.reuse, self.controls = lm, config, draft, reuse, controls
        self.draft_id = f"{draft.model_id}@{draft.revision}" if draft else None
        self._lock = threading.Condition()
        self._waiting: deque[QueuedRequest] = deque()
        self._cancels: set[str] = set()
        self._active: list[QueuedRequest] = []
        self.totals = _Totals()
        self.scheduler = Scheduler(config.draft_budget, config.max_round_budget, config.decision_log)
        self.runner = self._make_runner()
        self.cache_cost = memory.cache_cost(lm.model, config.kv)
        self.draft_cost = memory.cache_cost(draft.model) if draft else memory.CacheCost(0, 0)
        self.kv_budget = config.kv_budget or memory.default_budget(
            memory.weights_bytes(lm.model) + (memory.weights_bytes(draft.model) if draft else 0))
        self._reserved = 0  # bytes the admitted requests' worst cases hold
        self._rounds_uncleared = 0  # rounds since MLX's buffer cache was last emptied
        self._extensions: deque[Extension] = deque()  # prefilled at the next step, before admitting
        self._params = _n_params(lm.model)  # what a prompt token's prefill costs, for blas_threads
        self._draft_params = _n_params(draft.model) if draft else 0
        self.vocab_size = len(lm.tokenizer.get_vocab())
        self.grammars = Compiler(lm.tokenizer)
        self.think = thinking.detect(lm.tokenizer, lm.chat_template)  # None: the model does not think
        self.emitter = Emitter(lm.tokenizer, self.totals, self.draft_id, self.think)
        self.context_limit = min(config.max_context or lm.context_limit, lm.context_limit)
        self.context = ContextPolicy(self.context_limit, config.context_overflow, self._render,
                                     lambda text: len(lm.tokenizer.encode(text)), rolling_refusal(lm.model))

    def _make_runner(self) -> BatchRunner:
        draft = self.draft.model if self.draft else None
        return BatchRunner(self.lm.model, draft, self.config.prefill_step, self.config.recovery,
                           fast_draft.where_it_runs(draft) if draft is not None else None, self.config.kv)

    # ---- any thread ----

    def submit(self, request_id: str, req: m.GenerateRequest) -> int:
        """Tokenizes and queues a request; returns its prompt length or raises RequestError."""
        return self.queue(request_id, req).prompt_tokens

    def queue(self, request_id: str, req: m.GenerateRequest, announce: Optional[Announce] = None) -> m.Queued:
        """submit, answered with the Queued event the gateway gets (whether it starts thinking).
        `announce` gets that event under the lock that hands the request to the step: it goes out
        before any of the request's events, whichever thread runs first (a step's go out after it)."""
        if req.mode == "joint" and self.draft is None:
            raise RequestError("joint_unavailable", "`mode` \"joint\" needs a draft model; this server has none "
                               "(start launch-stack with --draft)", param="mode")
        try:
            sampling_for(req, self.config.defaults, self.vocab_size)  # fills omitted fields; checks token ids
        except SamplingInvalid as e:
            raise RequestError("invalid_token_id", str(e), param=e.param) from None
        try:
            fitted = self.context.fit(req)
        except ContextRefused as e:
            raise RequestError(e.code, e.message, param=e.param) from None
        req, prompt = fitted.req, fitted.prompt
        need = self._worst_case(req, prompt)
        if need > self.kv_budget:
            raise RequestError(
                "kv_budget_exceeded",
                f"the prompt ({len(prompt)} tokens) and max_tokens ({req.max_tokens}) need up to {need} bytes of "
                f"cache; this server admits at most {self.kv_budget} (launch-stack --kv-budget)", param="max_tokens")
        plan = self.reuse.plan(req, prompt) if self.reuse else None
        grammar = self._grammar(req)
        inside = req.messages is not None and thinking.starts_inside(self.think, prompt)
        queued = m.Queued(request_id, len(prompt), inside)
        self._enqueue(QueuedRequest(request_id, req, prompt, time.perf_counter(), plan=plan, grammar=grammar,
                                    thinking=inside, dropped=(fitted.dropped_messages, fitted.dropped_tokens)),
                      lambda: announce(queued) if announce else None)
        return queued

    def _render(self, req: m.GenerateRequest) -> list[int]:
        try:
            prompt = render_prompt(self.lm.tokenizer, req, self.vocab_size)
        except PromptInvalid as e:
            raise RequestError("invalid_prompt", str(e), param="prompt") from None
        except Exception as e:  # a template may raise on odd conversations
            raise RequestError("invalid_prompt", f"the prompt could not be rendered: {e}", param="messages") from None
        if not prompt:
            raise RequestError("invalid_prompt", "the prompt is empty after tokenization", param="prompt")
        return prompt

    def _enqueue(self, r: QueuedRequest, announce: Callable[[], None]) -> None:
        """Queues a checked request (a distributed group's rank 0 stages it for every rank);
        `announce` runs under the lock the step takes it with."""
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise RequestError("queue_full", "the worker's waiting line is full", status=429)
            announce()
            self._waiting.append(r)
            self.totals.requests += 1
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify()

    def wait_for_work(self, timeout: float) -> bool:
        """True when a step is due: requests to serve, or answers to prefill between the turns."""
        with self._lock:
            if not self.has_work() and not self._extensions:
                self._lock.wait(timeout)
            return self.has_work() or bool(self._extensions)

    def has_work(self) -> bool:
        """Requests to serve (answers to prefill wait for a step: the next request's, if none sooner)."""
        return bool(self._active or self._waiting or self._cancels)

    def has_requests(self) -> bool:
        return bool(self._active or self._waiting)

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
        """Applies cancels, admits waiting requests, runs one round of the batch."""
        events: list = []
        self._apply_cancels(events)
        with mx.stream(generation_stream):  # mlx-lm's own stream, as its generate_step uses
            self._extend(events)
            self._admit(events)
            if self._active:
                self._round(events)
                self._rounds_uncleared += 1
        if self._rounds_uncleared and (not self._active or self._rounds_uncleared >= CLEAR_CACHE_ROUNDS):
            mx.clear_cache()
            self._rounds_uncleared = 0
        if not self._active:  # idle: the decision log's held-back records go out now
            self.scheduler.flush_log()
        return events

    def _round(self, events: list) -> None:
        """Prompt chunks, then one forward of every decoding row with the scheduler's drafts; the
        round's time, less what was paid apart, feeds the scheduler."""
        by_id = {r.id: r for r in self._active}
        blas_threads.use(self._params * self.runner.prefill_next(), len(self._active))
        try:
            rnd = play(self.runner, self.scheduler, lambda rid: self._tokens_left(by_id[rid]))
        except Exception as e:  # the batch's state is unknown after a failed forward: its rows end
            for r in list(self._active):
                self._fail(r, e, events)
            return
        for outcome in rnd.decoded.outcomes:
            self._emit(by_id[outcome.id], outcome, events)
        for r in [r for r in self._active if r.phase == Phase.DONE]:
            self._release(r)
        self.scheduler.observe(rnd.report())

    def _emit(self, r: QueuedRequest, outcome: RowOutcome, events: list) -> None:
        if r.phase == Phase.DONE:
            return
        if self.emitter.tokens(r, outcome, events, self._end(r.req)):
            r.phase = advance(r.phase, Phase.DONE)

    def _tokens_left(self, r: QueuedRequest) -> int:
        return min(r.req.max_tokens - len(r.tokens), self._end(r.req) - len(r.prompt) - len(r.tokens))

    def _end(self, req: m.GenerateRequest) -> int:
        """Where a request's answer ends at the latest: the context's end, or never (rolling)."""
        return self.context_limit if self.context.rolling(req) is None else sys.maxsize

    def _apply_cancels(self, events: list) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            waiting = [r for r in self._waiting if r.id in cancels]
            for r in waiting:
                self._waiting.remove(r)
        for r in waiting:
            events.append(m.Finished(r.id, "cancelled", self.emitter.metrics(r)))
        self.totals.finished += len(waiting)  # they never reach _release
        for r in [r for r in self._active if r.id in cancels]:
            self.emitter.finish(r, "cancelled", events)
            r.phase = advance(r.phase, Phase.DONE)
            self._release(r)

    def _grammar(self, req: m.GenerateRequest) -> Optional[Grammar]:
        """The request's output grammar, compiled against the served tokenizer (400 naming the schema
        or the limit); worker/proc.py calls submit on its compile pool when it is not compiled yet."""
        try:
            return self.grammars.compile(req)
        except GrammarInvalid as e:
            raise RequestError(e.code, e.message, param=e.param) from None

    def _worst_case(self, req: m.GenerateRequest, prompt: list[int]) -> int:
        """Bytes a request's caches may take: its prompt and max_tokens, within the context."""
        tokens = min(len(prompt) + req.max_tokens, self._end(req))
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
            self.totals.prompt_tokens += len(r.prompt)
            self._active.append(r)
            try:
                self._join(r)
            except Exception as e:
                self._fail(r, e, events)
                continue
            self.emitter.start(r, events)

    def _join(self, r: QueuedRequest) -> None:
        """The request's row, on caches that hold the longest prefix reuse has of its prompt."""
        req, reuse = r.req, self.reuse if r.plan else None
        sampling = sampling_for(req, self.config.defaults, self.vocab_size)
        answer = [self.grammars.processor(r.grammar)] if r.grammar is not None else []
        if req.messages is not None:  # the think block's budget; the grammar holds for the answer only
            budget = req.max_thinking_tokens if req.max_thinking_tokens is not None else self.config.max_thinking_tokens
            answer = thinking.gate(self.think, r.prompt, req.thinking, budget, answer)
        sampling.processors += answer  # last: no processor after it re-allows a token
        joint = req.mode == "joint"
        chooser, acceptor = self.controls(r.id, r.prompt) if self.controls and joint else (None, None)
        row = Row(r.id, r.prompt, sampling, make_key_fn(sampling.seed), joint=joint, chooser=chooser, acceptor=acceptor,
                  rolling=self.context.rolling(req))
        s = reuse.restored(r.plan, r.prompt, joint) if reuse else Start()
        if reuse:
            row.boundaries = reuse.boundaries(r.plan, s.pos, len(r.prompt))
            row.on_boundary = lambda n, cache, dcache, dn: reuse.keep_boundary(r.plan, r.prompt[:n], cache, dcache, dn)
        r.phase = advance(r.phase, Phase.PREFILL)
        r.row = row
        self.runner.join(row, s.cache, s.pos, s.draft_cache, s.draft_pos)

    def _fail(self, r: QueuedRequest, exc: Exception, events: list) -> None:
        if r.phase != Phase.DONE:
            r.phase = advance(r.phase, Phase.DONE)
        self._release(r, keep=False)
        events.append(m.Error(r.id, "generation_failed", f"generation failed: {type(exc).__name__}: {exc}", 500))

    def _release(self, r: QueuedRequest, keep: bool = True) -> None:
        self.scheduler.forget(r.id)
        self._reserved -= r.reserved
        r.reserved = 0
        if r in self._active:
            self._active.remove(r)
        if r.row is not None:
            if r.row.stats is not None:
                self.totals.joint.add(r.row.stats)
            if keep and r.plan is not None and r.finished and r.finished.finish_reason in ("stop", "length"):
                self._keep_generation(r)
            self.runner.leave(r.id)
            r.row = None
        self.totals.finished += 1

    def _keep_generation(self, r: QueuedRequest) -> None:
        """A snapshot of what the finished request's caches hold (the prompt and its answer)."""
        if r.id not in self.runner.rows or self.runner.rows[r.id].phase != Phase.DECODE:
            return
        if len(r.prompt) + len(r.tokens) > self.context_limit:  # rolled past the context: no prompt starts so
            return
        tokens, cache, draft_cache, draft_tokens = self.runner.held(r.id)
        self.reuse.keep_generation(r.plan, Held(tokens, cache, draft_cache, draft_tokens))
        inside = thinking.starts_inside(self.think, r.prompt)
        answer = answer_message("".join(r.text), self.think is not None, inside)
        ext = None if self.lm.sharding else self.reuse.continuation(r.req, r.plan, r.prompt, tokens, answer)
        if ext is not None:
            floor = r.plan.boundaries[-1] if r.plan.boundaries else len(r.prompt)
            self._extensions.append(Extension(r.req, r.plan, ext, floor))

    def _extend(self, events: list) -> None:
        """Prefills each finished answer as its next turn will resend it, from the longest snapshot,
        and keeps a snapshot at its end; skipped when its caches do not fit the KV budget now."""
        while self._extensions:
            x = self._extensions.popleft()
            joint = x.req.mode == "joint"
            prompt = x.tokens + x.tokens[-1:]  # the row holds x.tokens: its last token is never fed
            cost = self.cache_cost + self.draft_cost if joint else self.cache_cost
            if self.reuse is None or self._reserved + cost.worst_case(len(prompt)) > self.kv_budget:
                continue
            plan = Plan(x.plan.identity, [len(x.tokens)])
            s = self.reuse.restored(plan, prompt, joint)
            if s.pos < x.floor:
                continue
            sampling = sampling_for(x.req, self.config.defaults, self.vocab_size)
            row = Row("\x00extend", prompt, sampling, make_key_fn(sampling.seed), joint=joint)
            row.boundaries = self.reuse.boundaries(plan, s.pos, len(prompt))
            if joint and s.draft_pos < s.pos == len(x.tokens):  # the target's state whole, the draft's short:
                row.boundaries = [s.pos]  # kept again, the draft's caught up
            row.on_boundary = lambda n, c, dc, dn: self.reuse.keep_boundary(plan, x.tokens[:n], c, dc, dn)
            try:
                self.runner.join(row, s.cache, s.pos, s.draft_cache, s.draft_pos)
                while row.phase == Phase.PREFILL:
                    self.runner.prefill()
            except Exception as e:  # as a failed round: the batch's state is unknown
                for r in list(self._active):
                    self._fail(r, e, events)
            finally:
                self.runner.leave(row.id)

    def release_memory(self) -> None:
        """Idle unload (worker/residency.py), on an empty batch: the weights emptied in place, the
        slot caches and in-memory reuse snapshots dropped."""
        self.runner = None  # its slot caches (and a CUDA draft kernel's packed weights) go; adopt_weights makes one
        for lm in (self.lm, self.draft):
            if lm is not None:
                empty_weights(lm.model)
        if self.reuse:
            self.reuse.release_memory()

    def adopt_weights(self, lm: LoadedModel, draft: Optional[LoadedModel]) -> None:
        """The weights of a model loaded again, set into the served modules."""
        for mine, new in ((self.lm, lm), (self.draft, draft)):
            if mine is not None:
                mine.model.update(new.model.parameters())
        self.runner = self._make_runner()

    def warm_forwards(self) -> None:
        """Every forward width a round may use, once (a distributed group's every rank runs it, in
        step: the forwards meet in the same collectives)."""
        req = m.GenerateRequest(messages=[m.Message("user", "Hello")], max_tokens=1)
        with mx.stream(generation_stream):
            self.runner.warm(self._render(req) * 16, POSITIONS + 1)

    def calibrate_threads(self) -> Optional[blas_threads.Calibration]:
        """Times plain rounds at each BLAS thread count on an empty batch, so decode rounds take the
        faster (worker/blas_threads.py); the scheduler's round costs, measured at the count before,
        start anew where it changed. A single process only (a group's ranks would time apart)."""
        before = [blas_threads.calibration.threads(n) for n in range(1, self.config.max_active + 1)]
        req = m.GenerateRequest(messages=[m.Message("user", "Hello")], max_tokens=1)
        rounds = PlainRounds(self.runner, self._render(req) * 2, CALIBRATE_ROUNDS)
        try:
            with mx.stream(generation_stream):
                out = blas_threads.calibrate(rounds, sorted({1, min(CALIBRATE_ROWS, self.config.max_active)}))
        finally:
            rounds.close()
        if out is not None and [out.threads(n) for n in range(1, self.config.max_active + 1)] != before:
            self.scheduler.cost = CostModel()
        return out

    def warmup(self) -> None:
        """Runs the shapes serving uses (prefill chunk, one-token decode) once before READY."""
        req = m.GenerateRequest(messages=[m.Message("user", "Hello")], max_tokens=4, temperature=0.0)
        self.warm_forwards()
        self.submit("warmup", req)
        if self.draft is not None:
            self.submit("warmup-joint", m.GenerateRequest(messages=req.messages, max_tokens=8, temperature=0.0,
                                                          mode="joint"))
        while self.has_work():
            self.step()
        self.totals = _Totals()
        self.emitter.totals = self.totals
