"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the request path
chat completions take (the same admission, time limit, cancel on disconnect, slow-reader cut,
metrics and joint mode). The request is converted by protocol/anthropic.py; the response is
shaped by gateway/anthropic_format.py. Every refusal on these paths, the middleware's (401, 403,
413, 405) included, goes out in Anthropic's error shape.

`max_tokens` is required by Anthropic's API, so clients send a ceiling (Claude Code: 64000): a
value over the server's cap is lowered to it, not refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Optional

from aiohttp import web

from gateway.anthropic_format import MessageShaper, error_object, sse
from gateway.relay import (GATEWAY, Gateway, cut, next_event, refuse, time_limit_message, time_limit_reached,
                         end_at_time_limit, served_names)
from gateway.link import QueueFull, Tracked
from gateway.small import CALL_TIMEOUT_S
from gateway.sse import ClientStalled, SseWriter
from protocol import messages as m
from protocol.anthropic import parse_count, parse_messages, to_generate
from protocol.schema import RequestInvalid
from protocol.tool_rules import tools_offered

log = logging.getLogger("verity.gateway")
PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def routes(app: web.Application) -> None:
    """Adds the routes, and the error-shape middleware outermost (it sees every refusal)."""
    app.middlewares.insert(0, anthropic_errors)
    app.router.add_post("/v1/messages", create)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


@web.middleware
async def anthropic_errors(request: web.Request, handler):
    """An OpenAI error object answered on these paths, in Anthropic's shape."""
    resp = await handler(request)
    if request.path not in PATHS or resp.status < 400 or not isinstance(resp, web.Response):
        return resp
    try:
        err = json.loads(resp.body)["error"]
        message = err["message"]
    except (ValueError, KeyError, TypeError):
        return resp
    param = _anthropic_names(err.get("param"))
    status, body = error_object(resp.status, _anthropic_names(message), resp.headers.get("X-Request-Id"), err.get("code"), param)
    keep = {k: v for k, v in resp.headers.items() if k in ("X-Request-Id", "Retry-After", "Allow")}
    return web.json_response(body, status=status, headers=keep)


# internal field names in the worker's refusals (a grammar's schema, a stop string) as the client sent them
_RENAMES = ((".function.parameters", ".input_schema"), ("response_format.json_schema.schema", "output_config.format.schema"),
            ("`stop`", "`stop_sequences`"))


def _anthropic_names(text: Optional[str]) -> Optional[str]:
    for internal, sent in _RENAMES:
        text = text.replace(internal, sent) if text else text
    return "stop_sequences" if text == "stop" else text


