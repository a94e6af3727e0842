"""`verity bench gpu-batch`: many requests at real sizes on a GPU (Qwen3.5-9B target, 0.8B draft
shapes, random weights; `--small` shrinks them for a check anywhere).

At each N, alternated over the repeats in one run: mlx-lm's `BatchGenerator` on N prompts;
verity's batch (worker/batch/, the engine's round) with every row baseline ("plain"); every row
joint under the adaptive scheduler, its draft accepting α of the target's tokens by construction
(bench/drafters.py: random weights accept nothing on their own), for each α asked; and at the
`--mixed` sizes half the rows joint (α the first one), half baseline. Each joint configuration's
scheduler starts cold at the first timed repeat and is kept across the repeats, as a server's is:
its figure is every repeat's tokens over every repeat's time, probes included, and each repeat's
drafted and accepted tokens are printed. Decode tokens/s count from the round where every row has
its first token. The batched roofline: one step reads the weights once and each row's cache.
`--fixed K...` adds every row joint at a fixed draft length (the ceiling any schedule could reach);
`--log-dir` writes each joint configuration's decision log; stall rounds print their shape; each
repeat's line ends with MLX's active, cache and peak memory and the GPU's used memory.
`--bits 4|8` quantizes target and draft weights (group 64): the second table, its roofline read
from the quantized bytes.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from bench import common as bench
from bench.divergence import first_divergence, top2_gap

NS = (1, 8, 32, 64)
GOALS = dict(roofline={32: 0.50, 64: 0.60}, vs_batch_generator={1: 1.0, 8: 1.0, 32: 1.3, 64: 1.3},
             adaptive_vs_plain={1: 1.4, 8: 1.25, 32: 1.1, 64: 0.97}, high_alpha=0.8, low_alpha=0.97, mixed=0.97)


@dataclass
class Run:
    tokens: list[list[int]]
    decoded: int  # tokens after every row had its first
    seconds: float  # from then to the end
    drafted: int = 0
    accepted: int = 0
    rounds: list = field(default_factory=list)  # each timed round's seconds
    shapes: list = field(default_factory=list)  # each timed round's (rows, widest draft, drafted tokens)
    one_launch: str = ""  # the draft's one-launch step after the run: on, timed out (its flag set), off
    differ: list = field(default_factory=list)  # its `divergences` from plain's tokens

    @property
    def stalls(self) -> str:
        """Rounds over 5x the median round (a kernel compiled for a new shape, say): count, seconds,
        and each one's (rows, widest draft, drafted) and seconds."""
        if not self.rounds:
            return ""
        med = statistics.median(self.rounds)
        slow = [(r, s) for r, s in zip(self.rounds, self.shapes) if r > 5 * med]
        if not slow:
            return "0"
        each = " ".join(f"{s[0]}x{s[1]}/{s[2]}={r:.2f}" for r, s in slow)
        return f"{len(slow)}:{sum(r for r, _ in slow):.2f}s ({each})"

    @property
    def pace(self) -> str:
        """The median plain and drafting round (ms) and their counts: a run slower in every round
        tells apart from one slowed by a few rounds."""
        kinds = (("plain", [r for r, s in zip(self.rounds, self.shapes) if not s[2]]),
                 ("drafting", [r for r, s in zip(self.rounds, self.shapes) if s[2]]))
        return ", ".join(f"{name} {1e3 * statistics.median(rs):.1f} ms x{len(rs)}" for name, rs in kinds if rs)

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.seconds if self.seconds > 0 else 0.0


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
    return Run(out, sum(map(len, out)) - counted, wall)


