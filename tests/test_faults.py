"""Faults on a real stack: processes killed, clients that vanish or stop reading, the time limit.

The worker killed mid-stream (its started stream ends with an error event, waiting requests are
served by the restarted worker, /health is 503 in between) and a worker that keeps dying
(launch-stack exits 2) are tested in test_stack.py: test_killed_worker_is_restarted_and_nothing_
admitted_is_lost and test_worker_that_keeps_dying_fails_the_stack.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import statistics
import time
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from gateway.app import make_app
from gateway.relay import Gateway, GatewayConfig
from protocol import messages as m

from reliability import alive, launch_stack_has, runtime_dir_of, stack_pids
from stack import Stack, until
from test_stack import chat_body, read_data_lines

SLOW = {"VERITY_FAULT_STEP_DELAY_S": "0.02"}  # ~50 engine steps a second: long requests stay running


async def answer(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.json()


def text_of(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


async def read_rest(resp: aiohttp.ClientResponse) -> tuple[list[bytes], bool]:
    """The remaining lines of a stream and whether it ended cleanly (False: the connection broke)."""
    lines = []
    try:
        async for line in resp.content:
            lines.append(line)
        return lines, True
    except aiohttp.ClientError:
        return lines, False


def error_events(lines: list[bytes]) -> list[dict]:
    return [json.loads(x[6:])["error"] for x in lines if x.startswith(b'data: {"error"')]


# ---- launch-stack killed ----


async def test_killed_launch_stack_leaves_no_process(tiny_llama, reliability):
    s = Stack(str(tiny_llama), "--max-active", "2", env=SLOW).start()
    pids = stack_pids(s.proc.pid)
    try:
        assert {"launch-stack", "worker", "gateway"} <= set(pids), pids
        rdir = runtime_dir_of(pids["worker"])
        async with aiohttp.ClientSession() as http:
            r = await http.post(s.url + "/v1/chat/completions", json=chat_body(max_tokens=256, ignore_eos=True, stream=True))
            await read_data_lines(r, 3)  # streaming: the gateway holds an admitted request
            t0 = time.monotonic()
            os.kill(s.proc.pid, signal.SIGKILL)
            lines, clean = await asyncio.wait_for(read_rest(r), 15)
            stream_end_s = time.monotonic() - t0
        await until(lambda: not any(alive(p) for p in pids.values()), 15, "every process of the stack to exit")
        gone_s = time.monotonic() - t0
        await until(lambda: not os.path.exists(rdir), 5, "the runtime directory to be removed")
    finally:
        for p in pids.values():  # never leave one behind, even when the test fails
            if alive(p):
                os.kill(p, signal.SIGKILL)
        s.stop()
    errors = error_events(lines)
    assert not clean or [e["code"] for e in errors] == ["supervisor_died"], lines[-3:]
    assert not clean or lines[-2:] == [b"data: [DONE]\n", b"\n"]
    reliability.record(
        "faults", "launch-stack killed with SIGKILL",
        "A stack with a stream in flight; launch-stack gets SIGKILL (no chance to clean up). Its children "
        "watch a pipe from it (protocol/runtime.py watch_parent): the worker exits at once, the gateway "
        "ends the admitted stream with an error event, removes the runtime directory and exits.",
        processes=", ".join(sorted(pids)), all_gone_after_s=round(gone_s, 2),
        stream_ended_after_s=round(stream_end_s, 2),
        stream_end=("error event `supervisor_died` then [DONE]" if clean else "connection closed"),
        runtime_dir_removed=True)


# ---- clients that vanish ----


async def test_fifty_clients_disconnecting_at_once(tiny_llama, reliability):
    probe = chat_body("the quick brown fox", max_tokens=24, ignore_eos=True)
    with Stack(str(tiny_llama), "--max-active", "8", "--queue-size", "48", env=SLOW) as s:
        status, fresh = await answer(s.url, probe)  # what a fresh stack says
        assert status == 200
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            long = chat_body(max_tokens=256, ignore_eos=True, stream=True)
            streams = await asyncio.gather(*(http.post(s.url + "/v1/chat/completions", json=long) for _ in range(50)))
            await asyncio.gather(*(read_data_lines(r, 1) for r in streams))  # every one has started streaming
            await until(lambda: s.health()[1].get("admitted") == 50 and (s.health()[1].get("worker") or {}).get("active") == 8,
                        30, "50 admitted, 8 decoding")
            t0 = time.monotonic()
            for r in streams:
                r.close()  # all 50 go away at once, mid-stream
        await until(s.idle, 30, "no admitted request in the gateway and none active or queued in the worker")
        idle_s = time.monotonic() - t0
        h = await asyncio.to_thread(s.settled)
        assert h["worker"]["requests_total"] == h["worker"]["requests_finished"]
        status, after = await answer(s.url, probe)
        assert status == 200 and text_of(after) == text_of(fresh)
        log = s.log()
    assert log.count("client went away: cancelling") == 50
    reliability.record(
        "faults", "50 clients disconnecting mid-stream at once",
        "50 streamed requests (8 decoding, 42 waiting) whose clients all close their connections at once; "
        "then the same greedy request as on the fresh stack.",
        disconnects=50, seconds_until_idle=round(idle_s, 2), gateway_admitted_after=h["admitted"],
        worker_active_after=h["worker"]["active"], worker_requests_unfinished=h["worker"]["requests_total"] - h["worker"]["requests_finished"],
        next_answer_equals_fresh_stack=True)


# ---- the time limit and clients that stop reading ----


def _stalled_reader(url: str, body: dict) -> socket.socket:
    """A raw HTTP client with a tiny receive buffer that sends a streamed request and never reads."""
    u = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((u.hostname, u.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.fixture(scope="module")
def limited(tiny_llama):
    with Stack(str(tiny_llama), "--max-active", "4", "--queue-size", "8", "--request-timeout-s", "3",
               "--max-tokens-cap", "2000", env={"VERITY_FAULT_STEP_DELAY_S": "0.005"}) as s:
        yield s


async def test_time_limit_ends_whole_and_streamed_requests(limited, reliability):
    long = chat_body(max_tokens=2000, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        async with http.post(limited.url + "/v1/chat/completions", json=long) as r:
            whole_status, whole = r.status, await r.json()
        whole_s = time.monotonic() - t0
        t0 = time.monotonic()
        async with http.post(limited.url + "/v1/chat/completions", json={**long, "stream": True}) as r:
            stream_status = r.status
            lines, clean = await read_rest(r)
        stream_s = time.monotonic() - t0
    assert whole_status == 504 and whole["error"]["code"] == "request_timeout", whole
    assert "time limit of 3 s" in whole["error"]["message"] and "--request-timeout-s" in whole["error"]["message"]
    if stream_status == 504:  # the limit passed before the stream's first event: a plain error, no stream
        assert json.loads(b"".join(lines))["error"]["code"] == "request_timeout", lines
    else:
        assert clean and [e["code"] for e in error_events(lines)] == ["request_timeout"], (stream_status, lines[-4:])
        assert [x for x in lines if x.strip()][-1] == b"data: [DONE]\n"
    assert 3 <= whole_s < 5 and 3 <= stream_s < 5, (whole_s, stream_s)
    await until(limited.idle, 10, "the cancelled requests to leave the worker")
    reliability.record(
        "faults", "Per-request time limit (--request-timeout-s 3)",
        "Requests that would generate 2000 tokens on a stack with a 3 s limit: the gateway cancels them in "
        "the worker and answers 504 `request_timeout` (a whole response) or ends the stream with that "
        "error event and [DONE].",
        whole_response=f"504 after {whole_s:.2f} s", stream=f"error event after {stream_s:.2f} s",
        worker_freed=True)


async def test_clients_that_stop_reading_stall_no_one(limited, reliability):
    short = chat_body("hello world", max_tokens=8, ignore_eos=True)
    solo = []
    for _ in range(3):
        t0 = time.monotonic()
        status, expected = await answer(limited.url, short)
        solo.append(time.monotonic() - t0)
        assert status == 200
    long = chat_body(max_tokens=2000, ignore_eos=True, stream=True)
    raw = _stalled_reader(limited.url, long)
    try:
        async with aiohttp.ClientSession() as http:
            unread = await http.post(limited.url + "/v1/chat/completions", json=long)  # headers only, never read
            await until(lambda: limited.health()[1].get("admitted") == 2, 10, "both stalled clients admitted")
            t0 = time.monotonic()

            async def timed():
                t = time.monotonic()
                status, body = await answer(limited.url, short)
                return status, body, time.monotonic() - t

            others = await asyncio.gather(*(timed() for _ in range(6)))
            others_done_s = time.monotonic() - t0
            still_held = limited.health()[1].get("admitted")
            await until(limited.idle, 15, "the stalled clients' requests to reach the time limit and leave")
            unread.close()
    finally:
        raw.close()
    assert all(status == 200 and text_of(body) == text_of(expected) for status, body, _ in others)
    latencies = [t for _, _, t in others]
    assert others_done_s < 3, "the other requests waited for the stalled ones"
    assert still_held == 2  # they were still being held when the others had finished
    reliability.record(
        "faults", "Clients that stop reading",
        "Two clients send streamed 2000-token requests and never read (an aiohttp client that only awaits "
        "the headers, and a raw socket with a 2 KiB receive buffer); six other requests run meanwhile. "
        "The stalled ones end at the 3 s time limit (their worker slots freed), the others are unaffected.",
        solo_latency_median_s=round(statistics.median(solo), 3),
        others_latency_median_s=round(statistics.median(latencies), 3),
        others_latency_max_s=round(max(latencies), 3), others_all_correct=True,
        stalled_requests_freed_by_time_limit=2)


async def test_stalled_write_is_cut_at_the_time_limit(tmp_path, caplog, reliability):
    """In process (the tiny model cannot outrun loopback's ~2 MB of socket buffers): a gateway whose
    worker streams 64 KiB text deltas to a client that reads nothing. The write blocks; at the time
    limit the request is cancelled and, the error event being unwritable too, the connection dropped.
    (The stall bounds are set past the limit: test_a_client_that_stops_reading_is_cut tests them.)"""
    gw = Gateway(GatewayConfig(runtime_dir=str(tmp_path), request_timeout_s=1.0, stall_s=60, stall_bytes=1 << 30))
    gw.link.worker = m.Ready(process="worker", pid=1, model_id="fake")
    cancels = []
    gw.link.jobs = type("Jobs", (), {"send": staticmethod(lambda data: None)})()
    gw.link.control = type("Control", (), {"send": staticmethod(cancels.append)})()
    runner = web.AppRunner(make_app(gw), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gw.guard.port = port = runner.addresses[0][1]

    async def fake_worker():  # a fast worker: 64 KiB of text per event until cancelled
        await until(lambda: gw.link.requests, 5, "admission")
        t = next(iter(gw.link.requests.values()))
        t.events.put_nowait(m.Started(t.id, 3))
        while not cancels:
            t.events.put_nowait(m.TextDelta(t.id, "x" * 65536, [1]))
            await until(lambda: cancels or t.events.qsize() < 4, 10, "the gateway to take the events")
        gw.link._end(t, m.Finished(t.id, "cancelled", m.RequestMetrics()))

    sock = _stalled_reader(f"http://127.0.0.1:{port}", chat_body(stream=True, max_tokens=100))
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(fake_worker(), 10)
        cancelled_s = time.monotonic() - t0
        await until(lambda: "does not read its stream" in caplog.text, 5, "the connection to be dropped")
        dropped_s = time.monotonic() - t0
        sock.setblocking(False)
        received = 0
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except BlockingIOError:
            pass
    finally:
        sock.close()
        await runner.cleanup()
        gw.link.ctx.destroy(linger=0)  # never started; not left to the garbage collector
    assert 1.0 <= cancelled_s < 2.5 and not gw.link.requests
    reliability.record(
        "faults", "A stream write blocked by a client that reads nothing",
        "In-process gateway, a fake worker streaming 64 KiB deltas to a raw socket that never reads: the "
        "blocked write is interrupted at the 1 s time limit, the request is cancelled in the worker, and "
        "the connection dropped when the error event cannot be written either.",
        cancelled_after_s=round(cancelled_s, 2), connection_dropped_after_s=round(dropped_s, 2))


# ---- the cache service killed ----


@pytest.mark.skipif(not launch_stack_has("--cache-bytes"), reason="this launch-stack starts no cache service")
async def test_killed_cache_service_fails_no_request(tiny_llama, reliability):
    prompts = ["hello world", "the quick brown fox", "once upon a time", "one two three"]
    with Stack(str(tiny_llama), "--max-active", "4", "--queue-size", "16") as s:
        pids = stack_pids(s.proc.pid)
        assert "cache" in pids, pids
        expected = {}
        for p in prompts:  # asked alone first; also fills the cache
            status, body = await answer(s.url, chat_body(p, max_tokens=12, ignore_eos=True))
            assert status == 200
            expected[p] = text_of(body)
        results: list[tuple[str, int, bool]] = []
        phase = "before"
        stop = asyncio.Event()

        async def client(i: int) -> None:
            async with aiohttp.ClientSession() as http:
                n = i
                while not stop.is_set():
                    p = prompts[n % len(prompts)]
                    n += 1
                    async with http.post(s.url + "/v1/chat/completions",
                                         json=chat_body(p, max_tokens=12, ignore_eos=True)) as r:
                        body = await r.json()
                    results.append((phase, r.status, r.status == 200 and text_of(body) == expected[p]))

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        try:
            await until(lambda: len(results) >= 20, 30, "requests before the kill")
            t0 = time.monotonic()
            os.kill(pids["cache"], signal.SIGKILL)
            phase = "while down"
            await until(lambda: stack_pids(s.proc.pid).get("cache", pids["cache"]) != pids["cache"]
                        and "cache ready (pid %d)" % stack_pids(s.proc.pid)["cache"] in s.log(), 30,
                        "launch-stack to restart the cache service")
            restart_s = time.monotonic() - t0
            phase = "after"
            n_after = len(results)
            await until(lambda: len(results) >= n_after + 40, 60, "requests after the restart")
        finally:
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
        h = await asyncio.to_thread(s.settled)
        assert s.worker_pid() == pids["worker"] and h["worker_restarts"] == 0
    failed = [r for r in results if not r[2]]
    assert not failed, failed[:5]
    count = collections.Counter(phase for phase, _, _ in results)
    reliability.record(
        "faults", "Cache service killed with SIGKILL",
        "Four clients loop over four prompts (reused from the prefix cache) while the cache service gets "
        "SIGKILL; launch-stack restarts it and the worker resyncs. Every request before, during and after "
        "succeeds with the same greedy text; the worker is never restarted.",
        requests=len(results), before_kill=count["before"], while_down=count["while down"], after_restart=count["after"],
        failed=len(failed), cache_restarted_after_s=round(restart_s, 2))


# ---- the gateway killed ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_killed_gateway_is_restarted_and_its_requests_dropped(tiny_llama, reliability):
    probe = chat_body("hello world", max_tokens=12, ignore_eos=True)
    s = Stack(str(tiny_llama), "--max-active", "2", env=SLOW, port=_free_port()).start()
    with s:
        status, fresh = await answer(s.url, probe)
        assert status == 200
        pids = stack_pids(s.proc.pid)
        async with aiohttp.ClientSession() as http:
            r = await http.post(s.url + "/v1/chat/completions", json=chat_body(max_tokens=256, ignore_eos=True, stream=True))
            await read_data_lines(r, 3)
            t0 = time.monotonic()
            os.kill(pids["gateway"], signal.SIGKILL)
            _, clean = await asyncio.wait_for(read_rest(r), 15)
        assert not clean  # its connection died with the gateway
        await until(lambda: s.health()[0] == 200 and stack_pids(s.proc.pid).get("gateway") not in (None, pids["gateway"]),
                    30, "launch-stack to restart the gateway on the same port")
        back_s = time.monotonic() - t0
        h = await asyncio.to_thread(s.settled)  # the dead gateway's request no longer runs
        dropped_s = time.monotonic() - t0
        assert h["worker_pid"] == pids["worker"] and h["worker"]["active"] == 0
        assert h["worker"]["requests_total"] == h["worker"]["requests_finished"]
        status, after = await answer(s.url, probe)
        assert status == 200 and text_of(after) == text_of(fresh)
    assert s.exit_code == 0
    assert "its gateway (pid %d) is gone" % pids["gateway"] in s.log()
    reliability.record(
        "faults", "Gateway killed with SIGKILL mid-stream",
        "A stream in flight when the gateway gets SIGKILL: its connection breaks (the process that would write "
        "an error event is gone); launch-stack restarts the gateway on the same port, the new gateway tells the "
        "worker to drop what the dead one had submitted, and the same greedy request gets the same answer. The "
        "worker keeps running (no model reload).",
        serving_again_after_s=round(back_s, 2), orphan_dropped_within_s=round(dropped_s, 2),
        worker_restarted=False, next_answer_equals_before=True)
