"""`verity bench joint`: speculative decoding side by side, in one process, greedy everywhere.

Groups of rows, each with its own target and reference output:

- llama: a tiny random llama target (hidden 256, 6 layers) with two drafts of its tokenizer: a
  perturbed copy (noise 0.3, as costly as the target) and a one-layer draft (the target's first
  layer, embeddings and head, plus noise: much cheaper). Rows: plain target decoding (mlx-lm
  generate_step, and verity's engine with a joint request that drafts nothing: k = 0), verity's
  engine (worker/engine.py, one joint request) at each fixed k under each recovery path, and
  mlx-lm's speculative_generate_step with the same draft and k. Then, for each draft and k, a
  duel: verity (fast) and mlx-lm take turns one cycle (one engine round) at a time, which
  resolves their ratio far better than whole runs on a shared machine; the headline is its ratio.
- hybrid: a tiny Qwen3.5 target (Gated DeltaNet + attention) with a perturbed copy as draft.
  mlx-lm refuses it (its caches cannot be trimmed); the row says so.
- distilled: SmolLM2-135M (float32) with the draft distilled from it (`verity distill`,
  worker/draft/), verity against mlx-lm at each k, with acceptance per draft position.
- embedded: SmolLM2-135M (float32) with the controlled-acceptance draft at several α: a small
  random llama of the same vocabulary runs its real forward (carrying the draft's cost) while
  the target's known greedy continuation is proposed with probability α.

Every timed run is checked token for token against the group's greedy baseline (mlx-lm
generate_step), and runs alternate (ABBA order over the repeats) so that drift on a shared
machine spreads over all rows; figures are medians.

Decode tokens/s excludes prefill: verity rows count the tokens after the first over the time
since the engine emitted it; mlx-lm's generate_step the tokens after its first over the time since it; mlx-lm's
speculative_generate_step the tokens after its first cycle (which holds the prefill) over the
time since that cycle ended.

This module holds the command, its settings and the report; what measures (models, runners,
rounds, exactness checks) lives in bench/joint_rows.py and the duels in bench/joint_duels.py,
since only worker/ imports MLX.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from bench.common import DEFAULT_PROMPT, median, print_report, progress
from cli.blas import reexec_with_blas

if TYPE_CHECKING:  # annotations only: worker modules are imported inside functions
    from bench.joint_rows import Group, Row

KS = (1, 2, 4, 8)
ALPHAS = (0.5, 0.8, 0.95)
HEADLINE_K = 4
RECOVERY_GOAL = 0.05  # fast-path recovery ≤ 5% of cycle time

QUICK = dict(ks=(1, 4), alphas=(0.8,), tokens=12, tiny_tokens=16, repeats=1, duel_cycles=20)
DUEL_CYCLES = 300


# ---- the bench ----


def run_spec(args: argparse.Namespace) -> int:
    reexec_with_blas()
    s = _settings(args)
    if s.tokens < 2 or s.tiny_tokens < 2 or s.repeats < 1:
        progress("--tokens and --tiny-tokens must be ≥ 2, --repeats ≥ 1")
        return 2
    from bench import joint_rows as sb
    from bench.joint_duels import run_duels

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verity-bench-spec-") as tmp:
        groups = sb.build_groups(Path(tmp), s, progress)
        for g in groups:
            sb.measure_group(g, s, progress)
            run_duels(g, s, progress)
            sb.clear_cache()
    figures, rows, footer = report(groups, s, time.perf_counter() - t_start)
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "160")  # rich's default of 80 would wrap the table
    n_runs = s.repeats
    print_report(f"bench joint: greedy, decode tokens/s (prefill excluded), median of {n_runs} alternated "
                 f"round{'s' if n_runs > 1 else ''}; MLX on {sb.device()}",
                 rows, ("row", "draft", "tok/s", "× base", "accept", "draft", "verify", "recov", "exact"), figures,
                 args.json, footer)
    return 0


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    q = QUICK if args.quick else {}
    return argparse.Namespace(
        ks=tuple(args.ks) if args.ks else q.get("ks", KS),
        alphas=tuple(args.alphas) if args.alphas else q.get("alphas", ALPHAS),
        tokens=args.tokens or q.get("tokens", 128),
        tiny_tokens=args.tiny_tokens or q.get("tiny_tokens", 128),
        repeats=args.repeats or q.get("repeats", 3),
        duel_cycles=args.duel_cycles if args.duel_cycles is not None else q.get("duel_cycles", DUEL_CYCLES),
        groups=tuple(args.groups),
        prompt=args.prompt,
    )


def _row_figures(g: Group, r: Row, base_tps: float) -> dict:
    f = {"group": g.name, "label": r.label, "draft_label": r.draft_label, "method": r.method, "draft": r.draft,
         "k": r.k, "recovery": r.recovery, "alpha": r.alpha}
    if r.error or not r.runs:
        return {**f, "error": r.error}
    tps = median(x.tps for x in r.runs)
    drafted, accepted = sum(x.drafted for x in r.runs), sum(x.accepted for x in r.runs)
    cycle = [x.draft_s + x.verify_s + x.recovery_s for x in r.runs]
    verity = r.method.startswith("verity")
    shares = {}
    if verity and r.k > 0:
        for part in ("draft", "verify", "recovery"):
            shares[f"{part}_share"] = median(getattr(x, f"{part}_s") / c for x, c in zip(r.runs, cycle) if c > 0)
    at = _per_position(r.runs)
    return {**f, "tps": tps, "tps_runs": [x.tps for x in r.runs], "speedup": tps / base_tps if base_tps else None,
            "acceptance_per_position": at,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            **shares, "tokens": len(r.runs[0].tokens), **{"mismatches": 0, **r.exact}}


def _per_position(runs: list) -> list[float]:
    """Conditional acceptance per draft position over all runs of a row (verity rows only)."""
    acc, tried = [], []
    for x in runs:
        for j, (a, t) in enumerate(x.accepted_at):
            if j == len(acc):
                acc.append(0)
                tried.append(0)
            acc[j], tried[j] = acc[j] + a, tried[j] + t
    return [a / t for a, t in zip(acc, tried) if t]


def report(groups: list[Group], s: argparse.Namespace, wall_s: float) -> tuple[dict, list, str]:
    from bench.joint_rows import RECOVERIES

    rows, all_figs, notes = [], [], []
    for g in groups:
        base = g.rows[0]
        base_tps = median(x.tps for x in base.runs)
        rows.append((f"[{g.name}] prompt {len(g.prompt)} + {g.tokens} tokens", *[""] * 8))
        for r in g.rows:
            f = _row_figures(g, r, base_tps)
            all_figs.append(f)
            if "error" in f:
                short = f["error"] or "not run"
                short = "refused: needs a trimmable cache" if "trimmable" in short else short
                rows.append((r.label if r.k else r.method, r.draft_label, *[""] * 6, short))
                notes.append(f"{g.name}: {r.method}: {f['error']}")
                continue
            exact = "✓" if f["mismatches"] == 0 else (
                f"✗ {f['mismatches']} from #{f['first_divergence']}"
                + (" (near-tie)" if f.get("near_tie") else ""))
            rec = _fmt(f.get("recovery_share"), ".1%")
            if r.method == "verity joint" and r.recovery == "fast" and "recovery_share" in f:
                rec += " ✓" if f["recovery_share"] <= RECOVERY_GOAL else " ✗"
            rows.append((r.label, r.draft_label, _fmt(f["tps"], ".1f"), _fmt(f["speedup"], ".2f"),
                         _fmt(f["acceptance"], ".2f"), _fmt(f.get("draft_share"), ".0%"),
                         _fmt(f.get("verify_share"), ".0%"), rec, exact))
        if g.name == "distilled":
            deepest = max((f for f in all_figs if f["group"] == g.name and f["method"] == "verity joint"
                           and f.get("acceptance_per_position")), key=lambda f: f["k"], default=None)
            best = max((f for f in all_figs if f["group"] == g.name and f.get("tps") and f["method"] == "verity joint"),
                       key=lambda f: f["tps"], default=None)
            if deepest:
                notes.append("distilled: acceptance per draft position (verity k="
                             f"{deepest['k']} {deepest['recovery']}): "
                             + " ".join(f"{a:.2f}" for a in deepest["acceptance_per_position"]))
            if best:
                notes.append(f"distilled: best {best['label']} {best['tps']:.1f} tok/s = {best['speedup']:.2f}× baseline "
                             f"{base_tps:.1f} (goal ≥ 1.3× with the adaptive scheduler: `verity bench sched`)")
        # the two baselines must agree with each other (both are checked against the reference)
        k0 = next(f for f in all_figs if f["group"] == g.name and f["method"] == "verity k=0")
        spread = [x.tps for x in base.runs]
        notes.append(f"{g.name}: baseline = mlx-lm generate_step ({base_tps:.1f} tok/s; its rounds "
                     f"{min(spread):.1f}–{max(spread):.1f}: the noise of whole runs here); verity k=0 "
                     f"{k0['tps']:.1f} tok/s, {'same' if k0['mismatches'] == 0 else 'DIFFERENT'} output")

    # goal 1: fast-path recovery share
    fast = [f for f in all_figs if f["method"] == "verity joint" and f["recovery"] == "fast" and "recovery_share" in f]
    worst = max(fast, key=lambda f: f["recovery_share"], default=None)
    goal1 = bool(fast) and all(f["recovery_share"] <= RECOVERY_GOAL for f in fast)
    n_met = sum(f["recovery_share"] <= RECOVERY_GOAL for f in fast)
    # goal 2: verity joint ÷ mlx-lm speculative, llama pair, same draft and k
    ratios, paired = {}, {}  # from the table's run medians; median of per-round ratios
    for draft in ("perturbed", "1-layer"):
        for k in s.ks:
            m = _find(all_figs, "llama", "mlx-lm speculative", draft, k, None)
            for rec in RECOVERIES:
                v = _find(all_figs, "llama", "verity joint", draft, k, rec)
                if v and m and m.get("tps"):
                    ratios.setdefault(draft, {}).setdefault(rec, {})[str(k)] = v["tps"] / m["tps"]
            vr = _find_row(groups, "llama", "verity joint", draft, k, "fast")
            mr = _find_row(groups, "llama", "mlx-lm speculative", draft, k, None)
            if vr and mr:
                paired.setdefault(draft, {})[str(k)] = median(x.tps / y.tps for x, y in zip(vr.runs, mr.runs))
    duels = next((g.duels for g in groups if g.name == "llama" and g.duels), {})
    judged = {d: {k: x["ratio"] for k, x in by_k.items()} for d, by_k in duels.items()} if duels else \
        {d: by_rec.get("fast", {}) for d, by_rec in ratios.items()}
    goal2 = {d: all(x >= 1.0 for x in by_k.values()) for d, by_k in judged.items()}
    hk = HEADLINE_K if HEADLINE_K in s.ks else max(s.ks)
    headline = judged.get("perturbed", {}).get(str(hk), math.nan)
    headline_runs = ratios.get("perturbed", {}).get("fast", {}).get(str(hk), math.nan)
    best_k = max(s.ks, key=lambda k: (_find(all_figs, "llama", "verity joint", "perturbed", k, "fast") or {})
                 .get("tps", -1.0)) if ratios else None

    lines = [f"[{g.name}] {g.title}" for g in groups] + notes
    lines.append("accept = accepted ÷ drafted (mlx-lm: from its from_draft flags); draft / verify / recov = shares of "
                 "time of verity's drafting rounds, as its scheduler was told them (n/a for mlx-lm); × base = tok/s ÷ mlx-lm generate_step's; "
                 "exact = every run's output equals the baseline's token for token (✗: mismatching tokens, "
                 "first index)")
    if worst:
        lines.append(f"goal 1, fast-path recovery ≤ {RECOVERY_GOAL:.0%} of cycle time: "
                     f"{'MET' if goal1 else 'MISSED'} in {n_met}/{len(fast)} fast rows (worst {worst['group']} "
                     f"{worst['label']} ({worst['draft_label']}): {worst['recovery_share']:.1%})")
    how = (f"cycle-interleaved duels, {s.duel_cycles} timed cycles each side" if duels
           else "the table's run medians")
    lines.append(f"goal 2, verity joint (fast) ÷ mlx-lm speculative tok/s, same draft and k, llama pair, from {how}:")
    for draft, by_k in judged.items():
        detail = ", ".join(
            f"k={k} {x:.3f}" + (f" (blocks {duels[draft][k]['block_ratio_iqr'][0]:.2f}–"
                                f"{duels[draft][k]['block_ratio_iqr'][1]:.2f})" if duels else "")
            for k, x in by_k.items())
        lines.append(f"  {draft} draft: {detail}  → {'MET' if goal2[draft] else 'MISSED'} (≥ 1 at every k)")
    for draft, by_rec in ratios.items():
        for rec, by_k in by_rec.items():
            per_round = ", ".join(f"k={k} {x:.2f}" for k, x in paired.get(draft, {}).items())
            lines.append(f"  table ratio, {rec} ÷ mlx-lm, {draft} draft: "
                         + ", ".join(f"k={k} {x:.2f}" for k, x in by_k.items())
                         + (f" (median of per-round ratios: {per_round})" if rec == "fast" else ""))
    lines.append(f"headline ratio = verity joint (fast) ÷ mlx-lm speculative tok/s, llama pair, perturbed draft, "
                 f"k={hk} (same k both sides), from {how}: {headline:.3f} (table: {headline_runs:.3f})"
                 + (f"; verity's best k there: {best_k}" if best_k else ""))
    mism = [f for f in all_figs if f.get("mismatches")]
    duel_mism = sum(x["mismatches"] > 0 for by_k in duels.values() for x in by_k.values())
    duel_checked = sum(x["generations_checked"] for by_k in duels.values() for x in by_k.values())
    lines.append("exactness: " + ("every run of every row equals its baseline token for token" if not mism else
                                  f"{len(mism)} rows differ: " + "; ".join(
                                      f"{f['group']} {f['label']} ({f['draft_label']}; {f['mismatches']} tokens, "
                                      f"near-tie {f.get('near_tie')})" for f in mism))
                 + (f"; duels: {duel_checked} generations checked, {duel_mism} duels with mismatches" if duels else ""))
    lines.append(f"wall time {wall_s:.0f}s")
    figures = {
        "bench": "joint", "ks": list(s.ks), "alphas": list(s.alphas), "tokens": s.tokens, "tiny_tokens": s.tiny_tokens,
        "repeats": s.repeats, "groups": [{"name": g.name, "title": g.title, "prompt_tokens": len(g.prompt),
                                          "tokens": g.tokens} for g in groups],
        "rows": all_figs,
        "ratio": headline, "ratio_k": hk, "ratio_runs": headline_runs,
        "ratio_definition": f"verity joint (fast) ÷ mlx-lm speculative decode tok/s, llama pair, perturbed draft, "
                            f"k={hk}, from {how}",
        "ratios_vs_mlx": ratios, "ratios_vs_mlx_paired": paired, "duels": duels, "best_k": best_k,
        "goals": {"recovery_share_max": RECOVERY_GOAL, "recovery_goal_met": goal1,
                  "recovery_worst": worst["recovery_share"] if worst else None,
                  "mlx_ratio_min": 1.0, "mlx_goal_met": goal2},
        "mismatching_rows": len(mism), "duel_mismatches": duel_mism, "wall_s": wall_s,
    }
    return figures, rows, "\n".join(lines)


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _find(figs: list[dict], group, method, draft, k, recovery) -> Optional[dict]:
    return next((f for f in figs if f["group"] == group and f["method"] == method and f["draft"] == draft
                 and f["k"] == k and f["recovery"] == recovery and "tps" in f), None)


def _find_row(groups: list[Group], group, method, draft, k, recovery) -> Optional[Row]:
    return next((r for g in groups if g.name == group for r in g.rows if r.method == method and r.draft == draft
                 and r.k == k and r.recovery == recovery and r.runs), None)


def add_command(benches) -> None:
    p = benches.add_parser("joint", help="joint decoding (speculative) vs plain decoding and mlx-lm's speculative")
    p.add_argument("--tokens", type=int, default=None, help="tokens per run for the embedded rows (default 128)")
    p.add_argument("--tiny-tokens", type=int, default=None, help="tokens per run for the tiny pairs (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="alternated timed rounds after a warm-up (default 3)")
    p.add_argument("--quick", action="store_true",
                   help=f"small settings for a test: k {QUICK['ks']}, α {QUICK['alphas']}, {QUICK['tokens']} embedded "
                        f"and {QUICK['tiny_tokens']} tiny tokens, {QUICK['repeats']} round")
    p.add_argument("--duel-cycles", type=int, default=None,
                   help=f"cycles each side in the cycle-interleaved verity vs mlx-lm duels, llama pair (default "
                        f"{DUEL_CYCLES}; 0: none)")
    p.add_argument("--k", dest="ks", type=int, nargs="+", default=None, help=f"draft budgets (default {KS})")
    p.add_argument("--alpha", dest="alphas", type=float, nargs="+", default=None,
                   help=f"controlled-draft acceptance for the embedded rows (default {ALPHAS})")
    p.add_argument("--groups", nargs="+", default=["llama", "hybrid", "distilled", "embedded"],
                   choices=["llama", "hybrid", "distilled", "embedded"], help="which groups of rows to run")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    p.set_defaults(run=run_spec)
