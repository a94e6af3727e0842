"""`verity bench gpu-batch`: many requests at real sizes on a GPU (Qwen3.5-9B target, 0.8B draft
shapes, random weights; `--small` shrinks them for a check anywhere).

At each N, alternated over the repeats in one run: mlx-lm's `BatchGenerator` on N prompts; verity's
batched round (worker/round.py, as the engine runs it) on the same prompts, every row baseline;
and every row joint with the adaptive scheduler, its draft accepting α of the target's tokens by
construction (bench/drafters.py, ForcedDrafter: random weights accept nothing on their own). The
aggregate decode tokens/s counts from the round where every row has its first token. The batched
roofline: one step reads the weights once and each row's cache (KV of its context, recurrent state).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from bench import common as bench

NS = (1, 8, 32, 64)
GOALS = dict(roofline_at_32=0.50, vs_batch_generator=1.0, adaptive_vs_plain=0.97)


@dataclass
class Run:
    tokens_per_s: float
    tokens: list[list[int]]
    drafted: int = 0
    accepted: int = 0


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def batch_generator(model, prompts: list[list[int]], n_tokens: int) -> Run:
    """mlx-lm's BatchGenerator, greedy, every prompt at once."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generation_stream

    gen = BatchGenerator(model, max_tokens=n_tokens, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts), prefill_step_size=2048)
    uids = gen.insert(prompts)
    row = {u: i for i, u in enumerate(uids)}
    out: list[list[int]] = [[] for _ in prompts]
    t0 = counted = None
    with mx.stream(generation_stream):
        while any(len(t) < n_tokens for t in out):
            _, generated = gen.next()
            for r in generated:
                out[row[r.uid]].append(r.token)
            if t0 is None and all(out):
                t0, counted = time.perf_counter(), sum(map(len, out))
    wall = time.perf_counter() - t0
    gen.close()
    return Run((sum(map(len, out)) - counted) / wall, out)


def verity_round(target, prompts: list[list[int]], n_tokens: int, draft=None, reference=None,
                 alpha: float = 0.8, vocab: int = 0, sched=None) -> Run:
    """verity's engine round over the prompts: baseline rows in one BaselineBatch, or (with a
    draft) joint rows under the adaptive scheduler (`sched`, kept warm across runs as a server's
    is), batched and parked as the engine does."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from bench.drafters import ForcedDecoder, ForcedDrafter
    from worker.baseline import BaselineBatch, BaselineRow
    from worker.joint.batch import joint_round
    from worker.joint.guests import round_groups
    from worker.joint.parked import Parking
    from worker.joint.sampling import SamplingParams
    from worker.round import Row, plan_round, run_round
    from worker.scheduler import Scheduler

    batch = BaselineBatch(target, 2048, len(prompts))
    sched, parking = sched or Scheduler(), Parking(batch)
    decoders = {}
    for i, p in enumerate(prompts):
        if draft is None:
            decoders[f"r{i}"] = BaselineRow(batch, p, 0.0, 1.0, None)
        else:
            drafter = ForcedDrafter(draft, reference[i], lambda _: alpha, vocab, recovery="fast")
            decoders[f"r{i}"] = ForcedDecoder(target, drafter, p, SamplingParams(), recovery="fast")
    out = {rid: [] for rid in decoders}

    def emit(row: Row, tokens: list[int]) -> int:
        keep = min(len(tokens), n_tokens - len(out[row.request_id]))
        out[row.request_id].extend(tokens[:keep])
        return keep

    def fail(row: Row, e: Exception) -> None:
        raise e

    active, t0, counted = dict(decoders), None, 0
    with mx.stream(generation_stream):
        while active:
            rows = [Row(rid, d, n_tokens - len(out[rid])) for rid, d in active.items()]
            sr = plan_round(rows, sched, True)
            parking.apply(sr, fail)
            sched.observe(run_round(sr, emit, fail, round_groups(sr, batch, joint_round)))
            if t0 is None and all(out.values()):
                t0, counted = time.perf_counter(), sum(map(len, out.values()))
            for rid in [rid for rid in active if len(out[rid]) >= n_tokens]:
                active.pop(rid).close()
                sched.forget(rid)
                parking.forget(rid)
    wall = time.perf_counter() - t0
    stats = [d.stats for d in decoders.values() if d.stats is not None]
    return Run((sum(map(len, out.values())) - counted) / wall, list(out.values()),
               sum(s.drafted for s in stats), sum(s.accepted for s in stats))


def roofline(target, copy_bps: float, weight_bytes: int, n: int, context: int) -> float:
    """Tokens/s if a step read the weights once and each row's cache at `context`, at copy speed."""
    from worker import memory

    cost = memory.cache_cost(target)
    return n * copy_bps / (weight_bytes + n * cost.worst_case(context))


