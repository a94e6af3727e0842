"""The worker as an MLX distributed group: `launch-stack --ranks 2` (ring over 127.0.0.1, tensor
sharding). What it serves over HTTP equals the single-process worker's output; a rank's death
takes the group down and launch-stack restarts it whole; no rank outlives launch-stack."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass

import aiohttp
import mlx.core as mx
import pytest

from stack import LAUNCH_STACK, Stack, read_data_lines, until, wait_until
from bench.tiny_models import build_tiny_model, tiny_model_dir
from protocol import messages as m
from worker.engine import Engine, EngineConfig, cache_identity
from worker.loader import load_model
from worker.text import render_prompt

FULL = os.environ.get("VERITY_FULL") == "1"
NEAR_TIE = 1e-3  # a divergence is counted only where the single process's top two logits are this close
N_TOKENS = 48 if FULL else 16
PROMPTS = ["hello world", "the quick brown fox", "once upon a time", "tell me a story about the sea " * 30,
           "one two three four", "why is the sky blue"]  # the long one's message takes two collectives
_RANK_PID = re.compile(r"started worker rank (\d+) \(pid (\d+)")


@dataclass
class Reference:
    text: str
    gaps: list[float]  # the top-two logit gap at each generated position


def chat(text: str, n: int = N_TOKENS, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": n, "ignore_eos": True, **kw}


def reference(target, bodies: list[dict]) -> list[Reference]:
    """The single-process worker's greedy output (its Engine, in this process); joint greedy
    output is the target's own, so the baseline's is every mode's reference."""
    lm = load_model(str(target))
    engine = Engine(lm, EngineConfig(max_active=len(bodies)))
    reqs = [m.GenerateRequest(messages=[m.Message(x["role"], x["content"]) for x in b["messages"]],
                              max_tokens=b["max_tokens"], temperature=0.0, ignore_eos=True) for b in bodies]
    text, tokens = {i: "" for i in range(len(reqs))}, {i: [] for i in range(len(reqs))}
    for i, req in enumerate(reqs):
        engine.submit(str(i), req)
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, m.TextDelta):
                text[int(ev.request_id)] += ev.text
                tokens[int(ev.request_id)] += ev.token_ids
    out = []
    for i, req in enumerate(reqs):
        prompt = render_prompt(lm.tokenizer, req)
        logits = lm.model(mx.array(prompt + tokens[i])[None])[0, len(prompt) - 1 : -1].astype(mx.float32)
        top = mx.sort(logits, axis=-1)
        out.append(Reference(text[i], (top[:, -1] - top[:, -2]).tolist()))
    return out


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.json()


def rank_pids(stack: Stack) -> dict[int, int]:
    """The latest pid of each rank, from launch-stack's log."""
    return {int(rank): int(pid) for rank, pid in _RANK_PID.findall(stack.log())}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


SPLITS = [("llama", "tensor"), ("qwen3_5", "tensor")] + ([("qwen3_5", "pipeline")] if FULL else [])


@pytest.mark.parametrize("arch,shard", SPLITS)
async def test_two_ranks_serve_what_one_process_serves_baseline_and_joint(arch, shard, tmp_path_factory):
    target = tiny_model_dir(tmp_path_factory, arch, seed=0)
    draft = build_tiny_model(tmp_path_factory.mktemp(f"draft-{arch}"), arch, seed=1, perturb_from=target, noise=0.3)
    # llama: the adaptive scheduler's plans (timed on rank 0) go to rank 1; qwen3_5: a fixed k
    budget = ("--draft-budget", "2") if arch == "qwen3_5" else ()
    bodies = [chat(p, mode="joint" if i % 2 else "baseline") for i, p in enumerate(PROMPTS)]
    want = reference(target, bodies)
    with Stack(str(target), "--ranks", "2", "--shard", shard, "--draft", str(draft), *budget, "--max-active", "4",
               "--cache-bytes", "0") as s:
        got = await asyncio.gather(*(post(s.url, b) for b in bodies))  # a batch, and two waiting
        assert s.health()[1]["worker_restarts"] == 0
    near_ties = 0
    for body, ref, (status, r) in zip(bodies, want, got):
        assert status == 200, r
        assert r["metrics"]["mode"] == body["mode"] and r["usage"]["completion_tokens"] == N_TOKENS
        if r["choices"][0]["message"]["content"] != ref.text:
            near_ties += 1
            assert min(ref.gaps) < NEAR_TIE, (body["messages"][0]["content"][:40], r["choices"][0]["message"], ref.text)
    assert near_ties <= 1
    if budget:
        assert sum(r["metrics"]["drafted"] for (_, r), b in zip(got, bodies) if b["mode"] == "joint") > 0
    assert s.exit_code == 0, s.log()[-3000:]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    target = tiny_model_dir(tmp_path_factory, "llama", seed=0)
    # with prefix reuse; the request defaults greedy (test_every_rank_samples_with_the_servers_defaults)
    s = Stack(str(target), "--ranks", "2", "--max-active", "2", "--temperature", "0").start()
    yield s
    s.stop()