async def _checked(request: web.Request, rid: str, parse, max_tokens):
    """Parses and checks a request: (refusal, None) or (None, (its body, the internal request))."""
    gw: Gateway = request.app[GATEWAY]
    if gw.draining:
        return refuse(rid, 503, "the server is shutting down", "shutting_down"), None
    try:
        body = parse(await request.read())
        req = to_generate(body, max_tokens(body, gw.config.max_tokens_cap))
    except RequestInvalid as e:
        return refuse(rid, 400, e.message, e.code, e.param), None
    if not gw.link.ready:
        return refuse(rid, 503, "the worker is not ready; retry shortly", "worker_unavailable", retry=True), None
    names = served_names(gw)
    if body.model not in names:
        served = ", ".join(f"`{n}`" for n in names)
        return refuse(rid, 404, f"model `{body.model}` does not exist; this server serves {served} (Claude Code: set "
                       "ANTHROPIC_MODEL, or start the stack with --served-model-name)", "model_not_found", "model"), None
    if gw.config.log_prompts:
        log.info("[%s] prompt: %s", rid, (await request.read()).decode())
    return None, (body, req)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens, rendered and counted by the worker as a generation's would be (no
    admission: nothing is generated; a prompt over the context is counted too)."""
    gw: Gateway = request.app[GATEWAY]
    rid = "msg_" + uuid.uuid4().hex
    refused, parsed = await _checked(request, rid, parse_count, lambda body, cap: 1)
    if refused is not None:
        return refused
    got = await gw.link.call(m.TokenizeJob(rid, request=parsed[1]), CALL_TIMEOUT_S)
    if isinstance(got, m.Error):
        return refuse(rid, got.status, got.message, got.code, got.param)
    return web.json_response({"input_tokens": len(got.tokens)}, headers={"X-Request-Id": rid})


async def _queued(t: Tracked):
    """The worker's verdict: Queued (the prompt's tokens counted) or an Error."""
    while True:
        ev = await t.events.get()
        if isinstance(ev, (m.Queued, m.Error, m.Finished)):
            return ev


async def create(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    rid = "msg_" + uuid.uuid4().hex
    refused, parsed = await _checked(request, rid, parse_messages, lambda body, cap: min(body.max_tokens, cap))
    if refused is not None:
        return refused
    body, req = parsed
    try:
        t = gw.link.admit(rid, req)
    except QueueFull:
        return refuse(rid, 429, "too many requests are running or waiting; retry later", "queue_full", retry=True)
    log.info("[%s] admitted (messages, %s, stream=%s)", rid, req.mode, req.stream)
    worker = gw.link.worker
    shaper = MessageShaper(t.id, body.model, tools_offered(req), thinks=bool(worker and worker.thinks))
    limit = gw.config.request_timeout_s or None
    deadline = asyncio.get_running_loop().time() + limit if limit else None
    try:
        try:
            async with asyncio.timeout_at(deadline):
                first = await _queued(t)
                if isinstance(first, m.Error):
                    return refuse(t.id, first.status, first.message, first.code, first.param)
                # Queued is a request's first event (worker/proc.py): a Finished first is the worker's
                # answer to a cancel that came before the job (its client left, or the server drains)
                if not isinstance(first, m.Queued):
                    return refuse(t.id, 503, "the request was cancelled before it started", "cancelled")
                shaper.queued(first)
                if not req.stream:
                    return await _whole(t, shaper, first)
        except TimeoutError:
            time_limit_reached(gw, t)
            return refuse(t.id, 504, time_limit_message(limit), "request_timeout")
        return await _stream(request, gw, t, shaper, first, deadline)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("[%s] client went away: cancelling", t.id)
        gw.link.cancel(t.id)
        raise


async def _whole(t: Tracked, shaper: MessageShaper, first) -> web.Response:
    parts: list[str] = []
    ev = first
    while True:
        if isinstance(ev, m.TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, m.Finished):
            return web.json_response(shaper.whole("".join(parts), ev), headers={"X-Request-Id": t.id})
        elif isinstance(ev, m.Error):
            return refuse(t.id, ev.status, ev.message, ev.code, ev.param)
        ev = await t.events.get()


def _error_event(status: int, message: str, rid: str, code: Optional[str] = None) -> bytes:
    return sse(("error", error_object(status, message, rid, code)[1]))


async def _stream(request: web.Request, gw: Gateway, t: Tracked, shaper: MessageShaper, first: m.Queued,
                  deadline: Optional[float]) -> web.StreamResponse:
    """The event stream (gateway/relay.py's rules: a client that stops reading is cut; at the time
    limit the request is cancelled and the stream ends with an error event)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": t.id})
    await resp.prepare(request)
    out = SseWriter(request, resp, gw.config.stall_s, gw.config.stall_bytes)
    ended = False
    try:
        async with asyncio.timeout_at(deadline):
            for e in shaper.start(first.prompt_tokens):
                await out.write(sse(e))
            while True:
                ev = await next_event(t, gw.config.keepalive_s)
                if ev is None:
                    await out.write(sse(("ping", {"type": "ping"})))
                elif isinstance(ev, m.TextDelta):
                    for e in shaper.delta(ev.text):
                        await out.write(sse(e))
                elif isinstance(ev, m.Finished):
                    ended = True
                    for e in shaper.finish(ev):
                        await out.write(sse(e))
                    break
                elif isinstance(ev, m.Error):
                    ended = True
                    await out.write(_error_event(ev.status, ev.message, t.id, ev.code))
                    break
            await resp.write_eof()
    except ClientStalled as e:
        cut(gw, t.id, [] if ended else [t], out, e)
    except TimeoutError:
        late = _error_event(504, time_limit_message(gw.config.request_timeout_s), t.id, "request_timeout")
        await end_at_time_limit(request, gw, t, out, ended, b"" if ended else late)
    return resp
