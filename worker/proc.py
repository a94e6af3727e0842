"""WorkerProc: the process around the engine. Sockets, IO threads, READY, signals.

The MLX thread (the main thread) runs only the engine loop. IO threads move bytes: jobs in
(tokenized and queued from that thread, so a reply comes without waiting for a step), cancels in
(applied at once as a flag), events and stats out (the stats are the worker's heartbeat).

A cancel can overtake its job (the jobs thread is busy tokenizing): one for a request not yet
known is remembered (EarlyIds) and applied when the job arrives. A prompt whose text is too
long to fit the context even at the vocabulary's longest token is refused before tokenizing, and
one over LONG_PROMPT_BYTES is tokenized on a thread of its own, so that long prompts never hold
up short ones (the tokenizer releases the GIL).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional, get_args

import msgspec
import zmq

from protocol import codec, messages as m, runtime
from protocol.schema import message_text
from worker import faults, memory
from worker.defaults import resolve as resolve_defaults
from worker.engine import Engine, EngineConfig, RequestError, cache_identity
from worker.kvformat import attention_shapes, format_problem, kv_format
from worker.loader import EMBEDDED, AdapterError, LoadedModel, PairingError, load_draft, load_model
from worker.residency import Residency
from worker.state.reuse import PrefixCache
from worker.text import PromptInvalid, tokenize

log = logging.getLogger("verity.worker")
STATS_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.5
POLL_MS = 200
EARLY_CANCELS = 4096  # cancels remembered for jobs not yet arrived; the oldest go first
EARLY_CANCEL_S = 120.0  # and each is forgotten after this long
LONG_PROMPT_BYTES = 16 << 10  # ~15 ms of tokenizing (SmolLM2's tokenizer: 600 KB in 0.56 s)
# threads that compile grammars (llguidance drops the GIL while it compiles): half the cores, at
# most 2, so decoding keeps a core (worker/blas_threads.py leaves one for the host thread)
GRAMMAR_THREADS = max(1, min(2, (os.cpu_count() or 2) // 2))


class EarlyIds:
    """Request ids met before their job was recorded (a cancel that overtook it, or its end):
    bounded in number and in age."""

    def __init__(self, limit: int = EARLY_CANCELS, expiry_s: float = EARLY_CANCEL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.limit, self.expiry_s, self.clock = limit, expiry_s, clock
        self._at: OrderedDict[str, float] = OrderedDict()

    def remember(self, request_id: str) -> None:
        now = self.clock()
        self._at[request_id] = now
        self._at.move_to_end(request_id)
        while self._at and (len(self._at) > self.limit or now - next(iter(self._at.values())) > self.expiry_s):
            self._at.popitem(last=False)

    def take(self, request_id: str) -> bool:
        at = self._at.pop(request_id, None)
        return at is not None and self.clock() - at <= self.expiry_s

    def __len__(self) -> int:
        return len(self._at)


def max_token_bytes(tokenizer) -> int:
    """The longest vocabulary entry in UTF-8 bytes: no token stands for more bytes of text."""
    try:
        return max(len(t.encode()) for t in tokenizer.get_vocab()) or 1
    except Exception:  # a tokenizer without a vocabulary listing: no cheap bound
        return 0


def prompt_bytes(req: m.GenerateRequest) -> int:
    if req.messages is None:
        return len(req.prompt.encode()) if isinstance(req.prompt, str) else 0  # token ids: counted as tokens
    return sum(len(message_text(x).encode()) for x in req.messages)


class WorkerProc:
    def __init__(self, engine: Engine, lm: LoadedModel, runtime_dir: str, residency: Optional[Residency] = None):
        self.draft = engine.draft
        self.residency = residency or Residency(engine, lambda: (lm, engine.draft), None)
        self.engine, self.lm, self.pid = engine, lm, os.getpid()
        self.ctx = zmq.Context()
        self.runtime_dir = runtime_dir
        self.outbox: queue.Queue = queue.Queue()
        self.origins: dict[str, int] = {}  # request id -> pid of the gateway that submitted it
        self.stopping = threading.Event()
        self.early = EarlyIds()  # cancels whose job has not arrived
        self.ended_early = EarlyIds()  # requests that ended before _submit recorded their origin
        self.long_jobs: queue.Queue = queue.Queue()  # jobs whose prompts take long to tokenize
        self.compiles = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")  # jobs whose grammar is new
        self._known = threading.Lock()  # orders a job's arrival against its cancel
        token_bytes = max_token_bytes(lm.tokenizer)
        # tokens >= bytes / token_bytes; twice that leaves room for normalizers that shrink text
        self.max_prompt_bytes = 2 * token_bytes * engine.context_limit if token_bytes else None

    def _socket(self, kind: int, name: str, bind: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 1000)
        addr = runtime.endpoint(self.runtime_dir, name)
        sock.bind(addr) if bind else sock.connect(addr)
        return sock

    def ready_message(self) -> m.Ready:
        return m.Ready(
            process="worker", pid=self.pid, model_id=self.lm.model_id,
            cache_identity=cache_identity(self.lm, self.engine.draft_id, self.engine.config.kv), context_limit=self.engine.context_limit,
            joint_available=self.draft is not None, draft_id=self.engine.draft_id,
            defaults=self.engine.config.defaults, max_active=self.engine.config.max_active,
            thinks=self.engine.think is not None, max_thinking_tokens=self.engine.config.max_thinking_tokens,
            kv_format=self.engine.config.kv.name,
        )

    def run(self) -> int:
        threads = [
            threading.Thread(target=self._jobs_loop, name="jobs", daemon=True),
            threading.Thread(target=self._long_jobs_loop, name="long-jobs", daemon=True),
            threading.Thread(target=self._control_loop, name="control", daemon=True),
            threading.Thread(target=self._events_loop, name="events", daemon=True),
            threading.Thread(target=self._stats_loop, name="stats", daemon=True),
        ]
        for t in threads:
            t.start()
        sup = self._socket(zmq.PUSH, runtime.SUPERVISOR)
        sup.send(codec.encode(self.ready_message()))
        sup.close()
        log.info("worker %d ready: %s", self.pid, self.lm.model_id)
        try:
            self._engine_loop()
        finally:
            self.engine.scheduler.flush_log()
            self.stopping.set()
            for t in threads:
                t.join(timeout=2)
            self.compiles.shutdown(wait=False, cancel_futures=True)
            if self.engine.reuse:
                self.engine.reuse.close()
            self.ctx.term()
        return 0

    def _engine_loop(self) -> None:
        while not self.stopping.is_set():
            if not self.engine.wait_for_work(IDLE_WAIT_S):
                if self.engine.reuse:
                    self.engine.reuse.heartbeat()
                self.residency.tick()
                continue
            if self.engine.has_requests():  # a cancel alone needs no weights
                self.residency.ensure_loaded()
            events = self.engine.step()
            if events:
                self.outbox.put(m.EventBatch(self.pid, events))
                self._forget([ev.request_id for ev in events if isinstance(ev, (m.Finished, m.Error))])
            faults.after_step()

    def _forget(self, ended: list[str]) -> None:
        """Ended requests leave `origins`; one whose job is still being recorded is remembered, so
        _submit does not record an origin nothing would remove."""
        with self._known:
            for rid in ended:
                if self.origins.pop(rid, None) is None:
                    self.ended_early.remember(rid)

    def _received(self, name: str, dec: codec.Decoder, what: str) -> Iterator:
        """The messages that arrive on a PULL socket until the worker stops; undecodable ones are
        logged and dropped."""
        sock = self._socket(zmq.PULL, name)
        while not self.stopping.is_set():
            if not sock.poll(POLL_MS):
                continue
            try:
                msg = dec.decode(sock.recv())
            except codec.DecodeError as e:
                log.error("dropped an undecodable %s: %s", what, e)
                continue
            yield msg
        sock.close()

    def _jobs_loop(self) -> None:
        for job in self._received(runtime.JOBS, codec.job_decoder(), "job"):
            faults.on_job()
            if isinstance(job, m.TokenizeJob) or prompt_bytes(job.request) > LONG_PROMPT_BYTES:
                self.long_jobs.put(job)
            elif not self.engine.grammars.ready(job.request):  # compiled on the pool, then queued
                self.compiles.submit(self._submit_compiled, job)
            else:
                self._submit(job)

    def _send(self, event) -> None:
        self.outbox.put(m.EventBatch(self.pid, [event]))

    def _submit_compiled(self, job: m.SubmitRequest) -> None:
        """A job whose grammar compiles first (on a pool thread): its verdict once compiled."""
        t0 = time.perf_counter()
        try:
            self._submit(job)
            log.info("[%s] grammar compiled for it in %.2fs on a pool thread", job.request_id, time.perf_counter() - t0)
        except Exception as e:  # a failure here must still answer the job, or it waits forever
            log.exception("[%s] grammar compile failed", job.request_id)
            self._send(m.Error(job.request_id, "generation_failed", f"the grammar failed to compile: {e}", 500))

    def _long_jobs_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                job = self.long_jobs.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            if isinstance(job, m.TokenizeJob):
                self._send(self._tokenize(job))
            else:
                self._submit(job)

    def _tokenize(self, job: m.TokenizeJob):
        """/tokenize and /detokenize: the Tokens, or an Error naming what the model cannot take."""
        try:
            return tokenize(self.lm.tokenizer, job, self.engine.vocab_size)
        except PromptInvalid as e:
            return m.Error(job.request_id, "invalid_token_id", str(e), 400, "tokens")
        except Exception as e:  # a template may raise on odd conversations
            return m.Error(job.request_id, "invalid_prompt", f"the prompt could not be rendered: {e}", 400, "messages")

    def _submit(self, job: m.SubmitRequest) -> None:
        """Sends the job's first event: Queued, an Error, or Finished "cancelled" when its cancel came
        first. Queued goes out as the engine takes the job, so none of the job's events overtakes it."""
        rid = job.request_id
        with self._known:
            if self.early.take(rid):
                log.info("[%s] cancelled before its job arrived", rid)
                return self._send(m.Finished(rid, "cancelled", m.RequestMetrics(mode=job.request.mode)))
        try:
            self._check_length(job.request)
            faults.before_submit(prompt_bytes(job.request) > LONG_PROMPT_BYTES)
            queued = self.engine.queue(rid, job.request, announce=self._send)
            faults.after_queue()
        except RequestError as e:
            log.info("[%s] refused: %s", rid, e.code)
            return self._send(m.Error(rid, e.code, e.message, e.status, e.param))
        with self._known:
            if not self.ended_early.take(rid):
                self.origins[rid] = job.gateway_pid
            if self.early.take(rid):  # it came while the prompt was tokenized
                log.info("[%s] cancel (it came while the job was tokenized)", rid)
                self.engine.cancel(rid)
        log.info("[%s] queued: %d prompt tokens%s", rid, queued.prompt_tokens, ", thinking" if queued.thinking else "")

    def _check_length(self, req: m.GenerateRequest) -> None:
        """Refuses, without tokenizing, a prompt too long for the context at any tokenization."""
        size = prompt_bytes(req)
        if req.messages is not None and self.engine.context.policy(req) == "truncate-middle":
            return  # its middle messages may be dropped (the body's size bounds it)
        if self.max_prompt_bytes and size > self.max_prompt_bytes:
            raise RequestError(
                "context_length_exceeded",
                f"the prompt has {size} bytes of text, more than this server's context of {self.engine.context_limit} "
                f"tokens can hold", param="messages" if req.messages is not None else "prompt")

    def _control_loop(self) -> None:
        for msg in self._received(runtime.CONTROL, codec.control_decoder(), "control message"):
            if isinstance(msg, m.DropOrphans):
                orphans = [(rid, gateway) for rid, gateway in list(self.origins.items()) if gateway != msg.gateway_pid]
                for rid, gateway in orphans:
                    log.info("[%s] cancel: its gateway (pid %d) is gone", rid, gateway)
                    self.engine.cancel(rid)
                log.info("gateway %d took over: %d requests of gone gateways cancelled", msg.gateway_pid, len(orphans))
                continue
            with self._known:
                if msg.request_id not in self.origins:  # its job has not arrived (or it ended)
                    self.early.remember(msg.request_id)
            log.info("[%s] cancel", msg.request_id)
            self.engine.cancel(msg.request_id)

    def _events_loop(self) -> None:
        sock = self._socket(zmq.PUSH, runtime.EVENTS)
        while not (self.stopping.is_set() and self.outbox.empty()):
            try:
                batch = self.outbox.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            sock.send(codec.encode(batch))
        sock.close()

    def _stats_loop(self) -> None:
        sock = self._socket(zmq.PUB, runtime.WORKER_STATS, bind=True)
        while not self.stopping.wait(STATS_INTERVAL_S):
            snap = msgspec.structs.replace(self.engine.stats(self.pid), **self.residency.fields())
            sock.send(codec.encode(snap))
        sock.close()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verity-worker")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--max-active", type=int, default=None, help="default: per device (worker/memory.py)")
    p.add_argument("--kv-budget", type=int, default=None)
    p.add_argument("--prefill-step", type=int, default=None)
    p.add_argument("--queue-size", type=int, default=64)
    p.add_argument("--draft", default=None)
    p.add_argument("--draft-budget", type=int, default=None)
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float), ("max-tokens", int)):
        p.add_argument(f"--{name}", type=kind, default=None, help="the default for requests that omit it")
    p.add_argument("--max-thinking-tokens", type=int, default=None, help="close a think block after this many tokens")
    p.add_argument("--decision-log", default=None)
    p.add_argument("--recovery", choices=("fast", "replay"), default="fast")
    p.add_argument("--prefix-cache", action="store_true", help="reuse prefixes through the cache service")
    p.add_argument("--cache-dir", default=None, help="spill snapshots here (survive a worker restart)")
    p.add_argument("--idle-unload-s", type=float, default=None, help="free the model after this long idle")
    p.add_argument("--adapter-path", default=None, help="a LoRA adapter (mlx-lm's format) on the model")
    p.add_argument("--max-context", type=int, default=None, help="tokens a request may fill (default: the model's)")
    p.add_argument("--context-overflow", choices=get_args(m.ContextOverflow), default="refuse")
    p.add_argument("--kv-bits", type=int, default=None, help="quantize the attention KV to these bits (4 or 8)")
    p.add_argument("--kv-group-size", type=int, default=None, help="values sharing a scale and bias (default 64)")
    return p.parse_args(argv)


