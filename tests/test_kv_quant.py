"""Quantized attention KV (--kv-bits, --kv-group-size; docs/memory.md, "Quantized KV"): the batch's
output equals mlx-lm's own QuantizedKVCache loop, greedy joint equals greedy baseline under the
same format (the draft's KV stays native), snapshots are reused only by servers of their format,
admission and the snapshot budget count quantized bytes, and launch-stack serves it over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from bench.tiny_models import build_tiny_model
from cache_fixtures import CacheServiceProcess, chat, reuse_engine, run_one
from conftest import FULL
from joint_fixtures import Schedule, first_divergence, greedy, run_engine
from protocol import messages as m
from stack import Stack
from worker.batch.slots import SlotKV
from worker.engine import Engine, EngineConfig, RequestError
from worker.kvformat import ATTEND_ENV, ATTEND_FORMS, NATIVE, KVFormat, attend
from worker.loader import load_model
from worker.state.checkpoint import install_recording
from worker.text import render_prompt

ARCHS = ("llama", "qwen3_5")
HEAD_DIM = 64  # the tiny models' default (16) is below mx.quantize's smallest group
Q4, Q8 = KVFormat(4, 64), KVFormat(8, 64)
PROMPTS = ["the quick brown fox", "hello world", "once upon a time", "tell me a story", "numbers 12345", "hi"]
N_TOKENS = 64 if FULL else 32
NEAR_TIE = 1e-3
SYSTEM = "You are a helpful robot who likes stories."


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Per arch: a target of head_dim 64 and a noisy copy of it as its draft."""
    root, out = tmp_path_factory.mktemp("kvq"), {}
    for arch in ARCHS:
        target = build_tiny_model(root / arch, arch, seed=0, head_dim=HEAD_DIM)
        out[arch] = target, build_tiny_model(root / f"{arch}-draft", arch, seed=1, perturb_from=target, noise=0.3)
    return out


@pytest.fixture(scope="module")
def models(paths):
    out = {arch: tuple(load_model(str(p)) for p in pair) for arch, pair in paths.items()}
    for pair in out.values():
        for lm in pair:
            install_recording(lm.model)
    return out


def quantized_cache(lm, fmt: KVFormat) -> list:
    return [QuantizedKVCache(fmt.group_size, fmt.bits) if type(c) is KVCache else c for c in make_prompt_cache(lm.model)]


