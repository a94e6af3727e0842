"""run_gateway: serve HTTP, report READY to launch-stack, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import shutil
import signal
import sys
import time

import zmq

from gateway.app import make_app
from gateway.relay import Gateway, GatewayConfig
from gateway.connections import (AcceptErrors, ConnectionBook, ConnectionLimits, GuardedSite, descriptor_cap,
                                 middlewares)
from gateway.guard import exposure_warning
from protocol import codec, messages as m, runtime

log = logging.getLogger("verity.gateway")


def parse_args(argv: list[str]) -> tuple[GatewayConfig, ConnectionLimits]:
    p = argparse.ArgumentParser(prog="verity-gateway")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-active", type=int, default=None, help="default: the worker's")
    p.add_argument("--queue-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=2048)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--keepalive-s", type=float, default=5.0)
    p.add_argument("--stall-s", type=float, default=10.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--allow-host", action="append", default=[])
    p.add_argument("--allow-origin", action="append", default=[])
    p.add_argument("--served-model-name", action="append", default=[])
    p.add_argument("--log-prompts", action="store_true")
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--header-timeout-s", type=float, default=10.0)
    p.add_argument("--body-timeout-s", type=float, default=30.0)
    p.add_argument("--responses-max-count", type=int, default=GatewayConfig.responses_max_count)
    p.add_argument("--responses-max-bytes", type=int, default=GatewayConfig.responses_max_bytes)
    a = p.parse_args(argv)
    limits = ConnectionLimits(a.max_connections, a.header_timeout_s, a.body_timeout_s)
    return GatewayConfig(
        runtime_dir=a.runtime_dir, host=a.host, port=a.port, max_active=a.max_active,
        queue_size=a.queue_size, api_key=os.environ.get("VERITY_API_KEY") or None,
        max_tokens_cap=a.max_tokens_cap, max_body_bytes=a.max_body_bytes,
        keepalive_s=a.keepalive_s, stall_s=a.stall_s, drain_timeout_s=a.drain_timeout_s,
        request_timeout_s=a.request_timeout_s or None, allow_hosts=tuple(a.allow_host),
        allow_origins=tuple(a.allow_origin), log_prompts=a.log_prompts,
        heartbeat_timeout_s=a.heartbeat_timeout_s, served_names=tuple(a.served_model_name),
        responses_max_count=a.responses_max_count, responses_max_bytes=a.responses_max_bytes,
    ), limits


async def serve(config: GatewayConfig, limits: ConnectionLimits = ConnectionLimits()) -> int:
    from aiohttp import web

    gw = Gateway(config)
    gw.link.start()
    asyncio.get_running_loop().set_exception_handler(AcceptErrors())
    book = ConnectionBook(limits)
    app = make_app(gw)
    in_request, bounded_body = middlewares(book)
    app.middlewares.insert(0, in_request)
    app.middlewares.append(bounded_body)  # after the key check: no body is read before it
    # handlers end by themselves after the drain (every admitted request is ended by then): the
    # shutdown timeout only bounds connections that linger. aiohttp's keep-alive timer runs from
    # a connection's start: it is the header timeout
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=limits.header_timeout_s)
    await runner.setup()
    site = GuardedSite(runner, config.host, config.port, book)
    await site.start()
    port = runner.addresses[0][1]
    gw.guard.port = port  # the Host check wants the real port (--port 0 picks one)
    stop = asyncio.Event()
    orphaned = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def parent_died() -> None:
        orphaned.set()
        stop.set()

    runtime.watch_parent(lambda: loop.call_soon_threadsafe(parent_died))
    _report_ready(config, port)
    log.info("gateway listening on %s", _url(config.host, port))
    warning = exposure_warning(config.host, config.api_key)
    if warning:
        log.warning("\n%s\n  %s\n%s", "!" * 78, warning, "!" * 78)
    await stop.wait()
    if orphaned.is_set():
        await _orphaned(gw)
    else:
        await _drain(gw)
    await runner.cleanup()
    await gw.link.close()
    if orphaned.is_set():  # nobody else is left to remove it
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
    return 0


async def _orphaned(gw: Gateway) -> None:
    """launch-stack died (the worker exits with it): end every admitted request now, then exit."""
    gw.draining = True
    log.error("launch-stack exited: ending %d admitted requests and stopping", len(gw.link.requests))
    gw.link.end_all("supervisor_died", "the server stopped: its supervisor (launch-stack) exited")


async def _drain(gw: Gateway) -> None:
    """Refuses new requests and lets admitted ones finish, up to the drain timeout.

    Without a worker nothing can finish: the rest are ended at once."""
    gw.draining = True
    deadline = time.monotonic() + gw.config.drain_timeout_s
    while gw.link.requests and gw.link.ready and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for rid in list(gw.link.requests):
        gw.link.cancel(rid, reason="the server is shutting down")
    if gw.link.requests:
        log.warning("drain timed out with %d requests; cancelled them", len(gw.link.requests))
    grace = time.monotonic() + 2.0  # the worker confirms cancels at its next step
    while gw.link.requests and gw.link.ready and time.monotonic() < grace:
        await asyncio.sleep(0.05)
    gw.link.end_all("shutting_down", "the server is shutting down")  # nothing is left hanging


def _report_ready(config: GatewayConfig, port: int) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(runtime.endpoint(config.runtime_dir, runtime.SUPERVISOR))
    sock.send(codec.encode(m.Ready(process="gateway", pid=os.getpid(), url=_url(config.host, port))))
    sock.close()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def raise_open_file_limit() -> int:
    """The soft open-file limit raised to the hard one (each connection holds a descriptor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # macOS refuses RLIM_INFINITY: keep the soft limit
            pass
    return soft


def run_gateway(argv: list[str] | None = None) -> int:
    config, limits = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    soft = raise_open_file_limit()
    log.info("open-file limit %d: at most %d connections at once", soft, descriptor_cap(limits.max_connections))
    return asyncio.run(serve(config, limits))
