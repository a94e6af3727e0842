"""The HTTP side: OpenAI-compatible routes, errors as OpenAI error objects, SSE streaming."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from typing import Optional

import msgspec
from aiohttp import web

from gateway import choices as many
from gateway.guard import Refused, cors_headers
from gateway.link import QueueFull, Tracked
from gateway.messages_api import routes as messages_routes
from gateway.openai_format import Shaper, error_body
from gateway.openapi import describe
from gateway.relay import (GATEWAY, WRITE_GRACE_S, Gateway, cut, end_at_time_limit, first_event, json_error, next_event,
                           refuse, served_names, time_limit_message, time_limit_reached)
from gateway.responses_api import routes as responses_routes
from gateway.small import AUTH_PATHS, SmallEndpoints
from gateway.sse import ClientStalled, SseWriter
from gateway.surfaces import Surfaces
from protocol import messages as m
from protocol.schema import RequestInvalid, parse_request, resolve_max_tokens, top_logprobs
from protocol.tool_rules import tools_offered

log = logging.getLogger("verity.gateway")
CORS_ORIGIN = "verity.cors_origin"


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


async def generate(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    chat = request.path.endswith("/chat/completions")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if gw.draining:
        return refuse(rid, 503, "the server is shutting down", "shutting_down")
    try:
        req = parse_request(await request.read(), "chat" if chat else "completion")
        resolve_max_tokens(req, gw.config.max_tokens_cap, gw.link.worker.defaults.max_tokens if gw.link.worker else None)
        choices = many.expand(req, chat)
    except RequestInvalid as e:
        return refuse(rid, 400, e.message, e.code, e.param)
    if not gw.link.ready:
        return refuse(rid, 503, "the worker is not ready; retry shortly", "worker_unavailable", retry=True)
    names = served_names(gw)
    if req.model is not None and req.model not in names:
        return refuse(rid, 404, f"model `{req.model}` does not exist; this server serves {', '.join(f'`{n}`' for n in names)}",
                       "model_not_found", "model")
    served = req.model or names[0]  # the name the client sent, as OpenAI clients expect
    if gw.config.log_prompts:  # asked for with --log-prompts; JSON keeps it on one line
        log.info("[%s] prompt: %s", rid, msgspec.json.encode(req.messages if chat else req.prompt).decode())
    if len(choices) > gw.link.capacity:
        return refuse(rid, 400, f"{len(choices)} choices (prompts × n) are more than this server admits at once "
                       f"({gw.link.capacity}: --max-active + --queue-size)", "too_many_choices", "n")
    if len(choices) > 1:
        return await _choices(request, gw, rid, req, choices, chat, served)
    try:
        t = gw.link.admit(rid, choices[0].request)
    except QueueFull:
        return refuse(rid, 429, "too many requests are running or waiting; retry later", "queue_full", retry=True)
    log.info("[%s] admitted (%s, stream=%s)", rid, req.mode, req.stream)
    shaper = Shaper(rid, served, chat, tool_calls=chat and tools_offered(req),
                    logprobs=top_logprobs(req) is not None, thinks=bool(gw.link.worker and gw.link.worker.thinks))
    limit = gw.config.request_timeout_s or None
    deadline = asyncio.get_running_loop().time() + limit if limit else None
    try:
        try:
            async with asyncio.timeout_at(deadline):
                first = await first_event(t, req)
                if isinstance(first, m.Error):
                    return refuse(rid, first.status, first.message, first.code, first.param)
                if not req.stream:
                    return await _whole(t, shaper, first)
        except TimeoutError:
            time_limit_reached(gw, t)
            return json_error(504, time_limit_message(limit), "request_timeout")
        return await _stream(request, gw, t, shaper, first, deadline)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("[%s] client went away: cancelling", rid)
        gw.link.cancel(rid)
        raise


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
                    ev = await next_event(t, gw.config.keepalive_s)
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
        cut(gw, t.id, [] if ended else [t], out, e)
        return resp
    except TimeoutError:
        pass
    error = error_body(504, time_limit_message(gw.config.request_timeout_s), "request_timeout")
    tail = b"" if ended else b"data: " + json.dumps(error).encode() + b"\n\n"
    await end_at_time_limit(request, gw, t, out, ended, tail + b"data: [DONE]\n\n")
    return resp


def _last_events(shaper: Shaper, ev, include_usage: bool) -> list[dict]:
    """A stream's end: the finish chunk (and usage), or the error event."""
    if isinstance(ev, m.Error):
        return [error_body(ev.status, ev.message, ev.code, ev.param)]
    return [shaper.chunk(finished=ev)] + ([shaper.usage_chunk(ev)] if include_usage else [])


async def _choices(request: web.Request, gw: Gateway, rid: str, req: m.GenerateRequest,
                   choices: list[many.Choice], chat: bool, served: str) -> web.StreamResponse:
    """Several choices (n > 1, or several prompts): each a row of the worker's batch, merged here."""
    try:
        tracked = many.admit_all(gw.link, rid, choices)
    except QueueFull:
        return refuse(rid, 429, f"{len(choices)} choices do not fit in the queue now; retry later", "queue_full", retry=True)
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
            firsts = [None if t.held else await first_event(t, req) for t in tracked]
            refused = next((e for e in firsts if isinstance(e, m.Error)), None)
            if refused is not None:
                cancel()
                await many.Merged(rows, firsts).drain()
                return refuse(rid, refused.status, refused.message, refused.code, refused.param)
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
        cut(gw, rid, [t for t in tracked if t.id in gw.link.requests], out, e)
        return resp
    except TimeoutError:
        for t in tracked:
            time_limit_reached(gw, t)
        if resp is None:
            return refuse(rid, 504, time_limit_message(limit), "request_timeout")
        async with asyncio.timeout(WRITE_GRACE_S):
            await _sse(resp, error_body(504, time_limit_message(limit), "request_timeout"))
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
                                              "requests_finished": stats.requests_finished,
                                              "model_state": stats.model_state},
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
    messages_routes(app)
    responses_routes(app)
    return app