def verity_run(target, prompts: list[list[int]], n_tokens: int, draft=None, reference=None, alpha: float = 0.8,
               vocab: int = 0, sched=None, joint_every: int = 1, draft_forward=None) -> Run:
    """The engine's round over the prompts: every row baseline, or (with a draft) every
    `joint_every`-th row joint under `sched` with acceptance α by construction; `draft_forward`:
    the draft's forward as the engine runs it (worker/kernels/fast_draft.py where it runs)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from bench.drafters import Controlled
    from worker.batch.rows import Row
    from worker.batch.runner import BatchRunner, play
    from worker.joint.sampling import make_key_fn
    from worker.sampling import RowSampling
    from worker.scheduler import Scheduler

    runner, sched = BatchRunner(target, draft, 2048, draft_forward=draft_forward), sched or Scheduler()
    out: dict[str, list[int]] = {}
    rows = {}
    for i, p in enumerate(prompts):
        joint = draft is not None and i % joint_every == 0
        c = Controlled(reference[i], lambda _: alpha, vocab, seed=i) if joint else None
        row = Row(f"r{i}", p, RowSampling(), make_key_fn(0), joint=joint, chooser=c and c.choose,
                  acceptor=c and c.accept_by_intent)
        rows[row.id], out[row.id] = row, []
        runner.join(row)
    t0 = counted = None
    rounds, shapes, planner = [], [], _Planner(sched)
    with mx.stream(generation_stream):
        while runner.rows:
            r0 = time.perf_counter()
            rnd = play(runner, planner, lambda rid: n_tokens - len(out[rid]))
            for o in rnd.decoded.outcomes:
                out[o.id] += o.tokens[: n_tokens - len(out[o.id])]
            sched.observe(rnd.report())
            if t0 is not None:
                rounds.append(time.perf_counter() - r0)
                b = planner.last.budgets
                shapes.append((len(rnd.decoding), max(b.values(), default=0), sum(b.values())))
            if t0 is None and all(out.values()):
                t0, counted = time.perf_counter(), sum(map(len, out.values()))
            for rid in [rid for rid in runner.rows if len(out[rid]) >= n_tokens]:
                runner.leave(rid)
                sched.forget(rid)
    wall = time.perf_counter() - t0
    stats = [r.stats for r in rows.values() if r.stats is not None]
    return Run(list(out.values()), sum(map(len, out.values())) - counted, wall,
               sum(s.drafted for s in stats), sum(s.accepted for s in stats), rounds, shapes,
               _one_launch(draft_forward))


class Divergence(NamedTuple):
    """A row whose tokens differ from plain's: the first differing position and the target's
    top-two logit gap there (a JSON list in the figures)."""

    row: int
    at: int
    gap: float


def divergences(target, prompts: list[list[int]], ref: list[list[int]], got: list[list[int]]) -> list[Divergence]:
    """Rows of `got` that differ from plain's `ref`. A wide forward rounds otherwise than one-token
    ones, so with random bf16 weights near-ties flip (docs/design.md, "Exactness"); a gap far above
    bf16's rounding points at a fault."""
    out = []
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        at = first_divergence(b, a)
        if at is not None:
            out.append(Divergence(i, at, round(top2_gap(target, p + a[:at]), 4)))
    return out


def said_divergences(run: Run, rows: int, of: str = "plain") -> str:
    """`= plain 7/8 [row 3 at 37: gap 0.0156]`: rows equal to the reference's, and where not."""
    each = "; ".join(f"row {d.row} at {d.at}: gap {d.gap}" for d in run.differ)
    return f"= {of} {rows - len(run.differ)}/{rows}" + (f" [{each}]" if each else "")


def _said_run(name: str, run: Run, rows: int) -> str:
    """A configuration's repeat: tokens/s, drafted/accepted, stalls, round pace, the draft's one
    launch, and its rows against plain's (plain's against the first plain run's)."""
    out = f"{name} {run.tokens_per_s:.1f}" + (f" ({run.drafted}/{run.accepted})" if run.drafted else "")
    out += f" [stalls {run.stalls}]" + (f" [rounds {run.pace}]" if run.rounds else "")
    out += f" [one launch {run.one_launch}]" if run.one_launch else ""
    if name != "bg":
        out += f" [{said_divergences(run, rows, 'first plain' if name == 'plain' else 'plain')}]"
    return out


def _one_launch(forward) -> str:
    """Whether the draft's one-launch step is on, timed out in a barrier since it was last asked, or off."""
    from worker.kernels import persistent_draft

    if forward is None:
        return ""
    if forward.one is None:
        return "off"
    return "timed out" if persistent_draft.failed(forward.one) else "on"


class _Planner:
    """The scheduler, its last plan kept (a round's shape for the stalls' report)."""

    def __init__(self, sched):
        self.sched, self.last = sched, None

    def plan_round(self, inp):
        self.last = self.sched.plan_round(inp)
        return self.last


def roofline(target, copy_bps: float, weight_bytes: int, n: int, context: int) -> float:
    """Tokens/s if a step read the weights once and each row's cache at `context`, at copy speed."""
    from worker import memory

    cost = memory.cache_cost(target)
    return n * copy_bps / (weight_bytes + n * cost.worst_case(context))


