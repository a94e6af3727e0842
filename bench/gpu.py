"""`verity bench gpu`: one request's decoding speed at real model sizes (Qwen3.5-9B target, 0.8B
draft shapes, random weights) wherever MLX has a GPU; `--small` runs the same code on tiny shapes
anywhere. Every decode runs through verity's engine (worker/engine.py) with one request, as a
server with one client runs it.

Measured in one run: the device's copy bandwidth; plain decoding (the engine's baseline row)
against the roofline (weight bytes read per token ÷ that bandwidth) and against mlx-lm's
generate_step; the target's forward cost for 1, 2, 4, 8, 16 tokens on the engine's slot batch (a
verify of k drafts is a forward of k + 1); the draft's one-token step; joint decoding with the
controlled-acceptance draft (bench/drafters.py) at several α under both recovery paths, for fixed
k and adaptive: at each (α, recovery) the configurations alternate over the repeats, each run
between two plain runs, and ratios are medians of the per-run ratios; adaptive against the best
fixed k is then measured again in pairs of runs back to back between plain runs (--pair-repeats),
whose ratios to each other and to plain the adaptive goal reads. The headline (α = 0.8, fast, the
best fixed k ÷ plain) is the median over that k's repeats and its runs in those pairs, each ÷ the
plain runs either side of it: four repeats alone read 1.47 where the same run's twelve read 1.51.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import common as bench

print_report = bench.print_report

ALPHAS = (0.6, 0.8, 0.95)
KS = (0, 1, 2, 4, 8)  # k = 0: a joint row that never drafts (its draft fed in step: the joint row's overhead)
FORWARD_TOKENS = (1, 2, 4, 8, 16)
GOALS = dict(roofline=0.40, joint_vs_plain=1.5, adaptive_vs_best=0.95, adaptive_vs_plain=0.97)
REPORT_S = 15.0  # what --time-budget keeps back for the report after the last block
WARMUP_RUNS = 2  # unmeasured runs of each configuration first, as `bench sched` does: the goals are about a
                 # server's steady state (after one, the adaptive scheduler had seen 4-15 position-1 drafts)


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """A progress line with the seconds since the run began (where a device call's time goes)."""
    bench.progress(f"[{time.perf_counter() - _T0:.0f} s] {msg}")


def run_gpu(args: argparse.Namespace) -> int:
    from worker.backend_env import CUDA_GRAPH_ENV, apply

    apply()
    from bench import engine_runs as er
    from bench import gpu_models as gm
    from bench import gpu_rounds as gb
    from worker.kernels import fast_draft

    global _T0
    _T0 = time.perf_counter()

    dtype = gm.DTYPES[args.dtype]
    tcfg, dcfg = dict(gm.TARGET_9B), dict(gm.DRAFT_08B)
    if args.small:
        tcfg.update(gm.SMALL)
        dcfg.update(gm.SMALL, hidden_size=128, intermediate_size=256)
    progress(f"device {gm.device()}; building target and draft ({args.dtype}, bits={args.bits})")
    target = gm.build(tcfg, dtype, 0, args.bits)
    draft = gm.build(dcfg, dtype, 1, args.bits)
    vocab = tcfg["vocab_size"]
    tlm, dlm = er.served(target, vocab, "target"), er.served(draft, vocab, "draft")
    dfwd = fast_draft.where_it_runs(draft)  # the draft's forward as the engine runs it
    fig: dict = {"device": gm.device(), "dtype": args.dtype, "bits": args.bits, "small": args.small, "gdn": args.gdn,
                 "side_by_side": args.side_by_side, "time_budget_s": args.time_budget,
                 "env": {k: os.environ.get(k) for k in CUDA_GRAPH_ENV},
                 "target_params": gm.n_params(target), "draft_params": gm.n_params(draft)}
    fig["copy_bandwidth_GBps"] = gm.copy_bandwidth(32 << 20 if args.small else 2 << 30) / 1e9
    prompt = list(range(1, args.prompt_tokens + 1))
    reps = args.probe_repeats * 3
    plain_engine = er.engine(tlm)
    plain_run = lambda: er.run_one(plain_engine, prompt, args.tokens, "baseline")  # noqa: E731
    if gm.kernel_available() and args.side_by_side:
        fig["gdn_kernel"] = _kernel_side_by_side(gb, target, draft, plain_run, args, reps)
    elif gm.kernel_available():
        from worker.kernels import gdn as gdn_kernel

        gdn_kernel.set_enabled(args.gdn == "kernel")
    fig["draft_forward"] = "kernels" if dfwd else "mlx-lm"
    fig["draft_step_ms"] = 1e3 * gb.forward_cost(draft, 1, reps=reps, forward=dfwd)
    fig["draft_chain_step_ms"] = 1e3 * gb.draft_chain_cost(draft, 4, reps=reps, forward=dfwd)
    if dfwd:  # mlx-lm's forward beside the kernels'
        fig["draft_step_mlx_lm_ms"] = 1e3 * gb.forward_cost(draft, 1, reps=reps)
    if args.bits is None:  # the draft kernels' path (worker/kernels/fast_draft.py): unquantized layers only
        fig["fast_check"] = gb.fast_check(draft)
        progress(f"draft kernels' path against its ops and mlx-lm's forward: {fig['fast_check']}")
    er.run_one(plain_engine, prompt, 8, "baseline")  # warm-up
    plains = [plain_run() for _ in range(args.probe_repeats)]
    reference = plains[0].tokens
    plain = statistics.median(r.tps for r in plains)
    mlx_lm = [gb.mlx_lm_decode(target, prompt, args.tokens) for _ in range(args.probe_repeats)]
    bpt = gm.bytes_per_token(target, tcfg)
    roof = fig["copy_bandwidth_GBps"] * 1e9 / bpt
    fig.update(plain_tps=plain, mlx_lm_tps=statistics.median(t for t, _ in mlx_lm), bytes_per_token=bpt,
               roofline_tps=roof, plain_vs_roofline=plain / roof, plain_equals_mlx_lm=mlx_lm[0][1] == reference)
    fig["plain_vs_mlx_lm"] = plain / fig["mlx_lm_tps"]
    progress(f"plain {plain:.1f} tok/s (mlx-lm {fig['mlx_lm_tps']:.1f}), roofline {roof:.1f} tok/s; "
             f"draft step {fig['draft_step_ms']:.1f} ms (chained {fig['draft_chain_step_ms']:.1f})")
    fig["target_forward_ms"] = {n: 1e3 * gb.forward_cost(target, n, reps=reps) for n in FORWARD_TOKENS}
    fig["target_forward_recorded_ms"] = {n: 1e3 * gb.forward_cost(target, n, reps=reps, record=True)
                                         for n in FORWARD_TOKENS[1:]}
    forced = not args.small and not args.reference_acceptance  # random bf16 weights at full size: see Controlled
    fig["acceptance_by"] = "the draft's intent (forced)" if forced else "token comparison"
    fig["warm_joint_s"] = gb.warm_joint_shapes(target, draft, draft_forward=dfwd)
    progress(f"every joint shape compiled in {fig['warm_joint_s']:.1f} s")
    rows, fig["joint"] = [], []
    blocks = [(alpha, recovery) for alpha in args.alphas for recovery in args.recoveries]
    budget = PairTime(None if args.time_budget is None else _T0 + args.time_budget)
    for i, (alpha, recovery) in enumerate(blocks):
        rows += _joint_rows(er, fig, (tlm, dlm), prompt, reference, alpha, recovery, args, forced, plain_run,
                            lambda block_s: budget.pairs_until(recovery, block_s, blocks[i + 1:]))
    fig["pairs_by_alpha"] = {j["alpha"]: len(j["pairs_vs_best"]) for j in fig["joint"] if "pairs_vs_best" in j}
    _goals(fig)
    footer = "\n".join([
        f"device {fig['device']}, copy {fig['copy_bandwidth_GBps']:.0f} GB/s; target {fig['target_params'] / 1e9:.2f} B, "
        f"draft {fig['draft_params'] / 1e9:.2f} B params ({args.dtype}{', ' + str(args.bits) + '-bit' if args.bits else ''}); "
        + " ".join(f"{k}={v}" for k, v in fig["env"].items()),
        f"plain decoding (the engine, one request) {plain:.1f} tok/s = {fig['plain_vs_roofline']:.0%} of the roofline "
        f"{roof:.1f} tok/s ({bpt / 1e9:.1f} GB a token), {fig['plain_vs_mlx_lm']:.2f}× mlx-lm's generate_step "
        f"({fig['mlx_lm_tps']:.1f} tok/s; same tokens: {fig['plain_equals_mlx_lm']})",
        _kernel_line(fig),
        "target forward ms by tokens (one-row slot batch): " + ", ".join(f"{n}: {v:.1f}" for n, v in fig["target_forward_ms"].items())
        + "; recorded: " + ", ".join(f"{n}: {v:.1f}" for n, v in fig["target_forward_recorded_ms"].items()),
        f"draft step ({fig['draft_forward']} forward, as the engine's) {fig['draft_step_ms']:.1f} ms"
        + (f" (mlx-lm's {fig['draft_step_mlx_lm_ms']:.1f})" if "draft_step_mlx_lm_ms" in fig else "")
        + f"; chained 4 on the device {fig['draft_chain_step_ms']:.1f} ms a step; every joint shape compiled first "
        f"({fig['warm_joint_s']:.0f} s)",
        _fast_line(fig),
        "×plain: median over the repeats of the run's tokens/s ÷ the mean of the plain runs just before and after it; "
        "adaptive ÷ best fixed k, and ÷ plain (fast; medians of pairs of runs back to back between plain runs, and "
        "in brackets of the repeats, each paired so): " + ", ".join(
            f"α={j['alpha']} {j['vs_best_fixed']:.2f} ({j['vs_best_fixed_in_repeats']:.2f}) in {len(j.get('pairs_vs_best', []))} pairs, "
            f"÷ plain {j['vs_plain_goal']:.2f} ({j['vs_plain']:.2f})" for j in fig["joint"] if "vs_best_fixed" in j),
        f"acceptance by {fig['acceptance_by']}; exact = runs whose tokens equal the engine's plain tokens "
        "(forced acceptance emits accepted drafts, so there it is not expected); draft / verify / recovery: "
        "shares of the drafting rounds' time",
        f"goals: plain ≥ {GOALS['roofline']:.0%} of roofline: {fig['goals']['roofline']}; joint at α=0.8 (fast, best k) "
        f"≥ {GOALS['joint_vs_plain']}× plain: {fig['goals']['joint_vs_plain']}; adaptive within 5% of best k and "
        f"≥ 0.97× plain at every α: {fig['goals']['adaptive']}; headline ratio {fig['ratio']:.2f} (the best k's repeats and "
        f"pairs; its repeats alone {fig['ratio_in_repeats']:.2f})",
    ])
    print_report("verity bench gpu", rows, ("α", "recovery", "budget", "tok/s", "×plain", "accept", "k mean",
                                            "draft", "verify", "recovery", "exact"), fig, args.json, footer)
    return 0


def _kernel_side_by_side(gb, target, draft, plain_run, args, reps) -> dict:
    """The Gated-DeltaNet recurrence as one kernel (worker/kernels/gdn.py) against mlx-lm's
    per-token ops, alternated over the repeats: its agreement with the ops, plain decoding, the
    target's forward for 1 and 4 tokens, the draft's step. The rest of the run uses the kernel
    unless --gdn ops."""
    from worker.kernels import gdn as gdn_kernel

    out = {"check": gb.kernel_check(target)}
    progress(f"Gated-DeltaNet kernel against ops: {out['check']}")
    figures: dict = {"ops": {}, "kernel": {}}
    for rep in range(args.probe_repeats):
        for name in ("ops", "kernel") if rep % 2 == 0 else ("kernel", "ops"):
            gdn_kernel.set_enabled(name == "kernel")
            f = figures[name]
            plain_run()
            f.setdefault("plain_tps", []).append(plain_run().tps)
            for n in (1, 4):
                f.setdefault(f"target_forward_{n}_ms", []).append(1e3 * gb.forward_cost(target, n, reps=reps))
            f.setdefault("target_forward_4_recorded_ms", []).append(1e3 * gb.forward_cost(target, 4, reps=reps, record=True))
            f.setdefault("draft_step_ms", []).append(1e3 * gb.forward_cost(draft, 1, reps=reps))  # mlx-lm's forward
    gdn_kernel.set_enabled(args.gdn == "kernel")
    for name, f in figures.items():
        out[name] = {k: statistics.median(v) for k, v in f.items()}
    progress(f"ops {out['ops']}\nkernel {out['kernel']}")
    return out


@dataclass
class PairTime:
    """--time-budget's share for each block's pairs: the time left, less what the blocks still to
    come take (timed in this run: the same recovery's blocks so far, else every block's), split
    evenly among the pairs still to run; a device call's 600 s then holds as many pairs as fit."""
    end: float | None  # perf_counter() at which the report must start; None: no budget
    block_s: dict = field(default_factory=dict)  # recovery: the seconds its blocks took, pairs aside

    def pairs_until(self, recovery: str, block_s: float, rest: list[tuple]) -> float | None:
        """When this block's pairs must stop (None: no budget), given what its runs took."""
        self.block_s.setdefault(recovery, []).append(block_s)
        if self.end is None or recovery != "fast":  # only the fast blocks run pairs
            return None
        every = [s for v in self.block_s.values() for s in v]
        ahead = sum(statistics.mean(self.block_s.get(r) or every) for _, r in rest)
        shares = 1 + sum(r == "fast" for _, r in rest)
        now = time.perf_counter()
        return now + (self.end - REPORT_S - now - ahead) / shares


def _joint_rows(er, fig, models, prompt, reference, alpha, recovery, args, forced, plain_run,
                pairs_until=lambda block_s: None) -> list[tuple]:
    """Every configuration at one (α, recovery), alternating over the repeats, each run between
    two plain runs: its ratio to plain is to the mean of those two, and a row's ratio is the
    median over the repeats. The host's pace changes in spells of seconds (plain runs of one
    repeat read 72-110 tok/s, of one bench 76-179): a plain run per repeat, up to six runs away,
    left identical work reading 0.76-1.11 of itself."""
    from bench.drafters import controls

    tlm, dlm = models
    ks = [k for k in args.ks if k or recovery == "fast"]  # k = 0 drafts nothing and recovers nothing: run once
    configs = [("adaptive" if k is None else f"k={k}", k) for k in ks + [None]]
    refs = {tuple(prompt): (0, reference)}
    make = controls(refs, lambda p: alpha, tlm.tokenizer.vocab_size, forced)
    engines = {name: er.engine(tlm, dlm, k, recovery, _log_path(args, f"a{alpha}-{recovery}-{name.replace('=', '')}"),
                               make) for name, k in configs}  # each learns across its runs, as a server's would
    run = lambda name, k: er.run_one(engines[name], prompt, args.tokens)  # noqa: E731
    t0 = time.perf_counter()
    for _ in range(WARMUP_RUNS):  # shapes compile, the scheduler learns
        for name, k in configs:
            run(name, k)
    runs: dict = {name: [] for name, _ in configs}
    paired: dict = {name: [] for name, _ in configs}  # the mean of the plain runs either side of each run
    for rep in range(args.repeats):
        before = plain_run().tps
        for name, k in configs if rep % 2 == 0 else configs[::-1]:
            runs[name].append(run(name, k))
            after = plain_run().tps
            paired[name].append((before + after) / 2)
            before = after
    out = []
    for name, _ in configs:
        rs, plain = runs[name], paired[name]
        r = sorted(rs, key=lambda r: r.tps)[len(rs) // 2]
        vs_plain = statistics.median(x.tps / p for x, p in zip(rs, plain))
        differ = sum(x.tokens != reference[: len(x.tokens)] for x in rs)
        cycle = (r.draft_s + r.verify_s + r.recovery_s) or float("nan")  # k = 0: no drafting round
        fig["joint"].append({"alpha": alpha, "recovery": recovery, "config": name, "tps": r.tps,
                             "vs_plain": vs_plain, "runs_tps": [x.tps for x in rs], "plain_tps": plain,
                             "acceptance": r.acceptance, "budget_mean": r.budget_mean,
                             "draft_share": r.draft_s / cycle, "verify_share": r.verify_s / cycle,
                             "recovery_share": r.recovery_s / cycle, "runs_differing_from_reference": differ})
        out.append((f"α={alpha}", recovery, name, f"{r.tps:.1f}", f"{vs_plain:.2f}", f"{r.acceptance:.2f}",
                    f"{r.budget_mean:.1f}", f"{r.draft_s / cycle:.0%}", f"{r.verify_s / cycle:.0%}",
                    f"{r.recovery_s / cycle:.1%}", f"{len(rs) - differ}/{len(rs)}"))
        progress(f"  α={alpha} {recovery} {name}: {r.tps:.1f} tok/s, {vs_plain:.2f}× plain")
    until = pairs_until(time.perf_counter() - t0)
    if recovery == "fast" and args.pair_repeats:
        _pairs(fig["joint"][-len(configs):], dict(configs), run, args.pair_repeats, lambda: plain_run().tps, until)
    return out


def _pairs(rows: list[dict], ks: dict, run, n: int, plain, until: float | None = None) -> None:
    """Adaptive against the best fixed k of the repeats, in n more pairs of runs back to back
    (which goes first alternates), each pair between two plain runs (`plain()`: its tokens/s):
    the ratio within a pair, and adaptive's to the mean of the plain runs either side of its pair,
    are what the goal reads. Four repeats, each run set against its own plain neighbours, left
    identical work (adaptive drafting exactly k = 8's rounds) reading 0.77-1.09 of itself, and
    adaptive at α = 0.6 0.71-1.06 of plain; the pairs are also new runs, so choosing the best k by
    its repeats does not flatter it. `until` (perf_counter()): past n pairs, more, two at a time
    (both orders), while two more fit before it."""
    best = max((j for j in rows if j["config"] != "adaptive"), key=lambda j: j["vs_plain"])
    ad = next(j for j in rows if j["config"] == "adaptive")
    ratios, vs_plain, best_vs_plain = [], [], []
    before = plain()
    t0 = time.perf_counter()
    for i in itertools.count():
        pair_s = (time.perf_counter() - t0) / i if i else 0.0
        if i >= n and (until is None or i % 2 == 0 and time.perf_counter() + 2 * pair_s > until):
            break
        order = ["adaptive", best["config"]] if i % 2 == 0 else [best["config"], "adaptive"]
        tps = {name: run(name, ks[name]).tps for name in order}
        after = plain()
        ratios.append(tps["adaptive"] / tps[best["config"]])
        vs_plain.append(tps["adaptive"] / ((before + after) / 2))
        best_vs_plain.append(tps[best["config"]] / ((before + after) / 2))
        before = after
    ad.update(pairs_best=best["config"], pairs_vs_best=ratios, pairs_vs_plain=vs_plain)
    best["pairs_vs_plain"] = best_vs_plain
    progress(f"  α={ad['alpha']} adaptive ÷ {best['config']} in {len(ratios)} pairs: {statistics.median(ratios):.2f}, "
             f"÷ plain {statistics.median(vs_plain):.2f}")


def _log_path(args, name: str) -> str | None:
    """A configuration's log under --decision-log DIR (one JSON-lines file each)."""
    if not args.decision_log:
        return None
    Path(args.decision_log).mkdir(parents=True, exist_ok=True)
    return str(Path(args.decision_log) / f"{name}.jsonl")


def _kernel_line(fig: dict) -> str:
    k = fig.get("gdn_kernel")
    if not k and fig["side_by_side"] is False and fig["gdn"] == "kernel":
        return "Gated-DeltaNet recurrence: one kernel (not measured against mlx-lm's ops: --no-side-by-side)"
    if not k:
        return "Gated-DeltaNet recurrence: mlx-lm's ops (no CUDA kernel here)"
    o, n, c = k["ops"], k["kernel"], k["check"]
    return (f"Gated-DeltaNet recurrence ops / one kernel (eager, medians): plain {o['plain_tps']:.1f} / {n['plain_tps']:.1f} tok/s, "
            f"target forward 1 token {o['target_forward_1_ms']:.1f} / {n['target_forward_1_ms']:.1f} ms, 4 tokens "
            f"{o['target_forward_4_ms']:.1f} / {n['target_forward_4_ms']:.1f}, recorded {o['target_forward_4_recorded_ms']:.1f} / "
            f"{n['target_forward_4_recorded_ms']:.1f}, draft step {o['draft_step_ms']:.1f} / {n['draft_step_ms']:.1f}; kernel − ops: "
            f"outputs {c['y_max_abs_diff']:.2g} (of {c['y_max_abs']:.2g}), states {c['state_max_abs_diff']:.2g} (of {c['state_max_abs']:.2g}); "
            f"the run uses {'the kernel' if fig['gdn'] == 'kernel' else 'ops'}")


def _fast_line(fig: dict) -> str:
    c = fig.get("fast_check")
    if not c:
        return "draft kernels' path: not checked (quantized weights)"
    return (f"draft kernels' path ({'CUDA kernels' if c['kernels_ran'] else 'their ops: no CUDA here'}), logits of 1 / 2 tokens "
            f"(of {c['logits_1_max_abs']:.2g} / {c['logits_2_max_abs']:.2g}): kernels − ops {c['logits_1_kernel_vs_ops']:.2g} / "
            f"{c['logits_2_kernel_vs_ops']:.2g}, kernels − mlx-lm {c['logits_1_kernel_vs_mlx_lm']:.2g} / "
            f"{c['logits_2_kernel_vs_mlx_lm']:.2g}, argmax agrees {c['argmax_1_kernel_agrees']} / {c['argmax_2_kernel_agrees']}; "
            f"states kernels − ops {c['state_kernel_vs_ops']:.2g} (of {c['state_max_abs']:.2g})"
            + ("" if not c.get("persistent_ran") else
               f"; one launch (worker/kernels/persistent_draft.py) − mlx-lm: logits {c['logits_1_persistent_vs_mlx_lm']:.2g} / "
               f"{c['logits_2_persistent_vs_mlx_lm']:.2g}, argmax agrees {c['argmax_1_persistent_agrees']} / "
               f"{c['argmax_2_persistent_agrees']}, states {c['state_persistent_vs_mlx_lm']:.2g} (kernels − mlx-lm "
               f"{c['state_kernel_vs_mlx_lm']:.2g}), barrier failed {c['persistent_barrier_failed']}"))


def _goals(fig: dict) -> None:
    joint = fig["joint"]
    fast = [j for j in joint if j["recovery"] == "fast"]
    drafting = [j for j in fast if j["config"] not in ("adaptive", "k=0")]  # the headline is speculation's, not k = 0's
    at08 = [j for j in drafting if j["alpha"] == 0.8] or drafting
    best08 = max(at08, key=lambda j: j["vs_plain"])
    fig["ratio_in_repeats"] = best08["vs_plain"]
    fig["ratio"] = statistics.median(  # its repeats and its runs in the pairs, each ÷ its own plain neighbours
        [r / p for r, p in zip(best08["runs_tps"], best08["plain_tps"])] + best08.get("pairs_vs_plain", []))
    adaptive_ok = True
    for alpha in {j["alpha"] for j in fast}:
        rows = [j for j in fast if j["alpha"] == alpha]
        best = max((j for j in rows if j["config"] != "adaptive"), key=lambda j: j["vs_plain"])
        ad = next(j for j in rows if j["config"] == "adaptive")
        in_repeats = statistics.median((a / pa) / (b / pb) for a, pa, b, pb in  # each paired with its own plain runs
                                       zip(ad["runs_tps"], ad["plain_tps"], best["runs_tps"], best["plain_tps"]))
        ad["vs_best_fixed_in_repeats"] = in_repeats
        vs_best = statistics.median(ad["pairs_vs_best"]) if ad.get("pairs_best") == best["config"] else in_repeats
        ad["vs_best_fixed"] = vs_best
        ad["vs_plain_goal"] = statistics.median(ad["pairs_vs_plain"]) if "pairs_vs_plain" in ad else ad["vs_plain"]
        adaptive_ok &= vs_best >= GOALS["adaptive_vs_best"] and ad["vs_plain_goal"] >= GOALS["adaptive_vs_plain"]
    fig["goals"] = {"roofline": "met" if fig["plain_vs_roofline"] >= GOALS["roofline"] else "missed",
                    "joint_vs_plain": "met" if fig["ratio"] >= GOALS["joint_vs_plain"] else "missed",
                    "adaptive": "met" if adaptive_ok else "missed"}


def add_command(benches) -> None:
    p = benches.add_parser("gpu", help="one request's speed at Qwen3.5-9B/0.8B sizes where MLX has a GPU")
    p.add_argument("--small", action="store_true", help="tiny shapes (a check on any device)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--bits", type=int, default=None, help="quantize weights (e.g. 4)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="alternated repeats of each joint configuration")
    p.add_argument("--pair-repeats", type=int, default=8,
                   help="pairs of runs back to back, adaptive and the best fixed k (fast), whose ratios the adaptive goal reads")
    p.add_argument("--probe-repeats", type=int, default=3,
                   help="repeats of the figures before the joint rows (plain runs, forward costs, the kernel side by side)")
    p.add_argument("--alphas", type=float, nargs="*", default=ALPHAS)
    p.add_argument("--recoveries", nargs="+", choices=("fast", "replay"), default=["fast", "replay"],
                   help="the joint rows' recovery paths (the goals read the fast rows; the replay rows take about a quarter "
                        "of the joint rows' time, which one device call's 600 s can give to more --pair-repeats instead)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds the whole run may take: each α's pairs then run past --pair-repeats while the "
                        "blocks still to come, as this run timed its own, leave time for them (a device call's limit)")
    p.add_argument("--no-side-by-side", dest="side_by_side", action="store_false",
                   help="skip the Gated-DeltaNet kernel against mlx-lm's ops (CUDA): time for more pairs")
    p.add_argument("--ks", type=int, nargs="*", default=KS)
    p.add_argument("--reference-acceptance", action="store_true",
                   help="accept by comparing tokens even at full size (random bf16 weights flip near-ties: α drifts)")
    p.add_argument("--gdn", choices=("kernel", "ops"), default="kernel",
                   help="Gated-DeltaNet recurrence on a CUDA GPU: one kernel a forward, or mlx-lm's per-token ops "
                        "(both are measured side by side first)")
    p.add_argument("--decision-log", metavar="DIR", default=None,
                   help="keep every configuration's round times here, and each adaptive scheduler's decisions "
                        "(one JSON-lines file each, for `verity replay`)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_gpu)