async def test_a_cancel_reaches_every_rank(group):
    pid = group.worker_pid()
    async with aiohttp.ClientSession() as http:
        r = await http.post(group.url + "/v1/chat/completions", json=chat("hello world", 1000, stream=True))
        await read_data_lines(r, 3)
        r.close()  # the client goes away: the gateway cancels
    await until(group.idle, 30, "the group to drop the cancelled request")
    # a rank that missed the cancel would decode on alone and break the group's lockstep
    status, body = await post(group.url, chat("the quick brown fox"))
    assert status == 200 and body["usage"]["completion_tokens"] == N_TOKENS
    assert group.worker_pid() == pid and group.health()[1]["worker_restarts"] == 0
    assert "cancel" in group.log()


async def test_prefix_reuse_moves_in_lockstep(group, tmp_path_factory):
    """A conversation's next turn restores the snapshot every rank kept of its shard at the first
    turn's boundary, and decodes what the single process decodes from scratch."""
    first = chat("tell me a story about the sea " * 8)
    status, a = await post(group.url, first)
    assert status == 200
    second = {**first, "messages": first["messages"] + [
        {"role": "assistant", "content": a["choices"][0]["message"]["content"]}, {"role": "user", "content": "and then?"}]}
    status, b = await post(group.url, second)
    assert status == 200 and b["metrics"]["reused_tokens"] > 0, b["metrics"]
    want = reference(tiny_model_dir(tmp_path_factory, "llama", seed=0), [second])[0]
    assert b["choices"][0]["message"]["content"] == want.text or min(want.gaps) < NEAR_TIE
    assert group.health()[1]["worker_restarts"] == 0


def test_metrics_and_the_monitor_show_every_rank(group):
    from rich.console import Console

    from cli.monitor import Monitor, fetch_stats, render

    pids = rank_pids(group)
    wait_until(lambda: len((fetch_stats(group.url, None)["worker_stats"] or {}).get("ranks", [])) == 2, 10,
               "the worker's stats to name both ranks")
    with urllib.request.urlopen(group.url + "/metrics") as r:
        metrics = r.read().decode()
    for rank, pid in pids.items():
        assert re.search(rf'verity:worker_rank_up{{rank="{rank}",pid="{pid}",host="[^"]+"}} 1', metrics), metrics
    mon = Monitor(group.url)
    mon.update(fetch_stats(group.url, None))
    console = Console(width=120, record=True)
    console.print(render(mon))
    text = console.export_text()
    assert all(re.search(rf"rank {rank}\s+{pid}\s+up", text) for rank, pid in pids.items()), text


async def test_every_rank_samples_with_the_servers_defaults(group, tmp_path_factory):
    """The group runs with --temperature 0: a request that omits `temperature` is greedy on every
    rank. A rank whose engine lacked the defaults would sample at temperature 1, emit other tokens
    than rank 0 and stop the group (its lockstep checksum)."""
    body = chat("why is the sky blue")
    del body["temperature"]
    status, r = await post(group.url, body)
    assert status == 200, r
    want = reference(tiny_model_dir(tmp_path_factory, "llama", seed=0), [chat("why is the sky blue")])[0]
    assert r["choices"][0]["message"]["content"] == want.text or min(want.gaps) < NEAR_TIE
    assert group.health()[1]["worker_restarts"] == 0
    with urllib.request.urlopen(group.url + "/v1/verity/info") as info:
        defaults = json.load(info)["defaults"]
    assert defaults["temperature"] == 0 and defaults["source"].startswith("flags"), defaults


async def test_a_killed_rank_takes_the_group_down_and_it_restarts_whole(group):
    """Two streams decoding (the group's --max-active 2), one request waiting; rank 1 gets SIGKILL.
    The streams end with worker_died; the waiting request is served by the restarted group."""
    before = rank_pids(group)
    assert set(before) == {0, 1}
    async with aiohttp.ClientSession() as http:
        running = [await http.post(group.url + "/v1/chat/completions", json=chat(p, 1000, stream=True))
                   for p in ("hello world", "the quick brown fox")]
        for r in running:
            await read_data_lines(r, 3)
        waiting = asyncio.create_task(post(group.url, chat("once upon a time")))
        await until(lambda: group.health()[1].get("admitted") == 3, 10, "three admitted")
        os.kill(before[1], signal.SIGKILL)
        tails = [[line async for line in r.content] for r in running]
    for tail in tails:
        errors = [json.loads(x[6:]) for x in tail if x.startswith(b'data: {"error"')]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "worker_died", tail[-4:]
    status, body = await waiting
    assert status == 200 and body["usage"]["completion_tokens"] == N_TOKENS, body
    after = rank_pids(group)
    assert group.health()[1]["worker_restarts"] == 1 and not set(after.values()) & set(before.values())
    assert not alive(before[0]), "rank 0 of the broken group is still running"


