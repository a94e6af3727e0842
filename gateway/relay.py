"""What every API route of the gateway shares: its state and configuration, refusals, the
worker's events as they come, the time limit, and cutting a client that stopped reading."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from gateway.guard import Guard
from gateway.link import Tracked, WorkerLink
from gateway.openai_format import error_body
from gateway.sse import STALL_BYTES, ClientStalled, SseWriter
from protocol import messages as m
from protocol.tool_rules import needs_grammar

log = logging.getLogger("verity.gateway")
FIRST_EVENT_TIMEOUT_S = 2.0  # wait this long for the worker's verdict before streaming headers
# a request with a grammar the worker has not compiled gets its verdict once compiled (worker/grammar.py
# LIMITS bound that work; a pool may hold a few ahead of it): its 400 comes before any header
GRAMMAR_VERDICT_S = 30.0
RETRY_AFTER_S = 1
WRITE_GRACE_S = 1.0  # after the time limit, how long the error event may take to reach the client
STALLED_WRITE_BYTES = 1 << 16  # unsent bytes queued past this (asyncio's pause mark): the client reads nothing


@dataclass
class GatewayConfig:
    runtime_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_active: Optional[int] = None  # None: the worker's (its READY says)
    queue_size: int = 16
    api_key: Optional[str] = None
    max_tokens_cap: int = 2048
    max_body_bytes: int = 1 << 20
    keepalive_s: float = 5.0
    stall_s: float = 10.0  # a stream whose client reads nothing this long is cut (gateway/sse.py)
    stall_bytes: int = STALL_BYTES  # or that leaves this many bytes unread
    drain_timeout_s: float = 30.0
    request_timeout_s: Optional[float] = 600.0  # admission to the last byte; None or 0: no limit
    allow_hosts: tuple[str, ...] = ()  # names the Host header may carry besides the loopback ones
    allow_origins: tuple[str, ...] = ()  # browser origins other than the server's own ("*": any)
    log_prompts: bool = False  # prompt text goes to the log only when asked for
    served_names: tuple[str, ...] = ()  # --served-model-name: aliases a request's `model` may use
    heartbeat_timeout_s: float = 10.0  # a worker silent this long makes /health 503
    responses_max_count: int = 1000  # stored /v1/responses kept (gateway/response_store.py)
    responses_max_bytes: int = 256 << 20


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.link = WorkerLink(config.runtime_dir, config.max_active, config.queue_size)
        self.draining = False
        self.started_at = time.time()
        self.guard = Guard(config.host, config.port, config.allow_hosts, config.allow_origins)
        self.link.on_end.append(_log_end)


def _log_end(t: Tracked, event) -> None:
    """One line per admitted request's end, with its id (the worker's lines carry the same id)."""
    took = time.monotonic() - t.admitted_at
    if isinstance(event, m.Finished):
        log.info("[%s] finished: %s, %d tokens, %.2fs", t.id, event.finish_reason,
                 event.metrics.completion_tokens, took)
    else:
        log.info("[%s] ended with an error: %s, %.2fs", t.id, getattr(event, "code", "?"), took)


GATEWAY = web.AppKey("gateway", Gateway)


def json_error(status: int, message: str, code: str, param: Optional[str] = None, headers=None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status, headers=headers)


def refuse(rid: str, status: int, message: str, code: str, param: Optional[str] = None,
            retry: bool = False) -> web.Response:
    headers = {"X-Request-Id": rid, **({"Retry-After": str(RETRY_AFTER_S)} if retry else {})}
    return json_error(status, message, code, param, headers=headers)


def served_names(gw: Gateway) -> tuple[str, ...]:
    """The model's id and its --served-model-name aliases (a request may name any)."""
    return (gw.link.worker.model_id, *gw.config.served_names) if gw.link.worker else ()


def time_limit_message(limit: float) -> str:
    return f"the request did not end within this server's time limit of {limit:g} s (--request-timeout-s)"


def time_limit_reached(gw: Gateway, t: Tracked) -> None:
    log.warning("[%s] reached the time limit of %gs: cancelling", t.id, gw.config.request_timeout_s)
    message = time_limit_message(gw.config.request_timeout_s)  # its slot is freed now, not when the worker confirms
    gw.link.cancel(t.id, reason=message, release=m.Error(t.id, "request_timeout", message, 504))


async def next_event(t: Tracked, within_s: float):
    """The request's next event, or None after within_s. asyncio.timeout, not wait_for: under an
    outer time limit, Python 3.11's wait_for can swallow that limit's cancellation when the event
    arrives at the same moment, and a stream then ran to its end (2,000 tokens) past the limit."""
    try:
        async with asyncio.timeout(within_s):
            return await t.events.get()
    except TimeoutError:
        return None


async def first_event(t: Tracked, req: m.GenerateRequest):
    """The worker's verdict (Queued or an Error), or None when it is slow to come."""
    return await next_event(t, GRAMMAR_VERDICT_S if needs_grammar(req) else FIRST_EVENT_TIMEOUT_S)


async def end_at_time_limit(request: web.Request, gw: Gateway, t: Tracked, out: SseWriter, ended: bool,
                            tail: bytes) -> None:
    """A stream past the time limit: its request cancelled (unless `ended`), then `tail` (the error
    event, the end marker) written within WRITE_GRACE_S, or else the connection dropped."""
    if not ended:
        time_limit_reached(gw, t)
    transport = request.transport
    if transport is not None and transport.get_write_buffer_size() < STALLED_WRITE_BYTES:
        try:
            async with asyncio.timeout(WRITE_GRACE_S):
                await out.resp.write(tail)
                await out.resp.write_eof()
                return
        except TimeoutError:
            pass
    # the client reads nothing (its unread bytes fill the buffers): drop its connection
    log.warning("[%s] the client does not read its stream: closing the connection", t.id)
    out.drop()


def cut(gw: Gateway, rid: str, running: list[Tracked], out: SseWriter, why: ClientStalled) -> None:
    """A client that stopped reading: its requests end now (their slots and rows freed) and its
    connection is dropped."""
    log.warning("[%s] the client stopped reading its stream (%s): cancelling %d request(s), closing the connection",
                rid, why, len(running))
    message = f"the client stopped reading its stream: {why}"
    for t in running:
        gw.link.cancel(t.id, reason=message, release=m.Error(t.id, "client_stalled", message, 408))
    out.drop()
