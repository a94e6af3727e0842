"""A frozen worker, requests that time out on it, and cancels that overtake their job, on real
stacks (issue 45)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp

from stack import Stack, until, wait_until
from test_faults import error_events, read_rest
from test_stack import chat_body, read_data_lines

HEARTBEAT_S, HANG_S = 1.0, 4.0


async def test_frozen_worker_is_reported_then_restarted_and_nothing_admitted_is_lost(tiny_llama, reliability):
    with Stack(str(tiny_llama), "--max-active", "1", "--heartbeat-timeout-s", str(HEARTBEAT_S),
               "--hang-timeout-s", str(HANG_S), env={"VERITY_FAULT_STEP_DELAY_S": "0.02"}) as s:
        old = s.worker_pid()
        async with aiohttp.ClientSession() as http:
            url = s.url + "/v1/chat/completions"
            started = await http.post(url, json=chat_body(max_tokens=500, ignore_eos=True, stream=True))
            await read_data_lines(started, 3)  # decoding: the one active row
            waiting = asyncio.create_task(http.post(url, json=chat_body("the quick brown fox", max_tokens=8)))
            await until(lambda: s.health()[1].get("waiting") == 1, 10, "a second request waiting")
            t0 = time.monotonic()
            os.kill(old, signal.SIGSTOP)
            await until(lambda: s.health()[0] == 503, HEARTBEAT_S + 5, "/health 503")
            unhealthy_s = time.monotonic() - t0
            report = s.health()[1]
            late = asyncio.create_task(http.post(url, json=chat_body("hello world", max_tokens=8)))  # admitted meanwhile
            lines, _ = await asyncio.wait_for(read_rest(started), HANG_S + 30)
            restarted_s = time.monotonic() - t0
            answers = [await asyncio.wait_for(t, 60) for t in (waiting, late)]
            statuses = [r.status for r in answers]
            for r in answers:
                await r.read()
        await until(lambda: s.health()[0] == 200 and s.worker_pid() not in (None, old), 30, "the new worker ready")
        healthy_s = time.monotonic() - t0
        log = s.log()
    assert report["status"] == "worker_unresponsive" and f"pid {old}" in report["detail"], report
    assert unhealthy_s < HEARTBEAT_S + 2.5, unhealthy_s  # the bound, a stats interval, a loaded CPU
    assert f"worker (pid {old}) sent no heartbeat" in log
    assert [e["code"] for e in error_events(lines)] == ["worker_died"]
    assert statuses == [200, 200]
    assert s.exit_code == 0
    reliability.record(
        "faults", "Worker frozen with SIGSTOP",
        f"A stream decoding and a request waiting; the worker is stopped (SIGSTOP) and a third request arrives. "
        f"Its stats (every 0.5 s) are its heartbeat: /health turns 503 `worker_unresponsive` naming it past "
        f"--heartbeat-timeout-s ({HEARTBEAT_S:g} s here) and launch-stack kills and restarts it past "
        f"--hang-timeout-s ({HANG_S:g} s here), as for a death.",
        expected="503 within the first bound; restart past the second; nothing admitted lost",
        health_503_after_s=round(unhealthy_s, 2), stream_ended_after_s=round(restarted_s, 2),
        health_200_again_after_s=round(healthy_s, 2),
        started_stream="error event `worker_died` then [DONE]",
        waiting_and_late_requests=" and ".join(map(str, statuses)), lost=0, hung=0, leaked="none")


async def test_timed_out_requests_free_their_slots_at_once(tiny_llama, reliability):
    with Stack(str(tiny_llama), "--max-active", "1", "--queue-size", "1", "--request-timeout-s", "1.5",
               "--heartbeat-timeout-s", "60", "--hang-timeout-s", "0") as s:
        pid = s.worker_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            async with aiohttp.ClientSession() as http:
                url = s.url + "/v1/chat/completions"

                async def one():
                    async with http.post(url, json=chat_body(max_tokens=8)) as r:
                        return r.status

                first = await asyncio.gather(one(), one())  # both slots, on a frozen worker
                admitted_after = s.health()[1]["admitted"]
                t0 = time.monotonic()
                second = await asyncio.gather(one(), one())
                second_s = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(s.idle, 20, "the resumed worker to drop the cancelled requests")
    assert first == [504, 504] and second == [504, 504], (first, second)  # never 429
    assert admitted_after == 0
    reliability.record(
        "faults", "Requests timing out on a frozen worker",
        "--max-active 1 --queue-size 1 --request-timeout-s 1.5, the worker stopped: two requests fill both slots and "
        "time out; two more follow at once. A timed-out request gives its slot back at its 504, not when the "
        "worker confirms the cancel.",
        expected="504, 504 then 504, 504 (no 429)", first=str(first), then=f"{second} after {second_s:.2f} s",
        admitted_after_the_timeouts=admitted_after, lost=0, hung=0, leaked="none (the resumed worker ends idle)")


async def test_cancel_that_overtakes_its_job_stops_the_request(tiny_llama, reliability):
    # each job's submission takes 1 s (a long prompt's tokenizing): the cancels arrive first
    with Stack(str(tiny_llama), "--max-active", "2", env={"VERITY_FAULT_SUBMIT_DELAY_S": "1.0"}) as s:
        async with aiohttp.ClientSession() as http:
            url = s.url + "/v1/chat/completions"
            body = chat_body(max_tokens=2000, ignore_eos=True, stream=True)
            tasks = [asyncio.create_task(http.post(url, json=body)) for _ in range(2)]
            await until(lambda: s.health()[1].get("admitted") == 2, 10, "two admitted")
            for t in tasks:
                t.cancel()  # the clients go away while the first job is still being submitted
            await asyncio.gather(*tasks, return_exceptions=True)
        t0 = time.monotonic()
        h = await asyncio.to_thread(s.settled, 20)
        idle_s = time.monotonic() - t0
        log = s.log()
    assert "cancel (it came while the job was tokenized)" in log
    assert "cancelled before its job arrived" in log
    assert "finished: length" not in log
    assert h["worker"]["requests_total"] == h["worker"]["requests_finished"]
    reliability.record(
        "faults", "Cancels that overtake their job",
        "Two long streamed requests whose clients leave while the worker's jobs thread is still submitting the "
        "first (a 1 s fault per job, as a long prompt's tokenizing): one cancel arrives while its job is "
        "tokenized, the other before its job is read. A cancel for an unknown request is remembered (at most "
        "4,096, for 120 s) and applied when the job arrives.",
        expected="both stopped; none decodes to max_tokens", stopped="2 of 2",
        seconds_until_idle=round(idle_s, 2), decoded_to_max_tokens=0, lost=0, hung=0, leaked="none")


def test_early_cancels_are_bounded_in_number_and_age():
    from worker.proc import EarlyIds

    now = [0.0]
    early = EarlyIds(limit=3, expiry_s=0.2, clock=lambda: now[0])
    for rid in "abcde":
        early.remember(rid)
    assert len(early) == 3 and not early.take("a") and early.take("e") and not early.take("e")
    early.remember("f")
    now[0] = 0.19
    early.remember("g")
    assert early.take("g")
    now[0] = 0.25
    assert not early.take("f")  # too old: its job is long gone