def run_worker(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    runtime.watch_parent(lambda: os._exit(1))
    try:
        lm = _load_with_progress(args.model, lambda: load_model(args.model, adapter_path=args.adapter_path))
    except AdapterError as e:
        log.error("%s", e)
        return 3
    draft = None
    if args.draft:
        try:
            draft = _load_with_progress(args.draft, lambda: load_draft(args.draft, lm))
        except PairingError as e:
            log.error("cannot pair draft %s with %s: %s", args.draft, lm.model_id, e)
            return 3
    try:
        engine = build_engine(args, lm, draft)
    except ValueError as e:  # a KV format the flags or the model refuse
        log.error("%s", e)
        return 3
    problem = context_problem(args, lm.context_limit, engine)
    if problem:
        log.error("%s", problem)
        return 3
    engine.warmup()
    calibrated = engine.calibrate_threads()  # after the warm-up: the stack's other processes are up by then
    if calibrated:
        log.info("BLAS threads by decode rows: %s (plain round ms by rows, threads: %s)", calibrated.chosen,
                 {k: round(v * 1000, 1) for k, v in calibrated.seconds.items()})
    if args.prefix_cache:
        engine.reuse = _prefix_cache(args, lm, draft, engine.draft_id)
    proc = WorkerProc(engine, lm, args.runtime_dir, Residency(engine, lambda: _reload(args), args.idle_unload_s))
    signal.signal(signal.SIGTERM, lambda *_: proc.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: proc.stopping.set())
    return proc.run()


def engine_config(args: argparse.Namespace, log_decisions: bool = True) -> EngineConfig:
    """The engine's configuration from the worker's flags (request defaults included), the same
    for the worker and for every rank of a distributed group; `log_decisions`: this process
    writes --decision-log (a group's rank 0 alone)."""
    max_active = args.max_active or memory.default_max_active()
    return EngineConfig(max_active=max_active, max_waiting=args.queue_size + max_active,
                        draft_budget=args.draft_budget, recovery=args.recovery,
                        decision_log=args.decision_log if log_decisions else None, kv_budget=args.kv_budget,
                        prefill_step=args.prefill_step or memory.default_prefill_step(),
                        max_context=args.max_context, context_overflow=args.context_overflow,
                        defaults=sampling_defaults(args), max_thinking_tokens=args.max_thinking_tokens,
                        kv=kv_format(args.kv_bits, args.kv_group_size))


def build_engine(args: argparse.Namespace, lm: LoadedModel, draft: Optional[LoadedModel],
                 make: Callable[[LoadedModel, EngineConfig, Optional[LoadedModel]], Engine] = Engine,
                 log_decisions: bool = True) -> Engine:
    """The one engine builder of the worker and of every rank: `make` is the engine's kind
    (a rank's leader or follower, bound to its link). ValueError: a KV format the model refuses."""
    config = engine_config(args, log_decisions)
    problem = format_problem(config.kv, attention_shapes(lm.model))
    if problem:
        raise ValueError(problem)
    if cap := memory.bound_buffer_cache():
        log.info("MLX's buffer cache capped at %.1f GiB", cap / (1 << 30))
    return make(lm, config, draft)


def sampling_defaults(args: argparse.Namespace) -> m.SamplingDefaults:
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return resolve_defaults(args.model, flags, args.max_tokens)


def _prefix_cache(args: argparse.Namespace, lm: LoadedModel, draft: Optional[LoadedModel],
                  draft_id: Optional[str]) -> Optional[PrefixCache]:
    if not all(PrefixCache.supports(x.model) for x in (lm, draft) if x is not None):
        log.warning("this model's cache cannot be snapshotted: serving without prefix reuse")
        return None
    identity = cache_identity(lm, draft_id, kv_format(args.kv_bits, args.kv_group_size))
    return PrefixCache.connect(runtime.endpoint(args.runtime_dir, runtime.CACHE), identity, lm,
                               draft.model if draft else None, args.cache_dir)


def context_problem(args: argparse.Namespace, model_limit: int, engine: Engine) -> Optional[str]:
    """What the context flags ask that this model cannot give."""
    if args.max_context is not None and not 2 <= args.max_context <= model_limit:
        return f"--max-context {args.max_context} is outside [2, {model_limit}] (this model's own limit)"
    return engine.context.rolling_refused if args.context_overflow == "rolling" else None


def _reload(args: argparse.Namespace) -> tuple[LoadedModel, Optional[LoadedModel]]:
    """The target and draft read again (idle unload's reload)."""
    lm = load_model(args.model, adapter_path=args.adapter_path)
    return lm, load_draft(args.draft, lm) if args.draft else None


def _load_with_progress(spec: str, load=None) -> LoadedModel:
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status(f"[bold]worker: loading {spec}…"):
        lm = (load or (lambda: load_model(spec)))()
    console.print(f"worker: loaded {lm.model_id} ({lm.quantization}) in {time.perf_counter() - t0:.1f}s; warming up")
    return lm
