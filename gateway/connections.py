"""Connection limits of the gateway: how many, for how long, and bodies read with a bound.

Idle connections must not take the API down (each holds a descriptor; past the open-file limit
nothing is accepted, /health included):

- A connection is closed when it has not sent a whole request's headers within
  `header_timeout_s` of opening (or of its last response): aiohttp's keep-alive timer, which
  runs from the connection's start.
- At most `max_connections` are open, and never more than the open-file limit less
  RESERVED_FDS (asyncio accepts ACCEPT_BURST at a time before any is counted). Past that, a new
  connection closes the one idle longest (outside a request); when every one is inside a
  request, the new one gets a 503 at once and is closed.
- A request's body must arrive within `body_timeout_s` (408), and a compressed body
  (`Content-Encoding` other than identity) is refused with 415 before a byte is read: aiohttp
  would inflate it whole before the size limit applies.
- asyncio logs a traceback per failed accept (out of descriptors): one line per
  ACCEPT_LOG_EVERY_S instead, with the count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from gateway.openai_format import error_body

log = logging.getLogger("verity.gateway")
RESERVED_FDS = 128  # the gateway's own (~32: sockets to the worker, log, loop), two ACCEPT_BURSTs, a margin
ACCEPT_BURST = 32  # asyncio accepts up to its backlog argument at once, before any is counted
LISTEN_QUEUE = 4096  # the kernel's queue of connections not yet accepted (clamped to somaxconn)
ACCEPT_LOG_EVERY_S = 10.0
_REFUSAL = error_body(503, "this server has too many open connections; retry shortly", "too_many_connections")


@dataclass
class ConnectionLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


def descriptor_cap(limit: int) -> int:
    """Connections that fit the current soft open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft - RESERVED_FDS))


@dataclass
class _Conn:
    transport: asyncio.Transport
    busy: int = 0  # requests inside the app right now
    idle_since: float = field(default_factory=time.monotonic)


class ConnectionBook:
    """The open connections, which are inside a request, and the cap."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.conns: dict[asyncio.BaseTransport, _Conn] = {}
        self.evicted = self.refused = 0

    def opened(self, transport: asyncio.Transport) -> bool:
        """Registers a new connection; False when it must be refused (every other one is busy)."""
        if len(self.conns) >= descriptor_cap(self.limits.max_connections):
            idle = [c for c in self.conns.values() if not c.busy]
            if not idle:
                self.refused += 1
                return False
            oldest = min(idle, key=lambda c: c.idle_since)
            self.conns.pop(oldest.transport, None)
            oldest.transport.abort()
            self.evicted += 1
        self.conns[transport] = _Conn(transport)
        return True

    def closed(self, transport: asyncio.BaseTransport) -> None:
        self.conns.pop(transport, None)

    def enter(self, transport: Optional[asyncio.BaseTransport]) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.busy += 1

    def leave(self, transport: Optional[asyncio.BaseTransport]) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.busy -= 1
            c.idle_since = time.monotonic()

    def protocol(self, make_handler) -> "_Counted":
        return _Counted(make_handler, self)


class _Counted(asyncio.Protocol):
    """aiohttp's request handler, counted in the book; refused past the cap without being made."""

    def __init__(self, make_handler, book: ConnectionBook):
        self.make_handler, self.book = make_handler, book
        self.inner = None
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.book.opened(transport):
            body = json.dumps(_REFUSAL).encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            transport.close()
            return
        self.inner = self.make_handler()
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        self.book.closed(self.transport)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a ConnectionBook."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, book: ConnectionBook):
        super().__init__(runner, backlog=ACCEPT_BURST)
        self.host, self.port, self.book = host, port, book
        self._server: Optional[asyncio.base_events.Server] = None

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: self.book.protocol(self._runner.server), self.host,
                                                self.port, backlog=self._backlog, reuse_address=True)
        for ts in self._server.sockets:  # a long kernel queue, a short accept burst
            with socket.socket(fileno=os.dup(ts.fileno())) as sock:
                sock.listen(LISTEN_QUEUE)

    @property
    def bound_port(self) -> int:
        return self._server.sockets[0].getsockname()[1]


def middlewares(book: ConnectionBook):
    """(outermost, innermost): the first marks a connection busy for the request's whole life;
    the second, after the key check, refuses compressed bodies and reads the body with a bound."""

    @web.middleware
    async def in_request(request: web.Request, handler):
        book.enter(request.transport)
        try:
            return await handler(request)
        finally:
            book.leave(request.transport)

    @web.middleware
    async def bounded_body(request: web.Request, handler):
        if request.method != "POST" or not request.can_read_body:
            return await handler(request)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return web.json_response(error_body(
                415, f"`Content-Encoding: {encoding[:40]}` is not accepted; send the body uncompressed",
                "unsupported_content_encoding", "Content-Encoding"), status=415)
        try:
            async with asyncio.timeout(book.limits.body_timeout_s):
                await request.read()  # kept by aiohttp: the handler's read returns it
        except TimeoutError:
            return web.json_response(error_body(
                408, f"the request body did not arrive within {book.limits.body_timeout_s:g} s", "body_timeout"),
                status=408, headers={"Connection": "close"})
        return await handler(request)

    return in_request, bounded_body


class AcceptErrors:
    """The loop's exception handler: a failed accept (out of descriptors) logs one line per
    ACCEPT_LOG_EVERY_S with the count, not a traceback each time; the rest as asyncio would."""

    def __init__(self):
        self.count = 0
        self.logged_at = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= ACCEPT_LOG_EVERY_S:
            self.logged_at = now
            log.error("cannot accept connections: %s (%d times; open-file limit %d)",
                      context.get("exception"), self.count, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