def run_gpu_batch(args: argparse.Namespace) -> int:
    from worker.backend_env import apply

    apply()
    from bench import gpu_rounds as gb

    tcfg, dcfg = dict(gb.TARGET_9B), dict(gb.DRAFT_08B)
    if args.small:
        tcfg.update(gb.SMALL)
        dcfg.update(gb.SMALL, hidden_size=128, intermediate_size=256)
    bench.progress(f"device {gb.device()}: building the target and the draft")
    target, draft = gb.build(tcfg, gb.DTYPES["bf16"], 0), gb.build(dcfg, gb.DTYPES["bf16"], 1)
    copy_bps = gb.copy_bandwidth(256 << 20 if args.small else 2 << 30)
    weight_bytes = gb.bytes_per_token(target, tcfg)
    vocab = tcfg["vocab_size"]
    fig: dict = {"device": gb.device(), "copy_bandwidth_GBps": copy_bps / 1e9, "ns": {}, "alpha": args.alpha}
    rows = []
    for n in args.ns:
        prompts = _prompts(n, args.prompt_tokens, vocab)
        from worker.scheduler import Scheduler

        batch_generator(target, prompts, 4)  # every shape of this N once before timing, and a warm scheduler
        ref = verity_round(target, prompts, args.tokens).tokens
        sched = Scheduler()
        verity_round(target, prompts, args.tokens, draft, ref, args.alpha, vocab, sched)
        runs: dict[str, list[Run]] = {"bg": [], "plain": [], "adaptive": []}
        for rep in range(args.repeats):
            runs["bg"].append(batch_generator(target, prompts, args.tokens))
            runs["plain"].append(verity_round(target, prompts, args.tokens))
            runs["adaptive"].append(verity_round(target, prompts, args.tokens, draft, ref, args.alpha, vocab, sched))
            bench.progress(f"N={n} repeat {rep + 1}: " + ", ".join(f"{k} {v[-1].tokens_per_s:.1f}" for k, v in runs.items()))
        fig["ns"][n] = _figures(runs, roofline(target, copy_bps, weight_bytes, n, args.prompt_tokens + args.tokens // 2))
        f = fig["ns"][n]
        rows.append((str(n), f"{f['bg']:.1f}", f"{f['plain']:.1f}", f"{f['plain_vs_bg']:.2f} {f['plain_vs_bg_pairs']}",
                     f"{f['plain_vs_roofline']:.0%}", f"{f['adaptive']:.1f}",
                     f"{f['adaptive_vs_plain']:.2f} {f['adaptive_vs_plain_pairs']}", f"{f['acceptance']:.2f}",
                     str(f["rows_equal_bg"])))
    fig["goals"] = _goals(fig)
    fig["ratio"] = min(f["plain_vs_bg"] for f in fig["ns"].values())
    bench.print_report("verity bench gpu-batch", rows, ("N", "BG tok/s", "plain tok/s", "plain ÷ BG (pairs)", "roofline",
                                                        "adaptive tok/s", "adaptive ÷ plain (pairs)", "accept", "= BG rows"),
                       fig, args.json, _footer(fig))
    return 0


def _figures(runs: dict[str, list["Run"]], roof: float) -> dict:
    med = {k: statistics.median(r.tokens_per_s for r in v) for k, v in runs.items()}
    pairs = lambda a, b: [round(x.tokens_per_s / y.tokens_per_s, 3) for x, y in zip(runs[a], runs[b])]
    joint = runs["adaptive"]
    drafted = sum(r.drafted for r in joint)
    return dict(bg=med["bg"], plain=med["plain"], adaptive=med["adaptive"], roofline_tps=roof,
                plain_vs_roofline=med["plain"] / roof,
                plain_vs_bg=statistics.median(pairs("plain", "bg")), plain_vs_bg_pairs=pairs("plain", "bg"),
                adaptive_vs_plain=statistics.median(pairs("adaptive", "plain")),
                adaptive_vs_plain_pairs=pairs("adaptive", "plain"),
                acceptance=sum(r.accepted for r in joint) / drafted if drafted else 0.0,
                drafted_per_token=drafted / sum(len(t) for r in joint for t in r.tokens),
                rows_equal_bg=sum(a == b for a, b in zip(runs["plain"][0].tokens, runs["bg"][0].tokens)))


def _goals(fig: dict) -> dict:
    ns = fig["ns"]
    return {"roofline_at_32": ns[32]["plain_vs_roofline"] >= GOALS["roofline_at_32"] if 32 in ns else None,
            "vs_batch_generator": all(f["plain_vs_bg"] >= GOALS["vs_batch_generator"] for f in ns.values()),
            "adaptive_vs_plain": all(f["adaptive_vs_plain"] >= GOALS["adaptive_vs_plain"] for f in ns.values())}


def _footer(fig: dict) -> str:
    return (f"device {fig['device']}, copy {fig['copy_bandwidth_GBps']:.0f} GB/s; α = {fig['alpha']} by the draft's "
            f"intent; ratios: medians of the repeats' pairs (each pair run back to back); '= BG rows': rows whose "
            f"greedy tokens equal BatchGenerator's (bf16 near-ties flip some); goals {GOALS}: {fig['goals']}")


def add_command(benches) -> None:
    p = benches.add_parser("gpu-batch", help="batched decoding at real sizes on a GPU against mlx-lm's BatchGenerator")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check on any device)")
    p.add_argument("--ns", type=int, nargs="+", default=list(NS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_gpu_batch)
