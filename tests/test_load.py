"""The load run: many more clients than the stack admits, on the tiny model, loopback only.

500 requests (VERITY_FULL=1; CI runs 100 with the same assertions) from 32 concurrent clients
against `--max-active 4 --queue-size 8`: every admitted request completes with the greedy text a
request alone gets, every refused one is a 429 with Retry-After (the client then waits until a
request admitted before its refusal has ended, and sends its next one), none hangs (60 s client limit), none is lost (the
worker saw each admitted request exactly once, and ends idle). Resident memory of every process is
sampled every 50 requests; the prefix cache's budget (64 KiB) is smaller than what the run's
prompts would keep, so it is full and evicting throughout: growth means a leak.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time

import aiohttp
import pytest

from conftest import FULL
from reliability import launch_stack_has, rss_kib, stack_pids
from stack import Stack

N_REQUESTS = 500 if FULL else 100
CONCURRENCY = 32
CLIENT_TIMEOUT_S = 60.0
PROMPTS = ["hello world", "the quick brown fox", "once upon a time", "one two three",
           "What is the capital of France?", "a b c d", "The robot read many books", "Please answer"]
MAX_RSS_GROWTH_KIB = 64 * 1024  # per process, from the sample after 50 requests to the last one


def job(i: int) -> dict:
    """Request i of the run: chat or completion, whole or streamed, 4..19 tokens."""
    prompt = PROMPTS[i % len(PROMPTS)]
    chat = (i // len(PROMPTS)) % 2 == 0
    body = {"temperature": 0, "max_tokens": 4 + (i * 7) % 16, "ignore_eos": True,
            "stream": (i // 3) % 2 == 0}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    return body


def key(body: dict) -> tuple:
    return ("messages" in body, json.dumps(body.get("messages") or body.get("prompt")), body["max_tokens"])


async def send(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One request; its status, text, finish reason, Retry-After and error code."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(url + path, json=body) as r:
        out = {"status": r.status, "retry_after": r.headers.get("Retry-After")}
        if r.status != 200 or not body["stream"]:
            data = await r.json()
            if r.status != 200:
                return {**out, "code": data["error"]["code"]}
            choice = data["choices"][0]
            return {**out, "text": choice["message"]["content"] if chat else choice["text"],
                    "finish": choice["finish_reason"], "tokens": data["usage"]["completion_tokens"]}
        parts, finish, errors, done = [], None, [], False
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"]["code"])
                continue
            for c in event["choices"]:
                parts.append((c["delta"].get("content") or "") if chat else c["text"])
                finish = c["finish_reason"] or finish
            if "metrics" in event:
                out["tokens"] = event["metrics"]["completion_tokens"]
        return {**out, "text": "".join(parts), "finish": finish, "errors": errors, "done": done}


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    cache = ("--cache-bytes", "64K") if launch_stack_has("--cache-bytes") else ()
    with Stack(str(tiny_llama), "--max-active", "4", "--queue-size", "8", "--max-tokens-cap", "64", *cache) as s:
        yield s
    assert s.exit_code == 0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def test_load_run(loaded, reliability):
    url = loaded.url
    jobs = [job(i) for i in range(N_REQUESTS)]
    expected: dict[tuple, str] = {}
    async with aiohttp.ClientSession() as http:
        for body in jobs:  # each distinct request alone, streamed or not: its greedy answer
            if key(body) not in expected:
                r = await send(http, url, {**body, "stream": False})
                assert r["status"] == 200, r
                expected[key(body)] = r["text"]
    before = (await asyncio.to_thread(loaded.settled))["worker"]["requests_total"]
    pids = stack_pids(loaded.proc.pid)
    samples: list[tuple[int, dict]] = []
    results: list[dict] = []
    order = itertools.count()
    answered = asyncio.Condition()  # notified at each request that was not refused (a slot freed)
    done = 0

    def sample() -> None:
        samples.append((len(results), {name: rss_kib(pid) for name, pid in pids.items()}))

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while (i := next(order)) < N_REQUESTS:
            body = jobs[i]
            seen, t0 = done, time.monotonic()
            try:
                async with asyncio.timeout(CLIENT_TIMEOUT_S):
                    r = await send(http, url, body)
            except Exception as e:  # a hang (TimeoutError) or a broken connection: counted, asserted below
                r = {"status": None, "exception": repr(e)}
            r.update(latency=time.monotonic() - t0, key=key(body))
            results.append(r)
            if len(results) % 50 == 0:
                sample()
            async with answered:
                if r["status"] != 429:
                    done += 1
                    answered.notify_all()
                else:  # refused: it retries once a request admitted before its refusal has ended
                    await asyncio.wait_for(answered.wait_for(lambda: done > seen), CLIENT_TIMEOUT_S)

    t_run = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))
    run_s = time.monotonic() - t_run
    after = (await asyncio.to_thread(loaded.settled))["worker"]
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/verity/stats") as r:
            cache = {k: v for k, v in ((await r.json()).get("worker_stats") or {}).items() if k.startswith("cache_")}

    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    other = [r for r in results if r["status"] not in (200, 429)]
    wrong = [r for r in ok if r["text"] != expected[r["key"]] or r["finish"] != "length" or r.get("errors")
             or (r.get("done") is False) or r.get("tokens") != r["key"][2]]
    bad_429 = [r for r in refused if r["code"] != "queue_full" or not (r["retry_after"] or "").isdigit()
               or int(r["retry_after"]) < 1]
    assert len(results) == N_REQUESTS and not other, other[:3]
    assert not wrong, wrong[:3]
    assert not bad_429, bad_429[:3]
    assert ok and refused, (len(ok), len(refused))  # the run did overload the stack
    assert after["requests_total"] - before == len(ok), "the worker saw other than each admitted request once"
    assert after["requests_total"] == after["requests_finished"]
    first = next(s for n, s in samples if n >= 50)
    last = samples[-1][1]
    growth = {name: last[name] - first[name] for name in pids if last.get(name) and first.get(name)}
    lat_ok = [r["latency"] for r in ok]
    lat_429 = [r["latency"] for r in refused]
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    reliability.record(
        "load", f"{N_REQUESTS} requests, {CONCURRENCY} concurrent clients, --max-active 4 --queue-size 8",
        f"{N_REQUESTS} requests (chat and completion, whole and streamed, 4–19 greedy tokens, 8 prompts) "
        f"from {CONCURRENCY} clients at once against a stack that admits 12; a refused client waits "
        "until an admitted request ends, then sends its next request. Expected texts: each distinct request asked alone first. "
        + ("The prefix cache runs with a 64 KiB budget, full and evicting throughout." if "cache" in pids
           else "No cache service (this launch-stack has none)."),
        requests=N_REQUESTS, admitted_and_correct=len(ok), refused_429_with_retry_after=len(refused),
        other_outcomes=len(other), wrong_answers=len(wrong), lost=after["requests_total"] - before - len(ok),
        run_seconds=round(run_s, 1), admitted_latency_median_s=round(statistics.median(lat_ok), 3),
        admitted_latency_p95_s=round(_pct(lat_ok, 0.95), 3), admitted_latency_max_s=round(max(lat_ok), 3),
        refusal_latency_median_s=round(statistics.median(lat_429), 4),
        **{f"rss_mib_after_{first_n}": {k: mib(v) for k, v in first.items()}
           for first_n in [next(n for n, _ in samples if n >= 50)]},
        **{f"rss_mib_after_{samples[-1][0]}": {k: mib(v) for k, v in last.items()}},
        rss_growth_mib={k: mib(v) for k, v in growth.items()},
        cache_at_end=", ".join(f"{k.removeprefix('cache_')} {v}" for k, v in cache.items()),
        rss_samples_mib=" → ".join(f"{n}: {sum(mib(v) for v in s.values()):.0f}" for n, s in samples))
    assert all(g < MAX_RSS_GROWTH_KIB for g in growth.values()), growth
