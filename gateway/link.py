"""WorkerLink: the gateway's side of the worker sockets, admission and the admitted requests.

Every admitted request is held here until it ends. Requests the worker had not started when
it died are resubmitted to the next worker; started ones end with an error event. A request
ended by the time limit gives its admission slot back at once (the worker is told to stop it).
The worker's stats, every 0.5 s, are its heartbeat: `silent_s` is how long it has been quiet.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq
import zmq.asyncio

from protocol import codec, messages as m, runtime

DEFAULT_MAX_ACTIVE = 16  # until a worker's READY says its own

log = logging.getLogger("verity.gateway")


class QueueFull(Exception):
    pass


@dataclass
class Tracked:
    id: str
    submit: m.SubmitRequest
    seq: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent_to: Optional[int] = None  # worker pid the job went to
    started: bool = False
    cancel_requested: bool = False
    held: bool = False  # admitted, but sent to the worker only when released (a request's rows beyond its share)
    admitted_at: float = field(default_factory=time.monotonic)


class WorkerLink:
    def __init__(self, runtime_dir: str, max_active: Optional[int], queue_size: int):
        """`max_active` None: the worker's, from its READY (DEFAULT_MAX_ACTIVE until then)."""
        self.runtime_dir = runtime_dir
        self.queue_size = queue_size
        self.configured_max_active = max_active
        self.worker_max_active = DEFAULT_MAX_ACTIVE  # the last READY's
        self.pid = os.getpid()
        self.ctx = zmq.asyncio.Context()
        self.requests: dict[str, Tracked] = {}
        self.worker: Optional[m.Ready] = None
        self.worker_stats: Optional[m.StatsSnapshot] = None
        self.heard_at = time.monotonic()  # the ready worker's last heartbeat (stats or READY)
        self.worker_restarts = 0
        self.on_end: list[Callable[[Tracked, object], None]] = []  # observers of each request's last event
        self.calls: dict[str, asyncio.Future] = {}  # /tokenize jobs waiting for their one answer
        self._seq = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._handlers = {
            m.EventBatch: self._on_events,
            m.Ready: self._on_ready,
            m.WorkerDown: self._on_worker_down,
        }

    # ---- sockets ----

    def start(self) -> None:
        ep = lambda name: runtime.endpoint(self.runtime_dir, name)  # noqa: E731
        self.jobs = self.ctx.socket(zmq.PUSH)
        self.jobs.bind(ep(runtime.JOBS))
        self.control = self.ctx.socket(zmq.PUSH)
        self.control.bind(ep(runtime.CONTROL))
        events = self.ctx.socket(zmq.PULL)
        events.bind(ep(runtime.EVENTS))
        sup = self.ctx.socket(zmq.PULL)
        sup.bind(ep(runtime.GATEWAY_CONTROL))
        stats = self.ctx.socket(zmq.SUB)
        stats.setsockopt(zmq.SUBSCRIBE, b"")
        stats.connect(ep(runtime.WORKER_STATS))
        for s in (self.jobs, self.control, events, sup, stats):
            s.setsockopt(zmq.LINGER, 0)
        self._tasks = [
            asyncio.create_task(self._recv_loop(events, codec.worker_out_decoder())),
            asyncio.create_task(self._recv_loop(sup, codec.supervisor_decoder())),
            asyncio.create_task(self._stats_loop(stats)),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)

    async def _recv_loop(self, sock: zmq.asyncio.Socket, dec: codec.Decoder) -> None:
        while True:
            data = await sock.recv()
            try:
                msg = dec.decode(data)
            except codec.DecodeError as e:
                log.error("dropped an undecodable message: %s", e)
                continue
            self._handlers[type(msg)](msg)

    async def _stats_loop(self, sock: zmq.asyncio.Socket) -> None:
        dec = codec.stats_decoder()
        while True:
            try:
                self.worker_stats = dec.decode(await sock.recv())
                if self.worker is not None and self.worker_stats.pid == self.worker.pid:
                    self.heard_at = time.monotonic()
            except codec.DecodeError as e:
                log.error("dropped undecodable stats: %s", e)

    # ---- admission ----

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def silent_s(self) -> float:
        """Seconds since the ready worker's last heartbeat (0 without a worker)."""
        return time.monotonic() - self.heard_at if self.worker is not None else 0.0

    def admit(self, request_id: str, req: m.GenerateRequest, hold: bool = False) -> Tracked:
        """Admits a request (QueueFull past capacity); `hold`: keeps it here until `release`."""
        if len(self.requests) >= self.capacity:
            raise QueueFull()
        t = Tracked(request_id, m.SubmitRequest(request_id, req, gateway_pid=self.pid), next(self._seq), held=hold)
        self.requests[request_id] = t
        if self.ready and not hold:
            self._send(t)
        return t

    def release(self, t: Tracked) -> None:
        """Sends a held request to the worker (or to the next one, when none is ready)."""
        if not t.held or t.id not in self.requests:
            return
        t.held = False
        if self.ready:
            self._send(t)

    def cancel(self, request_id: str, reason: str = "the request was cancelled",
               release: Optional[m.Error] = None) -> None:
        """Asks the worker to stop; the request stays tracked until the worker confirms, or with
        `release` ends now with that error (its slot is free even while the worker is stuck)."""
        t = self.requests.get(request_id)
        if t is None or t.cancel_requested:
            return
        t.cancel_requested = True
        if t.sent_to is not None and self.worker and t.sent_to == self.worker.pid:
            self.control.send(codec.encode(m.CancelRequest(request_id)))
            if release is not None:
                self._end(t, release)
        else:  # never reached a live worker: nothing to stop there
            self._end(t, release or m.Error(request_id, "cancelled", reason, 503))

    async def call(self, job: m.TokenizeJob, within_s: float):
        """A job that is not a generation (no admission, no slot): the worker's one answer, or a
        503 Error when none comes within `within_s` or the worker dies first."""
        fut = asyncio.get_running_loop().create_future()
        self.calls[job.request_id] = fut
        self.jobs.send(codec.encode(job))
        try:
            async with asyncio.timeout(within_s):
                return await fut
        except TimeoutError:
            return m.Error(job.request_id, "worker_unavailable", f"the worker did not answer within {within_s:g} s", 503)
        finally:
            self.calls.pop(job.request_id, None)

    def end_all(self, code: str, message: str, status: int = 503) -> None:
        """Ends every admitted request here with an error (the worker can no longer end them)."""
        for t in list(self.requests.values()):
            self._end(t, m.Error(t.id, code, message, status))

    def waiting_count(self) -> int:
        return sum(1 for t in self.requests.values() if not t.started)

    def _send(self, t: Tracked) -> None:
        t.sent_to = self.worker.pid
        self.jobs.send(codec.encode(t.submit))

    def _end(self, t: Tracked, event) -> None:
        self.requests.pop(t.id, None)
        t.events.put_nowait(event)
        for observe in self.on_end:
            observe(t, event)

    # ---- handlers, by message type ----

    def _on_events(self, batch: m.EventBatch) -> None:
        if self.worker is None or batch.worker_pid != self.worker.pid:
            return  # late events of a worker that is gone
        for ev in batch.events:
            call = self.calls.get(ev.request_id)
            if call is not None and not call.done():
                call.set_result(ev)
            t = self.requests.get(ev.request_id)
            if t is None:
                continue
            if isinstance(ev, m.Started):
                t.started = True
            if isinstance(ev, (m.Finished, m.Error)):
                self._end(t, ev)
            else:
                t.events.put_nowait(ev)

    @property
    def max_active(self) -> int:
        if self.configured_max_active is not None:
            return self.configured_max_active
        return self.worker_max_active

    @property
    def capacity(self) -> int:
        """Requests held at once (decoding and waiting); past it, 429."""
        return self.max_active + self.queue_size

    def _on_ready(self, ready: m.Ready) -> None:
        if ready.protocol_version != m.PROTOCOL_VERSION:
            log.error("worker speaks protocol %d, gateway %d", ready.protocol_version, m.PROTOCOL_VERSION)
            return
        self.worker = ready
        self.worker_max_active = ready.max_active or self.worker_max_active
        self.heard_at = time.monotonic()
        log.info("worker %d ready (%s); resubmitting %d waiting", ready.pid, ready.model_id, self.waiting_count())
        # a worker that outlived a previous gateway still runs that gateway's requests: drop them
        self.control.send(codec.encode(m.DropOrphans(self.pid)))
        for t in sorted(self.requests.values(), key=lambda t: t.seq):
            if t.cancel_requested and not t.started:
                self._end(t, m.Error(t.id, "cancelled", "the request was cancelled", 503))
            elif not t.started and not t.held:
                self._send(t)

    def _on_worker_down(self, down: m.WorkerDown) -> None:
        if self.worker is not None and down.pid != self.worker.pid:
            return
        self.worker = None
        self.worker_stats = None
        self.worker_restarts += 1
        log.warning("worker %d exited with %d", down.pid, down.exit_code)
        for call in self.calls.values():
            if not call.done():
                call.set_result(m.Error("", "worker_died", f"the worker process died (exit code {down.exit_code})", 503))
        for t in list(self.requests.values()):
            if t.started:
                self._end(t, m.Error(t.id, "worker_died", f"the worker process died (exit code {down.exit_code}) while generating this response", 503))
            else:
                t.sent_to = None  # resubmitted when the next worker is ready