@dataclass(frozen=True)
class Config:
    """A joint configuration at one N: every `every`-th row joint, its draft accepting α of the
    target's tokens; `fixed`: every joint row drafts that deep (None: the adaptive scheduler)."""

    name: str
    alpha: float
    every: int = 1
    fixed: Optional[int] = None


def _configs(args: argparse.Namespace, n: int) -> list[Config]:
    """Each joint configuration at this N."""
    out = [Config(f"adaptive α={a}", a) for a in args.alphas]
    if n in args.mixed and n > 1:
        out.append(Config(f"mixed α={args.alphas[0]}", args.alphas[0], 2))
    out += [Config(f"fixed k={k} α={args.alphas[0]}", args.alphas[0], fixed=k) for k in args.fixed]
    return out


def _scheduler(args: argparse.Namespace, n: int, config: Config):
    """A configuration's scheduler, its decision log under `--log-dir`."""
    from pathlib import Path

    from worker.scheduler import Scheduler

    log = None
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9.]+", "-", config.name.replace("α", "a"))
        log = str(Path(args.log_dir) / f"N{n}-{name}.jsonl")  # letters, digits, dots and dashes only
    return Scheduler(fixed=config.fixed, log_path=log)


def _measure(args, target, draft, vocab: int, n: int) -> dict[str, list[Run]]:
    """Every configuration at N, alternated over the repeats; kernels warmed first, untimed."""
    from worker.batch.runner import BatchRunner
    from worker.kernels import fast_draft
    from worker.scheduler import Scheduler

    forward = fast_draft.where_it_runs(draft)  # as the engine runs a draft
    if forward is not None and args.sublayers:
        forward = fast_draft.narrow_forward(draft, persistent=False, widest=1)

    prompts = _prompts(n, args.prompt_tokens, vocab)
    took = [time.perf_counter()]
    batch_generator(target, prompts, 4)
    took.append(time.perf_counter())
    BatchRunner(target, draft, 2048, draft_forward=forward).warm(prompts[0], 9)  # as the engine's warm-up
    took.append(time.perf_counter())
    ref = verity_run(target, prompts, args.tokens).tokens
    took.append(time.perf_counter())
    configs = _configs(args, n)
    verity_run(target, prompts, args.tokens, draft, ref, args.alphas[0], vocab, Scheduler(), 1, forward)  # scheduler dropped
    took.append(time.perf_counter())
    bench.progress(f"N={n} warm-up (kernels compile on a fresh GPU): " + ", ".join(
        f"{what} {b - a:.1f} s" for what, a, b in zip(("BG", "runner", "plain", "joint"), took, took[1:])))
    runs: dict[str, list[Run]] = {"bg": [], "plain": [], **{c.name: [] for c in configs}}
    scheds = {c.name: _scheduler(args, n, c) for c in configs}  # cold at the first timed repeat
    for rep in range(args.repeats):
        runs["bg"].append(batch_generator(target, prompts, args.tokens))
        runs["plain"].append(verity_run(target, prompts, args.tokens))
        runs["plain"][-1].differ = divergences(target, prompts, ref, runs["plain"][-1].tokens)  # same shapes: a fault
        for c in configs:
            runs[c.name].append(verity_run(target, prompts, args.tokens, draft, ref, c.alpha, vocab, scheds[c.name],
                                           c.every, forward))
            runs[c.name][-1].differ = divergences(target, prompts, ref, runs[c.name][-1].tokens)
            scheds[c.name].flush_log()
        bench.progress(f"N={n} repeat {rep + 1}: " + ", ".join(_said_run(k, v[-1], n) for k, v in runs.items())
                       + f"; {_memory()}")
    return runs


def _memory() -> str:
    """MLX's memory after a repeat: its arrays, its buffer cache (freed buffers it keeps for reuse)
    and its peak so far; and where `nvidia-smi` answers, the GPU's used memory, which also holds
    what the driver keeps besides (instantiated CUDA graphs)."""
    import mlx.core as mx

    mlx = ", ".join(f"MLX {name} {f() / 2**30:.1f} GiB" for name, f in (
        ("active", mx.get_active_memory), ("cache", mx.get_cache_memory), ("peak", mx.get_peak_memory)))
    used = _gpu_used_mib()
    return mlx if used is None else f"{mlx}, GPU used {used / 1024:.1f} GiB"


