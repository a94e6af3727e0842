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

from aiohttp import web

from gateway.link import QueueFull, Tracked, WorkerLink
from gateway.openai_format import Shaper, error_body
from gateway.surfaces import Surfaces
from protocol import messages as m
from protocol.schema import RequestInvalid, parse_request, resolve_max_tokens

log = logging.getLogger("verity.gateway")
FIRST_EVENT_TIMEOUT_S = 2.0  # wait this long for the worker's verdict before streaming headers
RETRY_AFTER_S = 1


@dataclass
class GatewayConfig:
    runtime_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_active: int = 4
    queue_size: int = 16
    api_key: Optional[str] = None
    max_tokens_cap: int = 2048
    max_body_bytes: int = 1 << 20
    keepalive_s: float = 5.0
    drain_timeout_s: float = 30.0


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.link = WorkerLink(config.runtime_dir, config.max_active, config.queue_size)
        self.draining = False
        self.started_at = time.time()


GATEWAY = web.AppKey("gateway", Gateway)


def json_error(status: int, message: str, code: str, param: Optional[str] = None, headers=None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status, headers=headers)


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    gw = request.app[GATEWAY]
    key = gw.config.api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            msg = "missing API key" if not given else "invalid API key"
            return json_error(401, f"{msg}: send `Authorization: Bearer <key>`", "invalid_api_key")
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return json_error(413, f"request body exceeds {gw.config.max_body_bytes} bytes", "body_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_error(e.status, e.reason, e.reason.lower().replace(" ", "_"))


async def generate(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    chat = request.path.endswith("/chat/completions")
    if gw.draining:
        return json_error(503, "the server is shutting down", "shutting_down")
    try:
        req = parse_request(await request.read(), "chat" if chat else "completion")
        resolve_max_tokens(req, gw.config.max_tokens_cap)
    except RequestInvalid as e:
        return json_error(400, e.message, e.code, e.param)
    served = gw.link.worker.model_id if gw.link.worker else None
    if not gw.link.ready:
        return json_error(503, "the worker is not ready; retry shortly", "worker_unavailable",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
    if req.model is not None and req.model != served:
        return json_error(404, f"model `{req.model}` does not exist; this server serves `{served}`", "model_not_found", "model")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    try:
        t = gw.link.admit(rid, req)
    except QueueFull:
        return json_error(429, "too many requests are running or waiting; retry later", "queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
    log.info("[%s] admitted (%s, stream=%s)", rid, req.mode, req.stream)
    shaper = Shaper(rid, served, chat)
    try:
        first = await _first_event(t)
        if isinstance(first, m.Error):
            return json_error(first.status, first.message, first.code, first.param)
        if req.stream:
            return await _stream(request, gw, t, shaper, first)
        return await _whole(t, shaper, first)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("[%s] client went away: cancelling", rid)
        gw.link.cancel(rid)
        raise


async def _first_event(t: Tracked):
    try:
        return await asyncio.wait_for(t.events.get(), FIRST_EVENT_TIMEOUT_S)
    except asyncio.TimeoutError:
        return None


async def _whole(t: Tracked, shaper: Shaper, first) -> web.Response:
    parts: list[str] = []
    ev = first if first is not None else await t.events.get()
    while True:
        if isinstance(ev, m.TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, m.Finished):
            return web.json_response(shaper.whole("".join(parts), ev), headers={"X-Request-Id": t.id})
        elif isinstance(ev, m.Error):
            return json_error(ev.status, ev.message, ev.code, ev.param)
        ev = await t.events.get()


async def _stream(request: web.Request, gw: Gateway, t: Tracked, shaper: Shaper, first) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": t.id})
    await resp.prepare(request)
    include_usage = bool(t.submit.request.stream_options and t.submit.request.stream_options.include_usage)
    if shaper.chat:
        await _sse(resp, shaper.chunk(role=True, text=""))
    ev = first
    while True:
        if ev is None:
            try:
                ev = await asyncio.wait_for(t.events.get(), gw.config.keepalive_s)
            except asyncio.TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
        if isinstance(ev, m.TextDelta) and ev.text:
            await _sse(resp, shaper.chunk(text=ev.text))
        elif isinstance(ev, m.Finished):
            await _sse(resp, shaper.chunk(finished=ev))
            if include_usage:
                await _sse(resp, shaper.usage_chunk(ev))
            break
        elif isinstance(ev, m.Error):
            await _sse(resp, error_body(ev.status, ev.message, ev.code, ev.param))
            break
        ev = None
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.link.worker:
        return json_error(503, "the worker is not ready", "worker_unavailable")
    card = {"id": gw.link.worker.model_id, "object": "model", "created": int(gw.started_at), "owned_by": "verity"}
    name = request.match_info.get("model")
    if name is None:
        return web.json_response({"object": "list", "data": [card]})
    if name != card["id"]:
        return json_error(404, f"model `{name}` does not exist", "model_not_found", "model")
    return web.json_response(card)


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    link = gw.link
    stats = link.worker_stats
    body = {
        "status": "ok" if link.ready and not gw.draining else ("draining" if gw.draining else "unavailable"),
        "model": link.worker.model_id if link.worker else None,
        "worker_pid": link.worker.pid if link.worker else None,
        "worker_restarts": link.worker_restarts,
        "admitted": len(link.requests),
        "waiting": link.waiting_count(),
        "worker": None if stats is None else {"active": stats.active, "queue_depth": stats.queue_depth,
                                              "tokens_per_s": stats.tokens_per_s, "time": stats.time},
    }
    return web.json_response(body, status=200 if body["status"] == "ok" else 503)


def make_app(gw: Gateway) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=gw.config.max_body_bytes)
    app[GATEWAY] = gw
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", models)
    app.router.add_get("/health", health)
    Surfaces(gw).register(app)  # web UI, /metrics, /v1/verity/info and /v1/verity/stats
    return app
