"""The HTTP side: OpenAI-compatible routes, errors as OpenAI error objects, SSE streaming."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import msgspec
from aiohttp import web

from gateway import choices as many
from gateway.guard import Guard, Refused, cors_headers
from gateway.link import QueueFull, Tracked, WorkerLink
from gateway.openai_format import Shaper, error_body
from gateway.openapi import describe
from gateway.small import AUTH_PATHS, SmallEndpoints
from gateway.sse import STALL_BYTES, ClientStalled, SseWriter
from gateway.surfaces import Surfaces
from protocol import messages as m
from protocol.schema import RequestInvalid, parse_request, resolve_max_tokens, top_logprobs
from protocol.tool_rules import needs_grammar, tools_offered

log = logging.getLogger("verity.gateway")
FIRST_EVENT_TIMEOUT_S = 2.0  # wait this long for the worker's verdict before streaming headers
# a request with a grammar the worker has not compiled gets its verdict once compiled (worker/grammar.py
# LIMITS bound that work; a pool may hold a few ahead of it): its 400 comes before any header
GRAMMAR_VERDICT_S = 30.0
RETRY_AFTER_S = 1
WRITE_GRACE_S = 1.0  # after the time limit, how long the error event may take to reach the client
STALLED_WRITE_BYTES = 1 << 16  # unsent bytes queued past this (asyncio's pause mark): the client reads nothing
CORS_ORIGIN = "verity.cors_origin"


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


@web.middleware
async def host_and_origin(request: web.Request, handler):
    """DNS-rebinding and cross-site protection (gateway/guard.py), before anything else."""
    gw = request.app[GATEWAY]
    host, origin = request.headers.get("Host"), request.headers.get("Origin")
    try:
        gw.guard.check_host(host)
        cross = gw.guard.check_origin(origin, host)
    except Refused as e:
        log.warning("refused %s %s: %s", request.method, request.path, e.code)
        return json_error(403, e.message, e.code)
    if cross:
        request[CORS_ORIGIN] = origin
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers=cors_headers(origin, preflight=True))
    return await handler(request)


async def _cors_on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    origin = request.get(CORS_ORIGIN)
    if origin and "Access-Control-Allow-Origin" not in response.headers:
        response.headers.update(cors_headers(origin, preflight=False))


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    gw = request.app[GATEWAY]
    key = gw.config.api_key
    if key and (request.path.startswith("/v1/") or request.path in AUTH_PATHS):
        given = request.headers.get("Authorization", "") or request.headers.get("x-api-key", "")  # x-api-key: Anthropic's
        token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        # header bytes that are not UTF-8 arrive surrogate-escaped: compare the bytes as sent
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode()):
            msg = "missing API key" if not given else "invalid API key"
            return json_error(401, f"{msg}: send `Authorization: Bearer <key>` or `x-api-key: <key>`", "invalid_api_key")
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return json_error(413, f"request body exceeds {gw.config.max_body_bytes} bytes", "body_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # 405 must name the methods
        return json_error(e.status, e.reason, e.reason.lower().replace(" ", "_"), headers=allow)


@web.middleware
async def log_refusals(request: web.Request, handler):
    """One log line for every refused request, schema-level 400s too: id, status, code, param."""
    resp = await handler(request)
    if resp.status >= 400 and isinstance(resp, web.Response) and isinstance(resp.body, bytes):
        try:
            err = json.loads(resp.body)["error"]
        except (ValueError, KeyError, TypeError):
            err = {}
        param = f" (param {err['param']})" if err.get("param") else ""
        log.info("[%s] refused %s %s: %d %s%s", resp.headers.get("X-Request-Id", "-"), request.method,
                 request.path, resp.status, err.get("code"), param)
    return resp


def _refuse(rid: str, status: int, message: str, code: str, param: Optional[str] = None,
            retry: bool = False) -> web.Response:
    headers = {"X-Request-Id": rid, **({"Retry-After": str(RETRY_AFTER_S)} if retry else {})}
    return json_error(status, message, code, param, headers=headers)


def served_names(gw: Gateway) -> tuple[str, ...]:
    """The model's id and its --served-model-name aliases (a request may name any)."""
    return (gw.link.worker.model_id, *gw.config.served_names) if gw.link.worker else ()