def _gpu_used_mib() -> Optional[int]:
    """The first GPU's used memory as `nvidia-smi` reports it (MiB); None without one."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return int(out[0]) if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def run_gpu_batch(args: argparse.Namespace) -> int:
    from worker.backend_env import apply

    apply()
    from bench import gpu_models as gb
    from worker.memory import bound_buffer_cache

    if not args.unbounded_cache:
        bench.progress(f"MLX's buffer cache capped at {bound_buffer_cache() / (1 << 30):.1f} GiB, as the worker caps it")
    tcfg, dcfg = dict(gb.TARGET_9B), dict(gb.DRAFT_08B)
    if args.small:
        tcfg.update(gb.SMALL)
        dcfg.update(gb.SMALL, hidden_size=128, intermediate_size=256)
    bench.progress(f"device {gb.device()}: building the target and the draft")
    target, draft = gb.build(tcfg, gb.DTYPES["bf16"], 0, args.bits), gb.build(dcfg, gb.DTYPES["bf16"], 1, args.bits)
    copy_bps = gb.copy_bandwidth(256 << 20 if args.small else 2 << 30)
    weight_bytes = gb.bytes_per_token(target, tcfg)
    vocab = tcfg["vocab_size"]
    fig: dict = {"device": gb.device(), "copy_bandwidth_GBps": copy_bps / 1e9, "ns": {}, "alphas": args.alphas,
                 "weights": f"{args.bits}-bit (group 64)" if args.bits else "bf16", "weight_bytes_per_step": weight_bytes}
    from bench.gpu_rounds import slab_write_check
    from worker.kernels import kv_write

    fig["slab_write"] = slab_write_check()
    kv_write.set_mode("none" if args.slab_scatter else "wide")
    bench.progress(f"slab write in place against the scatter: {fig['slab_write']}")
    rows = []
    for n in args.ns:
        try:
            runs = _measure(args, target, draft, vocab, n)
        except RuntimeError as e:  # MLX's errors (out of device memory): the Ns measured so far still report
            fig["stopped"] = f"N={n}: {e}"
            bench.progress(f"stopped at {fig['stopped']}")
            break
        roof = roofline(target, copy_bps, weight_bytes, n, args.prompt_tokens + args.tokens // 2)
        fig["ns"][n] = f = _figures(runs, roof)
        bench.progress(f"N={n} figures: " + "; ".join(  # a run cut short keeps each finished N's
            f"{name} {c['tokens_per_s']:.1f} tok/s ({c['per_repeat']}) {c.get('vs', '')} {c.get('drafted', '')}"
            for name, c in f["configs"].items()))
        for name, c in f["configs"].items():
            rows.append((str(n), name, f"{c['tokens_per_s']:.1f}", c["per_repeat"], c.get("vs", ""),
                         c.get("drafted", "")))
    if not fig["ns"]:
        return 1
    fig["goals"] = _goals(fig)
    fig["ratio"] = min(f["configs"]["plain"]["vs_bg"] for f in fig["ns"].values())
    bench.print_report("verity bench gpu-batch", rows, ("N", "configuration", "tok/s (all repeats)",
                                                        "tok/s per repeat", "ratio (whole run; pairs)",
                                                        "drafted/accepted per repeat"), fig, args.json, _footer(fig))
    return 1 if "stopped" in fig else 0


def _whole(runs: list[Run]) -> float:
    return sum(r.decoded for r in runs) / sum(r.seconds for r in runs)


def _figures(runs: dict[str, list[Run]], roof: float) -> dict:
    """Each configuration's tokens/s over all its repeats, each repeat's, and its ratio to the one
    it is measured against (BatchGenerator for plain, plain for the joint ones): whole-run, and
    each repeat's pair."""
    out: dict = {"roofline_tps": roof, "configs": {}}
    for name, rs in runs.items():
        c = {"tokens_per_s": _whole(rs), "per_repeat": " ".join(f"{r.tokens_per_s:.1f}" for r in rs),
             "stalls": [r.stalls for r in rs], "pace": [r.pace for r in rs]}
        base = {"bg": None, "plain": "bg"}.get(name, "plain")
        if base:
            pairs = [round(a.tokens_per_s / b.tokens_per_s, 3) for a, b in zip(rs, runs[base])]
            c["vs_" + base] = _whole(rs) / _whole(runs[base])
            c["pairs"] = pairs
            c["vs"] = f"{c['vs_' + base]:.2f} ÷ {base}; {pairs}"
        if any(r.drafted for r in rs) or name not in ("bg", "plain"):
            c["drafted"] = " ".join(f"{r.drafted}/{r.accepted}" for r in rs)
            c["acceptance"] = sum(r.accepted for r in rs) / max(1, sum(r.drafted for r in rs))
        if name != "bg":
            c["differ"] = [r.differ for r in rs]  # rows ≠ plain's (plain: ≠ the first plain's)
        out["configs"][name] = c
    out["plain_vs_roofline"] = out["configs"]["plain"]["tokens_per_s"] / roof
    out["rows_equal_bg"] = sum(a == b for a, b in zip(runs["plain"][0].tokens, runs["bg"][0].tokens))
    return out


