"""run_gateway: serve HTTP, report READY to launch-stack, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

import zmq

from gateway.app import Gateway, GatewayConfig, make_app
from protocol import codec, messages as m, runtime

log = logging.getLogger("verity.gateway")


def parse_args(argv: list[str]) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="verity-gateway")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-active", type=int, default=4)
    p.add_argument("--queue-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=2048)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--keepalive-s", type=float, default=5.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    a = p.parse_args(argv)
    return GatewayConfig(
        runtime_dir=a.runtime_dir, host=a.host, port=a.port, max_active=a.max_active,
        queue_size=a.queue_size, api_key=os.environ.get("VERITY_API_KEY") or None,
        max_tokens_cap=a.max_tokens_cap, max_body_bytes=a.max_body_bytes,
        keepalive_s=a.keepalive_s, drain_timeout_s=a.drain_timeout_s,
    )


async def serve(config: GatewayConfig) -> int:
    from aiohttp import web

    gw = Gateway(config)
    gw.link.start()
    runner = web.AppRunner(make_app(gw), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runtime.watch_parent(lambda: loop.call_soon_threadsafe(stop.set))
    _report_ready(config, port)
    log.info("gateway listening on http://%s:%d", config.host, port)
    await stop.wait()
    await _drain(gw)
    await runner.cleanup()
    await gw.link.close()
    return 0


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


def _report_ready(config: GatewayConfig, port: int) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(runtime.endpoint(config.runtime_dir, runtime.SUPERVISOR))
    sock.send(codec.encode(m.Ready(process="gateway", pid=os.getpid(), url=f"http://{config.host}:{port}")))
    sock.close()


def run_gateway(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    return asyncio.run(serve(config))
