"""Prefix reuse in a real launch-stack: the cache service killed and restarted, snapshots that
survive a worker restart, and `verity bench cache`."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import urllib.request

import aiohttp

from reliability import stack_pids
from stack import Stack, until
from test_stack import post, read_data_lines


def convo(*turns: str) -> list[dict]:
    """A conversation whose assistant replies are fixed, so each turn extends the previous."""
    out = [{"role": "system", "content": "You are a helpful robot who likes stories."}]
    for i, t in enumerate(turns):
        out += [{"role": "user", "content": t}] + ([{"role": "assistant", "content": "ok"}] if i < len(turns) - 1 else [])
    return out


def body(messages: list[dict], **kw) -> dict:
    return {"messages": messages, "temperature": 0, "max_tokens": 8, **kw}


def worker_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/verity/stats", timeout=5) as r:
        return json.load(r)["worker_stats"] or {}


async def test_reuse_resumes_after_the_cache_service_is_killed(tiny_llama):
    with Stack(str(tiny_llama), "--max-active", "2", env={"VERITY_FAULT_STEP_DELAY_S": "0.01"}) as s:
        _, first, _ = await post(s.url, body(convo("hello world")), headers={})
        old = stack_pids(s.proc.pid)["cache"]
        async with aiohttp.ClientSession() as http:  # a stream in flight across the kill
            stream = await http.post(s.url + "/v1/chat/completions",
                                     json=body(convo("hello world", "tell me a story"), max_tokens=64, stream=True))
            await read_data_lines(stream, 3)
            os.kill(old, signal.SIGKILL)
            tail = [line async for line in stream.content]
        assert [x for x in tail if x.strip()][-1] == b"data: [DONE]\n", tail[-4:]
        assert not any(b'"error"' in x for x in tail), tail
        # served without reuse while it is down; launch-stack restarts it; the worker resyncs
        await until(lambda: stack_pids(s.proc.pid).get("cache", old) != old, 30, "a new cache service")
        status, during, _ = await post(s.url, body(convo("hello world", "once upon a time")), headers={})
        assert status == 200 and during["usage"]["completion_tokens"] == 8
        await until(lambda: worker_stats(s.url).get("cache_bytes") is not None, 30, "the worker to resync")
        _, after, _ = await post(s.url, body(convo("hello world", "tell me a story", "and then?")), headers={})
        # what the worker kept before the kill was registered again and serves the earlier prefix
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        assert f"cache (pid {old}) exited with code -9" in s.log()
    assert s.exit_code == 0


async def test_snapshots_survive_a_worker_restart_with_cache_dir(tiny_llama, tmp_path):
    spill = tmp_path / "snapshots"
    with Stack(str(tiny_llama), "--cache-dir", str(spill)) as s:
        _, first, _ = await post(s.url, body(convo("hello world")), headers={})
        await until(lambda: any(f.suffix == ".safetensors" for f in spill.iterdir()), 10, "the spill file")
        files = list(spill.iterdir())
        assert stat.S_IMODE(spill.stat().st_mode) == 0o700
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        old = s.worker_pid()
        os.kill(old, signal.SIGKILL)
        await until(lambda: s.health()[0] == 200 and s.worker_pid() not in (None, old), 60, "the restarted worker")
        _, nxt, _ = await post(s.url, body(convo("hello world", "tell me a story")), headers={})
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        found = re.search(r"found (\d+) spilled snapshots", s.log())  # the prompt's, and the answer's if it was in
        assert found and int(found.group(1)) >= 1, s.log()
    assert s.exit_code == 0


def test_bench_cache_quick(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "cache", "--model", str(tiny_llama), "--quick",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "cache" and figures["ratio"] > 0
    assert figures["stack_exit_codes"] == {"embedded": 0, "hybrid": 0}
    for label in ("embedded", "hybrid"):
        res = figures["models"][label]
        assert res["warm_reused"] > 100 and res["changed_reused"] > 100  # the ~150-token system prompt
        conv = res["conversation"]
        assert len(conv["turns"]) == 3 and conv["miss_hit_rate"] == 0.0
    assert "goal met" in r.stdout or "goal missed" in r.stdout