async def generate(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    chat = request.path.endswith("/chat/completions")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if gw.draining:
        return _refuse(rid, 503, "the server is shutting down", "shutting_down")
    try:
        req = parse_request(await request.read(), "chat" if chat else "completion")
        resolve_max_tokens(req, gw.config.max_tokens_cap, gw.link.worker.defaults.max_tokens if gw.link.worker else None)
        choices = many.expand(req, chat)
    except RequestInvalid as e:
        return _refuse(rid, 400, e.message, e.code, e.param)
    if not gw.link.ready:
        return _refuse(rid, 503, "the worker is not ready; retry shortly", "worker_unavailable", retry=True)
    names = served_names(gw)
    if req.model is not None and req.model not in names:
        return _refuse(rid, 404, f"model `{req.model}` does not exist; this server serves {', '.join(f'`{n}`' for n in names)}",
                       "model_not_found", "model")
    served = req.model or names[0]  # the name the client sent, as OpenAI clients expect
    if gw.config.log_prompts:  # asked for with --log-prompts; JSON keeps it on one line
        log.info("[%s] prompt: %s", rid, msgspec.json.encode(req.messages if chat else req.prompt).decode())
    if len(choices) > gw.link.capacity:
        return _refuse(rid, 400, f"{len(choices)} choices (prompts × n) are more than this server admits at once "
                       f"({gw.link.capacity}: --max-active + --queue-size)", "too_many_choices", "n")
    if len(choices) > 1:
        return await _choices(request, gw, rid, req, choices, chat, served)
    try:
        t = gw.link.admit(rid, choices[0].request)
    except QueueFull:
        return _refuse(rid, 429, "too many requests are running or waiting; retry later", "queue_full", retry=True)
    log.info("[%s] admitted (%s, stream=%s)", rid, req.mode, req.stream)
    shaper = Shaper(rid, served, chat, tool_calls=chat and tools_offered(req),
                    logprobs=top_logprobs(req) is not None, thinks=bool(gw.link.worker and gw.link.worker.thinks))
    limit = gw.config.request_timeout_s or None
    deadline = asyncio.get_running_loop().time() + limit if limit else None
    try:
        try:
            async with asyncio.timeout_at(deadline):
                first = await _first_event(t, req)
                if isinstance(first, m.Error):
                    return _refuse(rid, first.status, first.message, first.code, first.param)
                if not req.stream:
                    return await _whole(t, shaper, first)
        except TimeoutError:
            _time_limit_reached(gw, t)
            return json_error(504, _time_limit_message(limit), "request_timeout")
        return await _stream(request, gw, t, shaper, first, deadline)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("[%s] client went away: cancelling", rid)
        gw.link.cancel(rid)
        raise


def _time_limit_message(limit: float) -> str:
    return f"the request did not end within this server's time limit of {limit:g} s (--request-timeout-s)"


def _time_limit_reached(gw: Gateway, t: Tracked) -> None:
    log.warning("[%s] reached the time limit of %gs: cancelling", t.id, gw.config.request_timeout_s)
    message = _time_limit_message(gw.config.request_timeout_s)  # its slot is freed now, not when the worker confirms
    gw.link.cancel(t.id, reason=message, release=m.Error(t.id, "request_timeout", message, 504))


async def _next_event(t: Tracked, within_s: float):
    """The request's next event, or None after within_s. asyncio.timeout, not wait_for: under an
    outer time limit, Python 3.11's wait_for can swallow that limit's cancellation when the event
    arrives at the same moment, and a stream then ran to its end (2,000 tokens) past the limit."""
    try:
        async with asyncio.timeout(within_s):
            return await t.events.get()
    except TimeoutError:
        return None


async def _first_event(t: Tracked, req: m.GenerateRequest):
    """The worker's verdict (Queued or an Error), or None when it is slow to come."""
    return await _next_event(t, GRAMMAR_VERDICT_S if needs_grammar(req) else FIRST_EVENT_TIMEOUT_S)


async def _whole(t: Tracked, shaper: Shaper, first) -> web.Response:
    parts: list[str] = []
    logprobs: list[m.TokenLogprob] = []
    ev = first if first is not None else await t.events.get()
    while True:
        if isinstance(ev, m.TextDelta):
            parts.append(ev.text)
            logprobs.extend(ev.logprobs or [])
        elif isinstance(ev, m.Queued):
            shaper.queued(ev)
        elif isinstance(ev, m.Finished):
            return web.json_response(shaper.whole("".join(parts), ev, logprobs), headers={"X-Request-Id": t.id})
        elif isinstance(ev, m.Error):
            return json_error(ev.status, ev.message, ev.code, ev.param)
        ev = await t.events.get()


async def _stream(request: web.Request, gw: Gateway, t: Tracked, shaper: Shaper, first,
                  deadline: Optional[float]) -> web.StreamResponse:
    """The SSE stream. A client that stops reading is cut (gateway/sse.py). At the time limit the
    request is cancelled and the stream ends with an error event and [DONE]; when even that cannot
    be written within WRITE_GRACE_S, the connection is dropped. No write waits unbounded."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": t.id})
    await resp.prepare(request)
    out = SseWriter(request, resp, gw.config.stall_s, gw.config.stall_bytes)
    include_usage = bool(t.submit.request.stream_options and t.submit.request.stream_options.include_usage)
    ended = False  # the request's last event was taken (nothing left to cancel)
    try:
        async with asyncio.timeout_at(deadline):
            if shaper.chat:
                await out.event(shaper.chunk(role=True, text=""))
            ev = first
            while True:
                if ev is None:
                    ev = await _next_event(t, gw.config.keepalive_s)
                    if ev is None:
                        await out.keepalive()
                        continue
                if isinstance(ev, m.Queued):
                    shaper.queued(ev)
                elif isinstance(ev, m.TextDelta) and (chunk := shaper.delta(ev)) is not None:
                    await out.event(chunk)
                elif isinstance(ev, (m.Finished, m.Error)):
                    ended = True
                    for obj in _last_events(shaper, ev, include_usage):
                        await out.event(obj)
                    break
                ev = None
            await out.done()
            return resp
    except ClientStalled as e:
        _cut(gw, t.id, [] if ended else [t], out, e)
        return resp
    except TimeoutError:
        pass
    error = error_body(504, _time_limit_message(gw.config.request_timeout_s), "request_timeout")
    tail = b"" if ended else b"data: " + json.dumps(error).encode() + b"\n\n"
    await end_at_time_limit(request, gw, t, out, ended, tail + b"data: [DONE]\n\n")
    return resp


async def end_at_time_limit(request: web.Request, gw: Gateway, t: Tracked, out: SseWriter, ended: bool,
                            tail: bytes) -> None:
    """A stream past the time limit: its request cancelled (unless `ended`), then `tail` (the error
    event, the end marker) written within WRITE_GRACE_S, or else the connection dropped."""
    if not ended:
        _time_limit_reached(gw, t)
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


def _last_events(shaper: Shaper, ev, include_usage: bool) -> list[dict]:
    """A stream's end: the finish chunk (and usage), or the error event."""
    if isinstance(ev, m.Error):
        return [error_body(ev.status, ev.message, ev.code, ev.param)]
    return [shaper.chunk(finished=ev)] + ([shaper.usage_chunk(ev)] if include_usage else [])


def _cut(gw: Gateway, rid: str, running: list[Tracked], out: SseWriter, why: ClientStalled) -> None:
    """A client that stopped reading: its requests end now (their slots and rows freed) and its
    connection is dropped."""
    log.warning("[%s] the client stopped reading its stream (%s): cancelling %d request(s), closing the connection",
                rid, why, len(running))
    message = f"the client stopped reading its stream: {why}"
    for t in running:
        gw.link.cancel(t.id, reason=message, release=m.Error(t.id, "client_stalled", message, 408))
    out.drop()


async def _choices(request: web.Request, gw: Gateway, rid: str, req: m.GenerateRequest,
                   choices: list[many.Choice], chat: bool, served: str) -> web.StreamResponse:
    """Several choices (n > 1, or several prompts): each a row of the worker's batch, merged here."""
    try:
        tracked = many.admit_all(gw.link, rid, choices)
    except QueueFull:
        return _refuse(rid, 429, f"{len(choices)} choices do not fit in the queue now; retry later", "queue_full", retry=True)
    log.info("[%s] admitted %d choices (%s, stream=%s)", rid, len(choices), req.mode, req.stream)
    rows = many.make_rows(rid, served, chat, choices, tracked, chat and tools_offered(req),
                          bool(gw.link.worker and gw.link.worker.thinks))

    def cancel() -> None:
        for t in tracked:
            gw.link.cancel(t.id)

    def ended() -> None:
        many.release_next(gw.link, tracked)

    limit = gw.config.request_timeout_s or None
    deadline = asyncio.get_running_loop().time() + limit if limit else None
    resp = out = None
    try:
        async with asyncio.timeout_at(deadline):
            firsts = [None if t.held else await _first_event(t, req) for t in tracked]
            refused = next((e for e in firsts if isinstance(e, m.Error)), None)
            if refused is not None:
                cancel()
                await many.Merged(rows, firsts).drain()
                return _refuse(rid, refused.status, refused.message, refused.code, refused.param)
            if not req.stream:
                return await many.whole(rows, firsts, cancel, ended)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": rid})
            await resp.prepare(request)
            out = SseWriter(request, resp, gw.config.stall_s, gw.config.stall_bytes)
            usage = bool(req.stream_options and req.stream_options.include_usage)
            await many.stream(out, rows, firsts, usage, cancel, ended, gw.config.keepalive_s)
            return resp
    except ClientStalled as e:
        _cut(gw, rid, [t for t in tracked if t.id in gw.link.requests], out, e)
        return resp
    except TimeoutError:
        for t in tracked:
            _time_limit_reached(gw, t)
        if resp is None:
            return _refuse(rid, 504, _time_limit_message(limit), "request_timeout")
        async with asyncio.timeout(WRITE_GRACE_S):
            await _sse(resp, error_body(504, _time_limit_message(limit), "request_timeout"))
            await resp.write(b"data: [DONE]\n\n")
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("[%s] client went away: cancelling its choices", rid)
        cancel()
        raise


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.link.worker:
        return json_error(503, "the worker is not ready", "worker_unavailable")
    cards = [{"id": n, "object": "model", "created": int(gw.started_at), "owned_by": "verity"} for n in served_names(gw)]
    name = request.match_info.get("model")
    if name is None:
        return web.json_response({"object": "list", "data": cards})  # the model's id first, then its aliases
    card = next((c for c in cards if c["id"] == name), None)
    if card is None:
        return json_error(404, f"model `{name}` does not exist", "model_not_found", "model")
    return web.json_response(card)


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    link = gw.link
    stats = link.worker_stats
    silent = link.silent_s()
    hung = silent > gw.config.heartbeat_timeout_s
    body = {
        "status": "ok" if link.ready and not gw.draining and not hung else (
            "draining" if gw.draining else "worker_unresponsive" if hung else "unavailable"),
        "model": link.worker.model_id if link.worker else None,
        "worker_pid": link.worker.pid if link.worker else None,
        "worker_restarts": link.worker_restarts,
        "admitted": len(link.requests),
        "waiting": link.waiting_count(),
        "worker_silent_s": round(silent, 1),
        **({"detail": f"the worker (pid {link.worker.pid}) has sent no heartbeat for {silent:.1f} s"} if hung else {}),
        "worker": None if stats is None else {"active": stats.active, "queue_depth": stats.queue_depth,
                                              "tokens_per_s": stats.tokens_per_s, "time": stats.time,
                                              "requests_total": stats.requests_total,
                                              "requests_finished": stats.requests_finished},
    }
    return web.json_response(body, status=200 if body["status"] == "ok" else 503)


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI description of this server, from the structs that validate and shape it."""
    gw = request.app[GATEWAY]
    w = gw.link.worker
    return web.json_response(describe(
        cap=gw.config.max_tokens_cap, model=w.model_id if w else None, joint=bool(w and w.joint_available),
        auth=bool(gw.config.api_key), context_limit=w.context_limit if w else None,
        max_body_bytes=gw.config.max_body_bytes, request_timeout_s=gw.config.request_timeout_s,
        aliases=gw.config.served_names))


def make_app(gw: Gateway) -> web.Application:
    app = web.Application(middlewares=[log_refusals, host_and_origin, errors_and_auth],
                          client_max_size=gw.config.max_body_bytes)
    app[GATEWAY] = gw
    app.on_response_prepare.append(_cors_on_prepare)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", models)
    app.router.add_get("/health", health)
    surfaces = Surfaces(gw.link, gw.config.max_tokens_cap, gw.started_at, lambda: gw.draining)
    surfaces.aliases = gw.config.served_names
    surfaces.register(app)
    SmallEndpoints(gw.link, lambda: served_names(gw)).register(app)
    from gateway import messages_api  # imports this module: added once it is whole

    messages_api.routes(app)
    from gateway import responses_api  # it imports this module's helpers
    responses_api.routes(app)
    return app
