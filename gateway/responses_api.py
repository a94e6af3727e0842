"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
POST /v1/responses/{id}/cancel.

A request is converted to the one internal GenerateRequest (protocol/responses.py) and takes the
path a chat completion takes: the same admission, the same worker verdict (a schema the grammar
cannot enforce: 400 before any byte), cancel on disconnect, the time limit, the slow-reader cut.
A stored response (`store`, the default) is kept in a bounded store (gateway/response_store.py)
for GET and `previous_response_id`; a running one (streaming, background, or whole) can be
cancelled by its id. `background`: the answer is the response as queued; it runs here and is
read back with GET.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional

import msgspec
from aiohttp import web

from gateway.relay import (GATEWAY, WRITE_GRACE_S, Gateway, cut, first_event, next_event, refuse,
                         time_limit_message, time_limit_reached, json_error, served_names)
from gateway.link import QueueFull, Tracked
from gateway.response_store import ResponseStore
from gateway.responses_builder import ResponseBuilder
from gateway.responses_format import event_type
from gateway.sse import ClientStalled, SseWriter
from protocol import messages as m
from protocol.responses import Converted, ResponsesRequest, convert, parse_responses, responses_param
from protocol.schema import RequestInvalid, resolve_max_tokens
from protocol.tool_rules import tools_offered

log = logging.getLogger("verity.gateway")
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the worker to confirm before answering


@dataclass
class Running:
    builder: ResponseBuilder
    history: list[m.Message]
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ResponsesState:
    store: ResponseStore
    running: dict[str, Running] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)  # background responses


STATE = web.AppKey("responses", ResponsesState)


def routes(app: web.Application) -> None:
    """Adds the Responses routes (and their store) to the gateway's app."""
    config = app[GATEWAY].config
    app[STATE] = ResponsesState(ResponseStore(config.responses_max_count, config.responses_max_bytes))
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_delete("/v1/responses/{id}", delete)
    app.router.add_post("/v1/responses/{id}/cancel", cancel)
    app.on_cleanup.append(_stop_background)


async def _stop_background(app: web.Application) -> None:
    tasks = app[STATE].tasks
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class UnknownResponse(Exception):
    pass


def _history(st: ResponsesState, req: ResponsesRequest) -> list[m.Message]:
    """The stored conversation `previous_response_id` continues ([] without one)."""
    prev = req.previous_response_id
    if prev is None:
        return []
    stored = st.store.get(prev)
    if stored is None:
        raise UnknownResponse(st.store.missing(prev))
    if prev in st.running:
        raise RequestInvalid(f"response `{prev}` is still running: continue it once it has ended", "previous_response_id")
    return stored.context


def _prepare(gw: Gateway, st: ResponsesState, body: bytes) -> tuple[ResponsesRequest, Converted, list[m.Message]]:
    req = parse_responses(body)
    history = _history(st, req)
    conv = convert(req, history)
    cap = gw.config.max_tokens_cap
    if req.max_output_tokens is not None and req.max_output_tokens > cap:
        raise RequestInvalid(f"`max_output_tokens` ({req.max_output_tokens}) exceeds this server's cap of {cap}",
                             "max_output_tokens")
    resolve_max_tokens(conv.request, cap, gw.link.worker.defaults.max_tokens if gw.link.worker else None)
    return req, conv, history


async def create(request: web.Request) -> web.StreamResponse:
    gw, st = request.app[GATEWAY], request.app[STATE]
    rid = "resp_" + uuid.uuid4().hex
    if gw.draining:
        return refuse(rid, 503, "the server is shutting down", "shutting_down")
    try:
        req, conv, history = _prepare(gw, st, await request.read())
    except RequestInvalid as e:
        return refuse(rid, 400, e.message, e.code, e.param)
    except UnknownResponse as e:
        return refuse(rid, 404, str(e), "response_not_found", "previous_response_id")
    if not gw.link.ready:
        return refuse(rid, 503, "the worker is not ready; retry shortly", "worker_unavailable", retry=True)
    names = served_names(gw)
    if req.model is not None and req.model not in names:
        return refuse(rid, 404, f"model `{req.model}` does not exist; this server serves "
                       f"{', '.join(f'`{n}`' for n in names)}", "model_not_found", "model")
    if gw.config.log_prompts:
        log.info("[%s] prompt: %s", rid, msgspec.json.encode(conv.request.messages).decode())
    if conv.hosted_tools:
        log.info("[%s] tools not offered (run by OpenAI's servers): %s", rid, ", ".join(conv.hosted_tools))
    try:
        t = gw.link.admit(rid, conv.request)
    except QueueFull:
        return refuse(rid, 429, "too many requests are running or waiting; retry later", "queue_full", retry=True)
    log.info("[%s] admitted (responses, %s, stream=%s, background=%s)", rid, conv.request.mode, bool(req.stream),
             bool(req.background))
    w = gw.link.worker
    builder = ResponseBuilder(rid, req.model or names[0], req, conv, tools_offered(conv.request),
                              thinks=bool(w and w.thinks), defaults=w.defaults if w else None)
    run = Running(builder, history)
    return await _serve(request, gw, st, t, run)