@pytest.mark.skipif(not FULL, reason="a group restart more (VERITY_FULL=1)")
async def test_a_stalled_rank_takes_the_group_down_after_the_bound(tmp_path_factory):
    target = tiny_model_dir(tmp_path_factory, "llama", seed=0)
    with Stack(str(target), "--ranks", "2", "--rank-timeout-s", "5", "--cache-bytes", "0") as s:
        before = rank_pids(s)
        os.kill(before[1], signal.SIGSTOP)  # alive, but it never answers a collective again
        await until(lambda: "made no progress" in s.log(), 30, "a rank's watchdog")
        await until(lambda: s.health()[0] == 200 and rank_pids(s)[0] != before[0], 120, "the restarted group")
        status, body = await post(s.url, chat("hello world"))
        assert status == 200 and body["usage"]["completion_tokens"] == N_TOKENS
        assert not alive(before[1])


def test_no_rank_outlives_a_killed_launch_stack(group):
    pids = [int(p) for _, p in _RANK_PID.findall(group.log())]  # every rank of every group it started
    group.kill()  # SIGKILL: launch-stack cleans nothing up
    wait_until(lambda: not any(alive(p) for p in pids), 30, "every rank to exit")


def test_a_snapshot_identity_names_the_world_size_and_the_sharding(tiny_llama_lm):
    from dataclasses import replace

    whole = cache_identity(tiny_llama_lm)
    assert len({whole, cache_identity(replace(tiny_llama_lm, sharding="tensor/2")),
                cache_identity(replace(tiny_llama_lm, sharding="tensor/4")),
                cache_identity(replace(tiny_llama_lm, sharding="pipeline/2"))}) == 4


def test_a_model_that_cannot_be_split_fails_the_start_naming_why(tmp_path):
    odd = build_tiny_model(tmp_path / "odd", "llama", seed=0, hidden=48, heads=3, kv_heads=1)
    r = subprocess.run([LAUNCH_STACK, "--model", str(odd), "--ranks", "2", "--port", "0", "--cache-bytes", "0"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "num_attention_heads (3) is not divisible by 2" in r.stderr, r.stderr[-3000:]


def test_a_remote_rank_gets_what_mlx_reads_from_its_ssh_command(tmp_path):
    """The line ssh runs on a remote host, run here by bash: the ring hostfile written on that
    host, the rank's variables set, then the rank's own command."""
    from cli.ranks import GroupPlan, Host, remote_command, rank_env

    plan = GroupPlan([Host("127.0.0.1", ["127.0.0.1"]), Host("mac2", ["10.0.0.2"])], "ring")
    env = rank_env(plan, str(tmp_path))[1]
    show = [sys.executable, "-c", "import os; print(os.environ['MLX_RANK']); print(open(os.environ['MLX_HOSTFILE']).read())"]
    out = subprocess.run(["bash", "-c", remote_command(env, show)], capture_output=True, text=True, timeout=60).stdout
    rank, hostfile = out.split("\n", 1)
    assert rank == "1" and json.loads(hostfile) == [["127.0.0.1:32323"], ["10.0.0.2:32324"]]


NO_IPS = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "mac2"}]
NOT_FIRST = [{"ssh": "mac2", "ips": ["192.0.2.1"]}, {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]


@pytest.mark.parametrize("args,hosts,says", [
    (("--ranks", "0"), None, "--ranks must be at least 1"),
    (("--ranks", "2", "--hostfile", "HOSTS"), NO_IPS, "give one of them"),
    (("--hostfile", "/nonexistent.json"), None, "cannot read the hostfile"),
    (("--hostfile", "HOSTS", "--backend", "ring"), NO_IPS, "needs each host's \"ips\""),
    (("--hostfile", "HOSTS"), NOT_FIRST, "the first host of the group, mac2, must be this machine"),
    (("--hostfile", "HOSTS"), {"backend": "jaccl-ring", "hosts": NO_IPS}, "unknown backend 'jaccl-ring'")])
def test_a_group_asked_for_wrongly_fails_the_start_naming_why(args, hosts, says, tmp_path):
    (tmp_path / "hosts.json").write_text(json.dumps(hosts))
    args = [str(tmp_path / "hosts.json") if a == "HOSTS" else a for a in args]
    r = subprocess.run([LAUNCH_STACK, "--port", "0", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and says in r.stderr, r.stderr


def test_an_unreachable_host_fails_the_start_naming_it(tmp_path, tiny_llama):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                    {"ssh": "no-such-host.invalid", "ips": ["192.0.2.1"]}]))
    r = subprocess.run([LAUNCH_STACK, "--model", str(tiny_llama), "--hostfile", str(hostfile), "--port", "0",
                        "--cache-bytes", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "cannot reach host no-such-host.invalid" in r.stderr


def test_the_bench_probe_times_all_sums_on_a_ring_of_two():
    from bench.distributed import probe

    p = probe(2, 64, 1, 4)
    assert 0 < p["allsum_s"] < 1 and 0 < p["control_s"] < 1, p
