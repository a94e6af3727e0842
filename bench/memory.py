"""`verity bench memory`: the attention KV's memory and decode speed by KV format (--kv-bits),
bf16 against 8-bit and 4-bit, at long contexts (docs/memory.md, "Quantized KV").

For each shape (a llama and a qwen3_5, random weights) and context, each format in turn: the
engine's batch (worker/batch/) holds one row whose prompt is the context, prefills it and
decodes; printed are the KV bytes per token the slabs hold beside the model's own arithmetic
(2 * attention layers * kv heads * head_dim * bytes; quantized: head_dim * bits / 8 packed plus a
scale and a bias a group), MLX's active and peak memory, the process's resident memory, and
decode tokens/s of every repeat. Shapes: Llama-3.1-8B and Qwen3.5-9B (`--small`: tiny ones for
the CPU, where the contexts default smaller: a 2-core CPU prefills 32k tokens too slowly).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from bench import common as bench

CONTEXTS = {"gpu": (1024, 8192, 32768), "cpu": (1024, 2048, 4096)}
FORMATS = ("bf16", "q8", "q4")
GOALS = dict(q4_bytes_vs_bf16=0.3, q4_decode_vs_bf16_at_8k=0.9)

LLAMA_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False)
LLAMA_SMALL = dict(LLAMA_8B, hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096)


@dataclass
class Measured:
    shape: str
    context: int
    kv: str
    bytes_per_token: float  # what the slabs hold, per position
    arithmetic: int  # the model's own figure
    kv_bytes: int  # the slabs at this context (their capacity)
    active: int  # MLX's active memory after the prefill, less before the row joined
    peak_prefill: int
    peak_decode: int
    rss: int  # VmRSS after the decode
    prefill_s: float
    tps: list[float]  # decode tokens/s, each repeat

    @property
    def median_tps(self) -> float:
        return statistics.median(self.tps)


def shapes(small: bool) -> dict[str, dict]:
    """name -> (config) of each shape measured."""
    from bench import gpu_models as gm

    if small:
        qwen = dict(gm.TARGET_9B, **gm.SMALL, full_attention_interval=2)
        return {"llama": LLAMA_SMALL, "qwen3_5": qwen}
    return {"llama": LLAMA_8B, "qwen3_5": gm.TARGET_9B}


def build(config: dict, dtype):
    import mlx.core as mx
    from mlx_lm.models import llama, qwen3_5

    if config["model_type"] == "llama":
        model = llama.Model(llama.ModelArgs.from_dict(config))
    else:
        model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": config}))
    mx.random.seed(0)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def arithmetic(config: dict, fmt, itemsize: int) -> int:
    """2 * attention layers * kv heads * one head's bytes a position."""
    layers = config["num_hidden_layers"] // config.get("full_attention_interval", 1)
    return 2 * layers * config["num_key_value_heads"] * fmt.bytes_per_position(config["head_dim"], itemsize)