async def _serve(request: web.Request, gw: Gateway, st: ResponsesState, t: Tracked, run: Running) -> web.StreamResponse:
    """The admitted response: its verdict, then a stream, a whole response or a background run."""
    b = run.builder
    st.running[t.id] = run
    if b.req.store is not False:
        st.store.put(t.id, b.as_dict(), run.history + b.conv.turn)
    limit = gw.config.request_timeout_s or None
    deadline = asyncio.get_running_loop().time() + limit if limit else None
    background = False
    try:
        first = await first_event(t, b.conv.request)
        if isinstance(first, m.Error):
            st.store.delete(t.id)
            return refuse(t.id, first.status, first.message, first.code, responses_param(first.param, b.conv.tool_positions))
        if b.req.background and not b.req.stream:
            b.status = "queued"
            task = asyncio.create_task(_background(gw, st, t, run, first, deadline))
            st.tasks.add(task)
            task.add_done_callback(st.tasks.discard)
            background = True
            return web.json_response(b.as_dict(), headers={"X-Request-Id": t.id})
        if b.req.stream:
            return await _stream(request, gw, t, run, first, deadline)
        return await _finish(gw, t, run, first, deadline, None)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("[%s] client went away: cancelling", t.id)
        gw.link.cancel(t.id)
        raise
    finally:
        if not background:
            _ended(st, t.id, run)


def _ended(st: ResponsesState, rid: str, run: Running) -> None:
    """A response that ended (or whose client left: cancelled): no longer running; its final state stored."""
    st.running.pop(rid, None)
    b = run.builder
    if not b.ended:  # its client left: the worker was told to stop
        b.abandon()
    if b.req.store is not False:
        st.store.update(rid, b.as_dict(), run.history + b.context())
    run.done.set()


async def _background(gw: Gateway, st: ResponsesState, t: Tracked, run: Running, first,
                      deadline: Optional[float]) -> None:
    try:
        await _finish(gw, t, run, first, deadline, None)
    except asyncio.CancelledError:
        gw.link.cancel(t.id)
        raise
    finally:
        _ended(st, t.id, run)


async def _finish(gw: Gateway, t: Tracked, run: Running, first, deadline: Optional[float],
                  out: Optional[SseWriter]) -> web.StreamResponse:
    """Takes the request's events to its end; with `out`, writes each step's stream events (and
    raises TimeoutError at the time limit). Whole (no `out`): the response, or its error as chat
    completions answer it."""
    b, ev = run.builder, first
    try:
        async with asyncio.timeout_at(deadline):
            while not b.ended:
                if ev is None:
                    ev = await (t.events.get() if out is None else next_event(t, gw.config.keepalive_s))
                    if ev is None:
                        await out.keepalive()
                        continue
                events = b.on_event(ev)
                if out is not None:
                    await _send(out, events)
                ev = None
    except TimeoutError:
        time_limit_reached(gw, t)
        if out is not None:
            raise
        b.fail("request_timeout", time_limit_message(gw.config.request_timeout_s), status=504)
    if b.error is not None:
        return json_error(b.error_status, b.error.message, b.error.code)
    return web.json_response(b.as_dict(), headers={"X-Request-Id": t.id})


async def _send(out: SseWriter, events: list) -> None:
    for ev in events:
        await out.write(b"event: " + event_type(ev).encode() + b"\ndata: " + msgspec.json.encode(ev) + b"\n\n")


async def _stream(request: web.Request, gw: Gateway, t: Tracked, run: Running, first,
                  deadline: Optional[float]) -> web.StreamResponse:
    """The typed event stream (no `[DONE]`: the last event is response.completed, .incomplete
    or .failed). A client that stops reading is cut; at the time limit the stream ends with an
    error event and response.failed, or the connection is dropped when even that cannot be written."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": t.id})
    await resp.prepare(request)
    out = SseWriter(request, resp, gw.config.stall_s, gw.config.stall_bytes)
    b = run.builder
    try:
        await _send(out, b.start())
        await _finish(gw, t, run, first, deadline, out)
        await resp.write_eof()
        return resp
    except ClientStalled as e:
        cut(gw, t.id, [] if b.ended else [t], out, e)
        return resp
    except TimeoutError:
        pass
    try:
        async with asyncio.timeout(WRITE_GRACE_S):
            await _send(out, b.fail("request_timeout", time_limit_message(gw.config.request_timeout_s), status=504)
                        if not b.ended else [])
            await resp.write_eof()
    except (TimeoutError, ClientStalled):
        log.warning("[%s] the client does not read its stream: closing the connection", t.id)
        out.drop()
    return resp


def _lookup(request: web.Request) -> tuple[ResponsesState, str, Optional[dict]]:
    st = request.app[STATE]
    rid = request.match_info["id"]
    run = st.running.get(rid)
    if run is not None:
        return st, rid, run.builder.as_dict()
    stored = st.store.get(rid)
    return st, rid, stored.response if stored else None


async def retrieve(request: web.Request) -> web.Response:
    st, rid, body = _lookup(request)
    if body is None:
        return json_error(404, st.store.missing(rid), "response_not_found", "id")
    return web.json_response(body)


async def delete(request: web.Request) -> web.Response:
    st, rid, body = _lookup(request)
    if body is None:
        return json_error(404, st.store.missing(rid), "response_not_found", "id")
    if rid in st.running:
        request.app[GATEWAY].link.cancel(rid)
    st.store.delete(rid)
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """Cancels a running response (background, streaming or whole) and answers its final state."""
    st, rid, body = _lookup(request)
    run = st.running.get(rid)
    if run is None:
        if body is None:
            return json_error(404, st.store.missing(rid), "response_not_found", "id")
        if body["status"] != "cancelled":
            return json_error(400, f"response `{rid}` is not running (status {body['status']}): only a running "
                              "response can be cancelled", "response_not_running", "id")
        return web.json_response(body)
    log.info("[%s] cancel asked", rid)
    request.app[GATEWAY].link.cancel(rid)
    try:
        async with asyncio.timeout(CANCEL_WAIT_S):
            await run.done.wait()
    except TimeoutError:
        pass
    return web.json_response(run.builder.as_dict())
