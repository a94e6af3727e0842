"""Clients that stop reading (gateway/sse.py, gateway/choices.py): every stream, n > 1 included,
gets keep-alive comments and is cut when its client stops taking bytes (its requests cancelled,
their rows freed, a log line); and one request holds at most a quarter of the batch's rows, so
two of them cannot take every row from the clients that read."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
from aiohttp import web

from gateway.app import make_app
from gateway.relay import Gateway, GatewayConfig
from protocol import messages as m
from stack import Stack, until
from test_faults import _stalled_reader
from test_stack import chat_body


async def fake_gateway(tmp_path, **config) -> tuple[Gateway, web.AppRunner, str, list]:
    """An in-process gateway whose worker is the test: jobs go nowhere, cancels are collected."""
    gw = Gateway(GatewayConfig(runtime_dir=str(tmp_path), **config))
    gw.link.worker = m.Ready(process="worker", pid=1, model_id="fake")
    cancels: list[bytes] = []
    gw.link.jobs = type("Jobs", (), {"send": staticmethod(lambda data: None)})()
    gw.link.control = type("Control", (), {"send": staticmethod(cancels.append)})()
    runner = web.AppRunner(make_app(gw), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gw.guard.port = runner.addresses[0][1]
    return gw, runner, f"http://127.0.0.1:{gw.guard.port}", cancels


def rows_of(gw: Gateway, n: int) -> list:
    rows = sorted(gw.link.requests.values(), key=lambda t: t.seq)
    assert len(rows) == n, rows
    for t in rows:
        t.events.put_nowait(m.Queued(t.id, 3))
        t.events.put_nowait(m.Started(t.id, 3))
    return rows


async def test_streams_of_several_choices_get_keepalives_and_the_cut(tmp_path, caplog, reliability):
    """n = 2, in process: while no event comes, keep-alive comments; a client that reads nothing
    (a raw socket with a 2 KiB receive buffer) beside a worker sending 1 KiB deltas to both rows is
    cut once nothing of what waits for it has left for --stall-s (1 s here): both rows cancelled."""
    gw, runner, url, cancels = await fake_gateway(tmp_path, keepalive_s=0.2, stall_s=1.0)
    try:
        async with aiohttp.ClientSession() as http:
            r = await http.post(url + "/v1/chat/completions", json=chat_body(n=2, stream=True))
            await until(lambda: len(gw.link.requests) == 2, 5, "both choices admitted")
            rows = rows_of(gw, 2)
            lines: list[bytes] = []
            async with asyncio.timeout(5):
                while sum(x.startswith(b": keep-alive") for x in lines) < 3:
                    lines.append(await r.content.readline())
            assert sum(x.startswith(b'data: {"id"') for x in lines) == 2  # the two role chunks, then only comments
            for t in rows:
                t.events.put_nowait(m.TextDelta(t.id, "hi", [1]))
                gw.link._end(t, m.Finished(t.id, "stop", m.RequestMetrics(completion_tokens=1)))
            assert (await r.read()).rstrip().endswith(b"data: [DONE]")
        sock = _stalled_reader(url, chat_body(n=2, stream=True, max_tokens=1000))
        await until(lambda: len(gw.link.requests) == 2, 5, "both stalled choices admitted")
        rows, t0 = rows_of(gw, 2), time.monotonic()
        while gw.link.requests and time.monotonic() - t0 < 20:
            for t in rows:
                t.events.put_nowait(m.TextDelta(t.id, "x" * 1024, [1]))
            # the fake worker sends again once the gateway has taken what it sent (or the rows are gone)
            await until(lambda: not gw.link.requests or all(t.events.empty() for t in rows), 20, "deltas taken")
        cut_s = time.monotonic() - t0
        sock.close()
    finally:
        await runner.cleanup()
        gw.link.ctx.destroy(linger=0)
    assert not gw.link.requests and len(cancels) == 2, (gw.link.requests, cancels)
    assert "stopped reading its stream" in caplog.text and "cancelling 2 request(s)" in caplog.text
    assert 1.0 <= cut_s < 6, cut_s
    reliability.record(
        "faults", "Streams of several choices: keep-alive and the cut",
        "In process, n = 2: a stream waiting for events gets keep-alive comments (every 0.2 s here); a client that "
        "reads nothing (2 KiB receive buffer) beside a worker sending 1 KiB deltas to both rows is cut once none "
        "of the bytes waiting for it has left for --stall-s (1 s here): both rows cancelled, one log line.",
        cut_after_s=round(cut_s, 2), rows_cancelled=len(cancels))


async def test_readers_keep_rows_beside_n8_streams_that_stop_reading(tiny_llama, reliability):
    """Two clients open n = 8 streams and never read (before: they held all 16 rows of the CPU
    default, and four reading clients got no token for 57 s, until they disconnected). A request
    now holds at most 16 / 4 rows, so the readers start at once; the two are cut after --stall-s."""
    with Stack(str(tiny_llama), "--max-active", "16", "--queue-size", "32", "--stall-s", "2", "--max-tokens-cap",
               "2000", env={"VERITY_FAULT_STEP_DELAY_S": "0.005"}) as s:
        stalled = [_stalled_reader(s.url, chat_body(max_tokens=2000, ignore_eos=True, stream=True, n=8))
                   for _ in range(2)]
        try:
            await until(lambda: s.health()[1].get("admitted") == 16, 10, "both n = 8 requests admitted")
            await until(lambda: (s.health()[1].get("worker") or {}).get("active") == 8, 10, "their 8 rows decoding")
            t0 = time.monotonic()

            async def reader() -> tuple[float, float]:
                t = time.monotonic()
                async with aiohttp.ClientSession() as http:
                    async with http.post(s.url + "/v1/chat/completions",
                                         json=chat_body(max_tokens=32, ignore_eos=True, stream=True)) as r:
                        first = None
                        async for line in r.content:
                            if first is None and line.startswith(b'data: {"id"') and b'"content": "' in line:
                                first = time.monotonic() - t
                        return first, time.monotonic() - t

            readers = await asyncio.gather(*(reader() for _ in range(4)))
            await until(lambda: s.log().count("stopped reading its stream") >= 2, 60, "both silent streams cut")
            cut_s = time.monotonic() - t0
            await until(s.idle, 30, "their rows freed")
        finally:
            for sock in stalled:
                sock.close()
        log = s.log()
    firsts = [f for f, _ in readers]
    assert all(f is not None and f < 2.0 for f in firsts), readers
    assert log.count("cancelling 8 request(s)") == 2, [x for x in log.splitlines() if "stopped reading" in x]
    reliability.record(
        "faults", "n = 8 streams that stop reading beside four readers",
        "Two raw-socket clients (2 KiB receive buffers) send n = 8 streamed 2000-token requests and never read, on a "
        "stack with --max-active 16 and --stall-s 2; four clients then stream 32 tokens each. A request decodes at "
        "most max_active / 4 rows at once (its other choices wait in the gateway); a stream whose client takes no "
        "byte for --stall-s is cut, its requests cancelled.",
        expected="readers' first tokens under 2 s; both silent streams cut and their 16 rows freed",
        readers_first_token_s=[round(f, 2) for f in firsts],
        readers_done_median_s=round(statistics.median(t for _, t in readers), 2),
        silent_rows_decoding=8, both_cut_after_s=round(cut_s, 1), lost=0, hung=0, leaked="none")