def reference(lm, fmt: KVFormat, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy loop over QuantizedKVCache: the prompt in one forward, then a token a forward."""
    cache, out = quantized_cache(lm, fmt), []
    logits = lm.model(mx.array([prompt]), cache=cache)
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = lm.model(mx.array([out[-1:]]), cache=cache)
    return out


def gap(lm, fmt: KVFormat, prefix: list[int]) -> float:
    top = mx.sort(lm.model(mx.array([prefix]), cache=quantized_cache(lm, fmt))[0, -1])[-2:].tolist()
    return top[1] - top[0]


@pytest.fixture(params=ATTEND_FORMS)
def form(request, monkeypatch):
    """Each way attention reads a quantized slab (worker/kvformat.attend)."""
    monkeypatch.setenv(ATTEND_ENV, request.param)
    return request.param


@pytest.mark.parametrize("fmt", [Q4, Q8, KVFormat(4, 32)], ids=lambda f: f.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_batch_decodes_as_mlx_lms_quantized_cache(models, arch, fmt, form):
    lm = models[arch][0]
    reqs = {f"r{i}": greedy(t, N_TOKENS, mode="baseline") for i, t in enumerate(PROMPTS[:3])}
    eng = Engine(lm, EngineConfig(max_active=3, prefill_step=16, kv=fmt))
    got = run_engine(eng, reqs)
    kinds = {x.view_kind.__name__ for x in eng.runner.target.layers if isinstance(x, SlotKV)}
    assert kinds == {"QuantizedKVView" if form == "quantized" else "DequantizedKVView"}
    for rid, req in reqs.items():
        ref = reference(lm, fmt, render_prompt(lm.tokenizer, req), N_TOKENS)
        j = first_divergence(got[rid], ref)
        assert j is None or gap(lm, fmt, render_prompt(lm.tokenizer, req) + ref[:j]) < NEAR_TIE, (rid, j)


@pytest.mark.parametrize("recovery", ["fast", "replay"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_joint_equals_greedy_baseline_under_quantized_kv(models, arch, recovery, form):
    """Joint rows of one batch drafting by a schedule (every verify width, plain rounds between),
    their draft's KV native, the target's 4-bit: each output is the 4-bit baseline's."""
    target, draft = models[arch]
    base = run_engine(Engine(target, EngineConfig(max_active=len(PROMPTS), prefill_step=16, kv=Q4)),
                      {f"r{i}": greedy(t, N_TOKENS, mode="baseline") for i, t in enumerate(PROMPTS)})
    eng = Engine(target, EngineConfig(max_active=len(PROMPTS), recovery=recovery, prefill_step=16, kv=Q4), draft)
    eng.scheduler = Schedule()
    got = run_engine(eng, {f"r{i}": greedy(t, N_TOKENS) for i, t in enumerate(PROMPTS)})
    assert eng.runner.draft.kv == NATIVE and eng.runner.target.kv == Q4
    for i, text in enumerate(PROMPTS):
        j = first_divergence(got[f"r{i}"], base[f"r{i}"])
        if j is not None:
            prompt = render_prompt(target.tokenizer, greedy(text, 1))
            assert gap(target, Q4, prompt + base[f"r{i}"][:j]) < NEAR_TIE, (text, j)
    s = eng.totals.joint
    assert s.drafted > 0 and 0 < s.accepted < s.drafted and s.rollbacks > 0


def test_an_unknown_attention_form_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ATTEND_ENV, "fused")
    with pytest.raises(ValueError, match=f"{ATTEND_ENV}='fused': expected one of quantized, dequantized"):
        attend()


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshots_are_reused_only_under_their_kv_format(models, arch, tmp_path):
    """Servers sharing a --cache-dir: a native server's snapshots never serve a 4-bit one, nor the
    other way round; each hits its own, and 4-bit reuse answers as 4-bit without reuse."""
    lm, spill = models[arch][0], tmp_path / "snapshots"
    convo = [("system", SYSTEM), ("user", "hello world")]
    nxt = chat(convo + [("assistant", "ok"), ("user", "tell me a story")])
    svc = CacheServiceProcess(64 << 20).start()
    try:
        native = reuse_engine(lm, svc, spill_dir=spill)
        run_one(native, chat(convo))
        native.reuse.store.flush()
        q4 = reuse_engine(lm, svc, spill_dir=spill, kv=Q4)  # a restarted worker: finds the native files
        assert q4.reuse.store.snapshots and run_one(q4, chat(convo))[1].reused_tokens == 0
        got, metrics = run_one(q4, nxt)
        assert metrics.reused_tokens > 0  # its own snapshot of the first turn
        assert got == run_one(Engine(lm, EngineConfig(kv=Q4)), nxt)[0]
        q4.reuse.store.flush()
        again = reuse_engine(lm, svc, spill_dir=spill)  # native again, on both formats' files
        assert run_one(again, chat(convo))[1].reused_tokens > 0
        q4_files = reuse_engine(lm, svc, spill_dir=spill, kv=Q4)
        assert run_one(q4_files, nxt)[1].reused_tokens >= metrics.reused_tokens  # read back from its file
        assert run_one(reuse_engine(lm, svc, spill_dir=spill, kv=Q8), nxt)[1].reused_tokens == 0
    finally:
        svc.stop()


def kv_bytes_per_token(lm, fmt: KVFormat) -> int:
    """The model's own arithmetic: 2 * attention layers * kv heads * (head_dim * bits / 8 + 2
    (scale, bias) * head_dim / group * the dtype's bytes); native: head_dim * the dtype's bytes."""
    cfg = lm.model.args
    cfg = getattr(cfg, "text_config", None) or cfg.__dict__
    layers = cfg["num_hidden_layers"] // cfg.get("full_attention_interval", 1)
    size = 4  # float32 weights
    per_head = HEAD_DIM * size if fmt.bits is None else HEAD_DIM * fmt.bits // 8 + 2 * HEAD_DIM // fmt.group_size * size
    return 2 * layers * cfg["num_key_value_heads"] * per_head


