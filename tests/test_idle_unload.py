"""Idle unload (--idle-unload-s) on a real stack: the worker frees the model when idle (its
resident memory falls), /health stays 200, /v1/verity/info and /metrics say so, and concurrent
requests that arrive while it is unloaded all complete with the greedy output of before."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.tiny_models import build_tiny_model
from cli.client import complete
from cli.monitor import Monitor, fetch_stats, render
from stack import Stack, wait_until

IDLE_S = 1.5
WEIGHTS_MB = 148  # hidden 1024, 4 layers, float32 (model.safetensors)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """Weights large enough that their leaving shows in the resident memory."""
    return build_tiny_model(tmp_path_factory.mktemp("big"), "llama", seed=3, hidden=1024, layers=4)


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def empty_worker_rss_mb() -> float:
    """The resident memory of an interpreter that imported what the worker imports, with no model."""
    code = ("import worker.proc, mlx_lm, transformers, os; "
            "print([l for l in open(f'/proc/{os.getpid()}/status') if l.startswith('VmRSS')][0].split()[1])")
    return int(subprocess.check_output([sys.executable, "-c", code], text=True).split()[-1]) / 1024


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def monitor_frame(url: str) -> str:
    """What `verity monitor` shows of the stack now, as text."""
    from rich.console import Console

    mon = Monitor(url)
    mon.update(fetch_stats(url, None))
    console = Console(width=120, record=True)
    console.print(render(mon))
    return console.export_text()


def answer(stack, text: str) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    return complete(stack.url, body)


def model_state(stack) -> str:
    return get_json(stack.url + "/v1/verity/info")["model_state"]


def test_idle_unload_frees_memory_and_reloads_for_concurrent_requests(big, tmp_path):
    spill = ("--cache-dir", str(tmp_path / "spill"))  # spilled snapshots outlive the unload, in their files
    with Stack(str(big), "--idle-unload-s", str(IDLE_S), "--cache-bytes", "64M", *spill) as stack:
        prompts = ["hello world", "the quick brown fox", "tell me a story", "what is the capital"]
        before = {p: answer(stack, p)["choices"][0]["message"]["content"] for p in prompts}
        pid = stack.worker_pid()
        loaded = rss_mb(pid)
        assert model_state(stack) == "loaded"

        wait_until(lambda: model_state(stack) == "unloaded", 60, "the model unloaded after idling")
        unloaded, empty = rss_mb(pid), empty_worker_rss_mb()
        print(f"\nworker VmRSS: loaded {loaded:.0f} MiB, unloaded {unloaded:.0f} MiB, "
              f"an interpreter with the worker's imports {empty:.0f} MiB; weights {WEIGHTS_MB} MiB")
        assert loaded - unloaded > 0.7 * WEIGHTS_MB
        assert unloaded < empty + 0.3 * WEIGHTS_MB
        status, health = stack.health()
        assert status == 200 and health["worker"]["model_state"] == "unloaded"
        m = metrics(stack.url)
        assert m["verity:model_unloads_total"] >= 1 and m["verity:model_loaded"] == 0
        assert "model unloaded (unloads 1 · loads 0)" in monitor_frame(stack.url)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            after = dict(zip(prompts, pool.map(lambda p: answer(stack, p), prompts)))
        took = time.perf_counter() - t0
        assert {p: a["choices"][0]["message"]["content"] for p, a in after.items()} == before
        assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in after.values())
        assert stack.worker_pid() == pid  # the same worker: nothing restarted it
        stack.settled()
        m = metrics(stack.url)  # it may have unloaded again since: idle for IDLE_S
        assert m["verity:model_loads_total"] == 1 and m["verity:model_unloads_total"] >= 1
        assert re.search(r"model (un)?loaded \(unloads \d · loads 1\)", monitor_frame(stack.url))
        ttft = max(a["metrics"]["ttft_s"] for a in after.values())
        print(f"reload: {m['verity:model_load_seconds_total']:.2f} s in total; the 4 requests took {took:.2f} s, "
              f"the slowest first token {ttft:.2f} s (the load counted); reloaded VmRSS {rss_mb(pid):.0f} MiB")
        assert ttft >= m["verity:model_load_seconds_total"] / m["verity:model_loads_total"] * 0.5
    assert stack.exit_code == 0, stack.log()


def test_unload_and_reload_keep_a_joint_engine_exact(tiny_llama, tmp_path):
    """In one process: a target and its draft emptied and read again answer as before, joint too."""
    import mlx.core as mx

    from protocol import messages as m
    from worker.engine import Engine, EngineConfig
    from worker.loader import load_draft, load_model
    from worker.residency import Residency

    draft_dir = build_tiny_model(tmp_path / "draft", "llama", seed=1, perturb_from=tiny_llama, noise=0.3)
    load = lambda: (lambda lm: (lm, load_draft(str(draft_dir), lm)))(load_model(str(tiny_llama)))  # noqa: E731
    base = mx.get_active_memory()  # what other tests in this process hold
    target, draft = load()
    engine = Engine(target, EngineConfig(max_active=4), draft=draft)
    residency = Residency(engine, load, idle_s=60)

    def run(mode: str, rid: str) -> list[int]:
        req = m.GenerateRequest(messages=[m.Message("user", "hello world")], max_tokens=24, temperature=0.0,
                                ignore_eos=True, mode=mode)
        engine.submit(rid, req)
        residency.ensure_loaded()
        out = []
        while engine.has_work():
            out += [t for ev in engine.step() if isinstance(ev, m.TextDelta) for t in ev.token_ids]
        return out

    before = [run("baseline", "b0"), run("joint", "j0")]
    held = mx.get_active_memory()
    residency.unload()
    assert residency.state == "unloaded" and mx.get_active_memory() - base < (held - base) / 4
    assert [run("baseline", "b1"), run("joint", "j1")] == before
    assert (residency.state, residency.loads, residency.unloads) == ("loaded", 1, 1)


@pytest.mark.parametrize("argv, says", [
    (["--idle-unload-s", "0"], "must be above 0"),
    (["--idle-unload-s", "30", "--ranks", "2"], "not a distributed group"),
    (["--adapter-path", "a", "--ranks", "2"], "not a distributed group"),
    (["--max-context", "1"], "at least 2")])
def test_launch_stack_refuses_memory_flags_it_cannot_serve(argv, says, capsys):
    from cli.launch import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 1 and says in capsys.readouterr().err


def test_launch_stack_passes_memory_flags_to_the_worker(tmp_path):
    from cli.launch import parse_args
    from cli.memory_flags import worker_memory_args

    a = parse_args(["--idle-unload-s", "30", "--adapter-path", str(tmp_path), "--max-context", "512",
                    "--context-overflow", "truncate-middle"])
    assert worker_memory_args(a) == ["--context-overflow", "truncate-middle", "--idle-unload-s", "30.0",
                                     "--adapter-path", str(tmp_path), "--max-context", "512"]
    assert worker_memory_args(parse_args([])) == []


def test_the_buffer_cache_is_capped_on_a_gpu_and_left_alone_on_the_cpu():
    """On a GPU the worker caps MLX's buffer cache at GPU_CACHE_SHARE of MLX's memory limit (an
    H100's grew to 59 GiB without: docs/memory.md); off one it leaves MLX's own limit."""
    import mlx.core as mx

    from worker.memory import GPU_CACHE_SHARE, bound_buffer_cache

    before = mx.set_cache_limit(1 << 20)
    mx.set_cache_limit(before)
    try:
        assert bound_buffer_cache() == 0 and mx.set_cache_limit(before) == before  # this machine's CPU
        cap = bound_buffer_cache(gpu=True)
        assert cap == int(mx.get_memory_limit() * GPU_CACHE_SHARE) and 0 < cap < mx.get_memory_limit()
        assert mx.set_cache_limit(before) == cap
    finally:
        mx.set_cache_limit(before)