def _goals(fig: dict) -> dict:
    """Each goal met or not, by the whole-run ratios (a tie within the pairs' spread is said apart):
    the α goals by N hold from `high_alpha` up, a lower α's is `low_alpha`."""
    out = {}
    for n, f in fig["ns"].items():
        for name, c in f["configs"].items():
            if name == "plain":
                goal = GOALS["vs_batch_generator"].get(int(n), 1.0)
                out[f"N={n} plain ÷ BG ≥ {goal}"] = _verdict(c, "vs_bg", goal)
            elif name.startswith("adaptive"):
                high = float(name.rsplit("=", 1)[1]) >= GOALS["high_alpha"]
                goal = GOALS["adaptive_vs_plain"].get(int(n), 0.97) if high else GOALS["low_alpha"]
                out[f"N={n} {name} ÷ plain ≥ {goal}"] = _verdict(c, "vs_plain", goal)
            elif name.startswith("mixed"):
                out[f"N={n} {name} ÷ plain ≥ {GOALS['mixed']}"] = _verdict(c, "vs_plain", GOALS["mixed"])
        if int(n) in GOALS["roofline"]:
            goal = GOALS["roofline"][int(n)]
            out[f"N={n} plain at ≥ {goal:.0%} of the roofline"] = "met" if f["plain_vs_roofline"] >= goal else "missed"
    return out


def _verdict(c: dict, key: str, goal: float) -> str:
    if c[key] >= goal:
        return "met"
    return "tie" if max(c["pairs"]) >= goal else "missed"


def _footer(fig: dict) -> str:
    return (f"device {fig['device']}, copy {fig['copy_bandwidth_GBps']:.0f} GB/s; weights {fig['weights']} "
            f"({fig['weight_bytes_per_step'] / 2**20:.0f} MiB a step); α by the draft's intent; joint "
            f"schedulers cold at the first timed repeat; {_stopped(fig)}goals: {fig['goals']}; plain ÷ roofline: "
            + ", ".join(f"N={n} {f['plain_vs_roofline']:.0%}" for n, f in fig["ns"].items())
            + "; '= BG rows': " + ", ".join(f"N={n} {f['rows_equal_bg']}" for n, f in fig["ns"].items())
            + "; rows ≠ plain's, all repeats (plain: ≠ the first plain's): " + ", ".join(
                f"N={n} plain {_differing(f, True)}, joint {_differing(f, False)}" for n, f in fig["ns"].items()))


def _stopped(fig: dict) -> str:
    return f"STOPPED at {fig['stopped']}; " if "stopped" in fig else ""


def _differing(f: dict, plain: bool) -> int:
    return sum(len(d) for name, c in f["configs"].items() if (name == "plain") == plain for d in c.get("differ", []))


def add_command(benches) -> None:
    p = benches.add_parser("gpu-batch", help="batched decoding at real sizes on a GPU against mlx-lm's BatchGenerator")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check on any device)")
    p.add_argument("--ns", type=int, nargs="+", default=list(NS))
    p.add_argument("--alphas", type=float, nargs="+", default=[0.8, 0.6])
    p.add_argument("--mixed", type=int, nargs="*", default=[8, 32], help="the N where half the rows are joint")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fixed", type=int, nargs="*", default=[], help="also every row joint at this fixed draft length")
    p.add_argument("--bits", type=int, choices=(4, 8), default=None,
                   help="target and draft weights quantized to this many bits, group 64 (the roofline reads their bytes)")
    p.add_argument("--log-dir", default=None, help="write each joint configuration's decision log here")
    p.add_argument("--sublayers", action="store_true",
                   help="the draft path before the one launch ran on the batch's slots: kernels a sublayer, one token wide")
    p.add_argument("--slab-scatter", action="store_true",
                   help="attention slabs written by MLX's scatter, as before the in-place write (which may copy them)")
    p.add_argument("--unbounded-cache", action="store_true",
                   help="leave MLX's buffer cache at its default limit, as before the worker capped it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_gpu_batch)