def kv_format(name: str, group_size: int):
    from worker.kvformat import KVFormat

    return KVFormat() if name == "bf16" else KVFormat(int(name[1:]), group_size)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(name: str, config: dict, model, context: int, kv: str, args: argparse.Namespace) -> Measured:
    """One row of `context` tokens in the batch under one KV format: prefill, then the repeats."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from worker.batch.rows import Phase, Row
    from worker.batch.runner import BatchRunner
    from worker.batch.slots import SlotKV
    from worker.joint.sampling import make_key_fn
    from worker.sampling import RowSampling

    fmt = kv_format(kv, args.kv_group_size)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    rng = random.Random(context)
    prompt = [rng.randrange(1, config["vocab_size"]) for _ in range(context)]
    runner = BatchRunner(model, None, args.prefill_step, kv=fmt)
    runner.join(Row("m", prompt, RowSampling(), make_key_fn(0)))
    with mx.stream(generation_stream):
        t0 = time.perf_counter()
        while runner.rows["m"].phase == Phase.PREFILL:
            runner.prefill()
        mx.eval(runner.target.arrays())
        prefill_s = time.perf_counter() - t0
        active, peak_prefill = mx.get_active_memory() - before, mx.get_peak_memory()
        mx.reset_peak_memory()
        tps = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(args.tokens):
                runner.decode({})
            runner.decode({})  # reads the last round's token: every timed token is computed
            tps.append(args.tokens / (time.perf_counter() - t))
    slabs = [x for x in runner.target.layers if isinstance(x, SlotKV)]
    per_position = sum(p.nbytes / (p.shape[0] * p.shape[2]) for x in slabs for p in x.parts())
    itemsize = slabs[0].keys[-1].dtype.size  # the scales' (or the keys') dtype: the model's
    m = Measured(name, context, kv, per_position, arithmetic(config, fmt, itemsize),
                 sum(x.nbytes for x in slabs), active, peak_prefill, mx.get_peak_memory(), rss(), prefill_s, tps)
    del runner
    mx.clear_cache()
    return m


def run_memory(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from bench import gpu_models as gm
    from worker.backend_env import apply

    apply()
    where = "gpu" if mx.default_device() == mx.gpu else "cpu"
    contexts = args.contexts or CONTEXTS["cpu" if args.small else where]
    results: list[Measured] = []
    for name, config in shapes(args.small).items():
        if args.shapes and name not in args.shapes:
            continue
        bench.progress(f"device {gm.device()}: building {name} ({'small' if args.small else 'full'} shape)")
        model = build(config, gm.DTYPES[args.dtype])
        weights = sum(v.nbytes for v in _leaves(model))
        for context in contexts:
            for kv in args.formats:
                m = measure(name, config, model, context, kv, args)
                results.append(m)
                bench.progress(f"{name} {context} {kv}: {m.bytes_per_token:.0f} B/token (arithmetic {m.arithmetic}), "
                               f"prefill {m.prefill_s:.1f}s, decode tok/s " + " ".join(f"{t:.1f}" for t in m.tps))
        bench.progress(f"{name}: weights {weights / 2**20:.0f} MiB")
        del model
    _report(results, args, where, contexts)
    return 0


def _leaves(model):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters())]


def _report(results: list[Measured], args: argparse.Namespace, where: str, contexts) -> None:
    """Two tables (memory, then speed) and the JSON figures."""
    from bench import gpu_models as gm

    mib = 2**20
    base = {(m.shape, m.context): m for m in results if m.kv == "bf16"}
    memory_rows, speed_rows, figs = [], [], []
    for m in results:
        b = base.get((m.shape, m.context))
        bytes_vs = m.bytes_per_token / b.bytes_per_token if b else float("nan")
        tps_vs = m.median_tps / b.median_tps if b else float("nan")
        key = (m.shape, str(m.context), m.kv)
        memory_rows.append((*key, f"{m.bytes_per_token:.0f}", str(m.arithmetic), f"{bytes_vs:.3f}",
                            f"{m.kv_bytes / mib:.1f}", f"{m.active / mib:.1f}", f"{m.peak_prefill / mib:.0f}",
                            f"{m.peak_decode / mib:.0f}", f"{m.rss / mib:.0f}"))
        speed_rows.append((*key, f"{m.prefill_s:.1f}", " ".join(f"{t:.1f}" for t in m.tps), f"{m.median_tps:.1f}",
                           f"{tps_vs:.2f}"))
        figs.append({**m.__dict__, "median_tps": m.median_tps, "bytes_vs_bf16": bytes_vs, "tps_vs_bf16": tps_vs})
    goals = _goals(results, base)
    q4 = [f["bytes_vs_bf16"] for f in figs if f["kv"] == "q4"]
    fig = {"ratio": max(q4) if q4 else None,  # the headline: 4-bit KV bytes ÷ bf16's, the largest
           "device": gm.device(), "small": args.small, "dtype": args.dtype, "contexts": list(contexts),
           "tokens": args.tokens, "repeats": args.repeats, "group_size": args.kv_group_size, "goals": goals,
           "results": figs}
    bench.print_report("verity bench memory: KV bytes (MiB: the slabs; MLX active after the prefill; peaks; VmRSS)",
                       memory_rows, ("shape", "ctx", "KV", "B/token", "arithmetic", "÷ bf16", "KV MiB", "active",
                                     "peak prefill", "peak decode", "RSS"), fig, False)
    footer = (f"device {fig['device']}, weights {args.dtype}, {args.tokens} tokens a repeat, "
              f"group size {args.kv_group_size}; goals: {goals}"
              + ("; contexts below 32k: a 2-core CPU prefills 32k tokens too slowly (--contexts to change)"
                 if where == "cpu" and not args.contexts else ""))
    bench.print_report("verity bench memory: speed", speed_rows, (
        "shape", "ctx", "KV", "prefill s", "decode tok/s, each repeat", "median", "÷ bf16"), fig, args.json, footer)


def _goals(results: list[Measured], base: dict) -> dict:
    out = {}
    for m in results:
        b = base.get((m.shape, m.context))
        if m.kv != "q4" or b is None:
            continue
        out[f"{m.shape} q4 bytes ≤ {GOALS['q4_bytes_vs_bf16']} × bf16"] = (
            "met" if m.bytes_per_token <= GOALS["q4_bytes_vs_bf16"] * b.bytes_per_token else "missed")
        if m.context == 8192:
            ratio = m.median_tps / b.median_tps
            out[f"{m.shape} q4 decode at 8k ≥ {GOALS['q4_decode_vs_bf16_at_8k']} × bf16"] = (
                f"{'met' if ratio >= GOALS['q4_decode_vs_bf16_at_8k'] else 'missed'} ({ratio:.2f})")
    return out


def add_command(benches) -> None:
    p = benches.add_parser("memory", help="KV memory and decode tok/s by KV format (bf16, 8-bit, 4-bit) at long contexts")
    p.add_argument("--small", action="store_true", help="tiny shapes (the CPU); default: Llama-3.1-8B and Qwen3.5-9B")
    p.add_argument("--shapes", nargs="+", choices=("llama", "qwen3_5"), default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=None,
                   help=f"default {CONTEXTS['gpu']} on a GPU, {CONTEXTS['cpu']} with --small or on the CPU")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="the weights' and bf16 KV's dtype")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens a repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_memory)