@pytest.mark.parametrize("arch", ARCHS)
def test_admission_and_snapshots_count_quantized_bytes(models, arch):
    lm = models[arch][0]
    engines = {fmt: Engine(lm, EngineConfig(kv=fmt)) for fmt in (NATIVE, Q8, Q4)}
    for fmt, eng in engines.items():
        assert eng.cache_cost.per_token == kv_bytes_per_token(lm, fmt), fmt
    req = m.GenerateRequest(prompt="hello world", max_tokens=200, temperature=0.0)
    need = {fmt: eng._worst_case(req, eng.lm.tokenizer.encode("hello world")) for fmt, eng in engines.items()}
    budget = (need[Q4] + need[Q8]) // 2  # fits 4-bit, not 8-bit nor native
    for fmt, admitted in ((NATIVE, False), (Q8, False), (Q4, True)):
        eng = Engine(lm, EngineConfig(kv=fmt, kv_budget=budget))
        if admitted:
            eng.submit("r", req)
        else:
            with pytest.raises(RequestError) as e:
                eng.submit("r", req)
            assert e.value.code == "kv_budget_exceeded"
    svc = CacheServiceProcess(64 << 20).start()
    try:
        for fmt in (NATIVE, Q4):
            eng = reuse_engine(lm, svc, kv=fmt)
            run_one(eng, chat([("system", SYSTEM), ("user", "hello world")]))
            for snap in eng.reuse.store.snapshots.values():
                assert snap.meta.nbytes == eng.cache_cost.worst_case(len(snap.meta.tokens)), fmt
    finally:
        svc.stop()
    assert kv_bytes_per_token(lm, Q4) <= 0.3 * kv_bytes_per_token(lm, NATIVE)


class RollingQuantized(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache masked as a rotating window of `window` keeping the first `keep`."""

    def __init__(self, fmt: KVFormat, window: int, keep: int):
        super().__init__(fmt.group_size, fmt.bits)
        self.window, self.keep = window, keep

    def make_mask(self, n: int, **_):
        q, k = self.offset + mx.arange(n), mx.arange(self.offset + n)
        return (k[None] <= q[:, None]) & ((k[None] < self.keep) | (k[None] > q[:, None] - (self.window - self.keep)))


def test_a_rolling_row_decodes_past_the_window_under_quantized_kv(models):
    """context_overflow "rolling" with 8-bit KV: the mask hides what a rotating cache drops, as
    for native KV; the output equals a greedy loop over QuantizedKVCache masked so."""
    from worker.context import ROLLING_KEEP

    lm, window, n = models["llama"][0], 48, 80
    req = m.GenerateRequest(messages=[m.Message("user", "the quick brown fox")], max_tokens=n, temperature=0.0,
                            ignore_eos=True, context_overflow="rolling")
    got = run_one(Engine(lm, EngineConfig(kv=Q8, max_context=window)), req)[0]
    cache = [RollingQuantized(Q8, window, ROLLING_KEEP) for _ in make_prompt_cache(lm.model)]
    prompt, ref = render_prompt(lm.tokenizer, req), []
    logits = lm.model(mx.array([prompt]), cache=cache)
    for _ in range(n):
        ref.append(int(mx.argmax(logits[0, -1]).item()))
        logits = lm.model(mx.array([ref[-1:]]), cache=cache)
    assert len(prompt) + n > window + 20 and got == ref
    assert got != reference(lm, Q8, prompt, n)  # the window moved: not what the whole history gives


def test_launch_stack_serves_4_bit_kv_over_http(models, paths):
    lm = models["llama"][0]
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "temperature": 0, "max_tokens": 12,
            "ignore_eos": True}
    want = run_one(Engine(lm, EngineConfig(kv=Q4)), chat([("user", "tell me a story")], 12))[0]
    with Stack(str(paths["llama"][0]), "--kv-bits", "4", "--kv-group-size", "64") as s:
        answers = [post(s.url, body) for _ in range(2)]
        info = json.loads(urllib.request.urlopen(s.url + "/v1/verity/info", timeout=30).read())
    assert info["kv_format"] == "q4g64"
    assert s.exit_code == 0, s.log()
    assert answers[0]["choices"][0]["message"]["content"] == lm.tokenizer.decode(want)
    assert answers[1]["choices"][0]["message"]["content"] == answers[0]["choices"][0]["message"]["content"]
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("flags, says", [
    (("--kv-bits", "4", "--kv-group-size", "128"), "does not divide this model's attention head_dim (64)"),
    (("--kv-group-size", "64"), "--kv-group-size needs --kv-bits"),
    (("--kv-bits", "3"), "--kv-bits: invalid choice: 3"),
    (("--kv-bits", "4", f"{ATTEND_ENV}=fused"), f"{ATTEND_ENV}='fused': expected one of quantized, dequantized")])
def test_a_kv_format_the_server_cannot_give_stops_the_start(paths, flags, says):
    env = dict(os.environ, **dict(f.split("=", 1) for f in flags if "=" in f))
    run = subprocess.run([sys.executable, "-m", "cli.launch", "--model", str(paths["llama"][0]), "--port", "0",
                          "--cache-bytes", "0", *(f for f in flags if "=" not in f)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode != 0 and says in run.stderr, run.stderr[-2000:]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())
