"""`verity bench spec`: speculative decoding side by side, in one process, greedy everywhere.

Groups of rows, each with its own target and reference output:

- llama: a tiny random llama target (hidden 256, 6 layers) with two drafts of its tokenizer: a
  perturbed copy (noise 0.3, as costly as the target) and a one-layer draft (the target's first
  layer, embeddings and head, plus noise: much cheaper). Rows: plain target decoding (mlx-lm
  generate_step and verity's JointDecoder at k = 0), verity's joint cycle at each k under each
  recovery path, and mlx-lm's speculative_generate_step with the same draft and k. Then, for
  each draft and k, a duel: verity (fast) and mlx-lm take turns one cycle at a time, which
  resolves their ratio far better than whole runs on a shared machine; the headline is its ratio.
- hybrid: a tiny Qwen3.5 target (Gated DeltaNet + attention) with a perturbed copy as draft.
  mlx-lm refuses it (its caches cannot be trimmed); the row says so.
- embedded: SmolLM2-135M (float32) with the controlled-acceptance draft at several α: a small
  random llama of the same vocabulary runs its real forward (carrying the draft's cost) while
  the target's known greedy continuation is proposed with probability α.

Every timed run is checked token for token against the group's greedy baseline (mlx-lm
generate_step), and runs alternate (ABBA order over the repeats) so that drift on a shared
machine spreads over all rows; figures are medians.

Decode tokens/s excludes prefill: verity rows count the tokens after start() over the time of
the cycles; mlx-lm's generate_step the tokens after its first over the time since it; mlx-lm's
speculative_generate_step the tokens after its first cycle (which holds the prefill) over the
time since that cycle ended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cli.bench import DEFAULT_PROMPT, median, print_report, progress
from cli.blas import reexec_with_blas

KS = (1, 2, 4, 8)
ALPHAS = (0.5, 0.8, 0.95)
RECOVERIES = ("fast", "replay")
HEADLINE_K = 4
RECOVERY_GOAL = 0.05  # fast-path recovery ≤ 5% of cycle time
NEAR_TIE = 1e-3  # DESIGN.md: a divergence is tolerated only where the top two logits differ less

LLAMA_SHAPE = dict(hidden=256, layers=6)
PERTURB_NOISE = 0.3
SMALL_DRAFT_LAYERS, SMALL_DRAFT_NOISE = 1, 0.65  # about half of its proposals accepted
HYBRID_SHAPE = dict(hidden=64, layers=4)
EMBEDDED_DRAFT_SHAPE = dict(hidden=256, layers=2)
EMBEDDED_VOCAB = 49152

QUICK = dict(ks=(1, 4), alphas=(0.8,), tokens=12, tiny_tokens=16, repeats=1, duel_cycles=20)
DUEL_CYCLES = 300


@dataclass
class Run:
    tokens: list
    tps: float
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    recovery_s: float = 0.0


@dataclass
class Row:
    group: str
    method: str  # "mlx-lm generate_step" | "verity k=0" | "verity joint" | "mlx-lm speculative"
    draft: Optional[str]
    k: int
    recovery: Optional[str]
    alpha: Optional[float]
    run: Optional[Callable[[int], Run]]
    runs: list = field(default_factory=list)
    error: Optional[str] = None
    exact: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.method in ("mlx-lm generate_step", "verity k=0"):
            return f"baseline: {self.method}"
        return " ".join([self.method, f"k={self.k}"] + ([self.recovery] if self.recovery else []))

    @property
    def draft_label(self) -> str:
        return f"α={self.alpha}" if self.alpha is not None else (self.draft or "")


@dataclass
class Group:
    name: str
    title: str
    prompt: list
    tokens: int
    target: object  # the LoadedModel
    rows: list
    reference: list = field(default_factory=list)
    duel_drafts: dict = field(default_factory=dict)  # draft name -> model, for the cycle-interleaved duels
    duels: dict = field(default_factory=dict)  # draft name -> k -> figures


# ---- runners: each generates n tokens greedily and times the decode ----


def mlx_baseline(model, prompt: list[int]) -> Callable[[int], Run]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    def run(n: int) -> Run:
        out, t1 = [], 0.0
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
            out.append(int(tok))
            if len(out) == 1:
                t1 = time.perf_counter()
        return Run(out, _rate(n - 1, time.perf_counter() - t1))

    return run


def mlx_speculative(model, draft, prompt: list[int], k: int) -> Callable[[int], Run]:
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    def run(n: int) -> Run:
        gen = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=n)
        out, drafted, accepted, new_cycle = [], 0, 0, True
        t_first_cycle, n_first_cycle = None, 0
        for tok, _, from_draft in gen:
            if new_cycle:  # mlx-lm drafts min(k, tokens still due) at each cycle
                drafted += min(k, n - len(out))
                new_cycle = False
            out.append(int(tok))
            accepted += bool(from_draft)
            if not from_draft:
                new_cycle = True
                if t_first_cycle is None:
                    t_first_cycle, n_first_cycle = time.perf_counter(), len(out)
            if len(out) == n:
                break
        t_end = time.perf_counter()
        gen.close()
        if t_first_cycle is None:
            return Run(out, math.nan, drafted, accepted)
        return Run(out, _rate(n - n_first_cycle, t_end - t_first_cycle), drafted, accepted)

    return run


def verity_joint(model, make_drafter: Callable[[str], object], prompt: list[int], k: int,
                 recovery: str) -> Callable[[int], Run]:
    from worker.spec.joint import JointDecoder
    from worker.spec.sampling import SamplingParams

    def run(n: int) -> Run:
        jd = JointDecoder(model, make_drafter(recovery), prompt, SamplingParams(), recovery=recovery)
        out = [jd.start()]
        t0 = time.perf_counter()
        while len(out) < n:
            emitted = jd.cycle(min(k, n - len(out) - 1))
            keep = min(len(emitted), n - len(out))
            jd.commit(keep)
            out += emitted[:keep]
        dt = time.perf_counter() - t0
        s = jd.stats
        return Run(out, _rate(n - 1, dt), s.drafted, s.accepted, s.draft_s, s.verify_s, s.recovery_s)

    return run


def _rate(n: int, seconds: float) -> float:
    return n / seconds if n > 0 and seconds > 0 else math.nan


# ---- models ----


def small_draft(src: Path, dst: Path, layers: int, noise: float, seed: int = 1) -> Path:
    """A smaller llama of the same tokenizer: src's embeddings, first `layers` layers, final norm
    and head, each tensor plus relative Gaussian noise (as worker.tiny_models perturbs)."""
    import mlx.core as mx

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = {name: w for name, w in mx.load(str(src / "model.safetensors")).items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    keys = mx.random.split(mx.random.key(seed), len(weights))
    weights = {name: w + noise * mx.std(w) * mx.random.normal(w.shape, key=key)
               for (name, w), key in zip(sorted(weights.items()), keys)}
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def _load(folder: Path):
    from worker.loader import load_model
    from worker.spec.state import install_recording

    lm = load_model(str(folder))
    install_recording(lm.model)
    return lm


def _prompt(lm, text: str) -> list[int]:
    from protocol.messages import GenerateRequest, Message
    from worker.text import render_prompt

    return render_prompt(lm.tokenizer, GenerateRequest(messages=[Message(role="user", content=text)]))


def _params_m(lm) -> float:
    from mlx.utils import tree_flatten

    return sum(p.size for _, p in tree_flatten(lm.model.parameters())) / 1e6


def build_groups(root: Path, s: argparse.Namespace) -> list[Group]:
    from worker.loader import check_tokenizers_agree, load_model
    from worker.spec.draft import ControlledDrafter, Drafter
    from worker.spec.state import install_recording
    from worker.tiny_models import build_tiny_model

    groups = []

    def joint_and_spec(g: Group, draft_name: str, draft_model, mlx_ok: bool) -> None:
        for k in s.ks:
            for rec in RECOVERIES:
                make = lambda r, m=draft_model: Drafter(m, recovery=r)  # noqa: E731
                g.rows.append(Row(g.name, "verity joint", draft_name, k, rec, None,
                                  verity_joint(g.target.model, make, g.prompt, k, rec)))
            if mlx_ok:
                g.rows.append(Row(g.name, "mlx-lm speculative", draft_name, k, None, None,
                                  mlx_speculative(g.target.model, draft_model, g.prompt, k)))

    def baselines(g: Group, k0_draft) -> None:
        g.rows += [Row(g.name, "mlx-lm generate_step", None, 0, None, None, mlx_baseline(g.target.model, g.prompt)),
                   Row(g.name, "verity k=0", None, 0, "fast", None,
                       verity_joint(g.target.model, lambda r: Drafter(k0_draft, recovery=r), g.prompt, 0, "fast"))]

    if "llama" in s.groups:
        progress("building the llama pair …")
        t_dir = build_tiny_model(root / "llama-target", "llama", seed=0, **LLAMA_SHAPE)
        p_dir = build_tiny_model(root / "llama-perturbed", "llama", seed=1, perturb_from=t_dir, noise=PERTURB_NOISE)
        s_dir = small_draft(t_dir, root / "llama-small", SMALL_DRAFT_LAYERS, SMALL_DRAFT_NOISE)
        target, perturbed, small = _load(t_dir), _load(p_dir), _load(s_dir)
        for d in (perturbed, small):
            check_tokenizers_agree(target.tokenizer, d.tokenizer)
        g = Group("llama", f"llama pair: tiny random llama target ({_params_m(target):.1f} M params, "
                  f"hidden {LLAMA_SHAPE['hidden']}, {LLAMA_SHAPE['layers']} layers); drafts: perturbed copy "
                  f"(noise {PERTURB_NOISE}), {SMALL_DRAFT_LAYERS}-layer draft ({_params_m(small):.1f} M, noise "
                  f"{SMALL_DRAFT_NOISE})", _prompt(target, s.prompt), s.tiny_tokens, target, [])
        baselines(g, perturbed.model)
        joint_and_spec(g, "perturbed", perturbed.model, True)
        joint_and_spec(g, "1-layer", small.model, True)
        g.duel_drafts = {"perturbed": perturbed.model, "1-layer": small.model}
        groups.append(g)

    if "hybrid" in s.groups:
        progress("building the hybrid pair …")
        t_dir = build_tiny_model(root / "hybrid-target", "qwen3_5", seed=0, **HYBRID_SHAPE)
        p_dir = build_tiny_model(root / "hybrid-perturbed", "qwen3_5", seed=1, perturb_from=t_dir, noise=PERTURB_NOISE)
        target, perturbed = _load(t_dir), _load(p_dir)
        check_tokenizers_agree(target.tokenizer, perturbed.tokenizer)
        g = Group("hybrid", f"hybrid pair: tiny random Qwen3.5 target ({_params_m(target):.2f} M params, hidden "
                  f"{HYBRID_SHAPE['hidden']}, {HYBRID_SHAPE['layers']} layers: Gated DeltaNet + attention); "
                  f"draft: perturbed copy (noise {PERTURB_NOISE})", _prompt(target, s.prompt), s.tiny_tokens,
                  target, [])
        baselines(g, perturbed.model)
        joint_and_spec(g, "perturbed", perturbed.model, False)
        g.rows.append(Row(g.name, "mlx-lm speculative", "perturbed", 0, None, None, None,
                          error=_mlx_refusal(target.model, perturbed.model, g.prompt)))
        groups.append(g)

    if "embedded" in s.groups:
        progress("loading the embedded model …")
        target = load_model("embedded")
        install_recording(target.model)
        d_dir = build_tiny_model(root / "embedded-draft", "llama", seed=3, vocab=EMBEDDED_VOCAB, **EMBEDDED_DRAFT_SHAPE)
        draft = _load(d_dir)
        vocab = len(target.tokenizer)
        g = Group("embedded", f"embedded: {target.model_id} ({target.quantization}, {_params_m(target):.0f} M params); "
                  f"controlled draft: proposes the target's greedy continuation with probability α, its cost "
                  f"carried by a random llama ({_params_m(draft):.1f} M params, hidden "
                  f"{EMBEDDED_DRAFT_SHAPE['hidden']}, {EMBEDDED_DRAFT_SHAPE['layers']} layers, vocab {EMBEDDED_VOCAB})",
                  _prompt(target, s.prompt), s.tokens, target, [])
        baselines(g, draft.model)
        for alpha in s.alphas:
            for k in s.ks:
                for rec in RECOVERIES:
                    def make(r, a=alpha, ref=g.reference):  # ref: filled in place by measure_group
                        return ControlledDrafter(draft.model, ref, lambda _: a, vocab, seed=0, recovery=r)
                    g.rows.append(Row(g.name, "verity joint", "controlled", k, rec, alpha,
                                      verity_joint(target.model, make, g.prompt, k, rec)))
        groups.append(g)
    return groups


def _mlx_refusal(model, draft, prompt) -> Optional[str]:
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    try:
        next(speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=2, max_tokens=2))
    except ValueError as e:
        return f"refused: {e}"
    return None


# ---- cycle-interleaved duels: verity (fast) and mlx-lm take turns one cycle at a time ----


class VerityCycles:
    """verity's joint decoding (fast recovery) one cycle at a time; restarts (prefill untimed) after n tokens."""

    def __init__(self, model, draft, prompt: list[int], k: int, n: int):
        self.model, self.draft, self.prompt, self.k, self.n = model, draft, prompt, k, n
        self.jd, self.out, self.finished = None, [], []

    def cycle(self) -> tuple[float, int]:
        from worker.spec.draft import Drafter
        from worker.spec.joint import JointDecoder
        from worker.spec.sampling import SamplingParams

        if self.jd is None or len(self.out) >= self.n:
            if self.jd is not None:
                self.finished.append(self.out)
            self.jd = JointDecoder(self.model, Drafter(self.draft, recovery="fast"), self.prompt, SamplingParams(),
                                   recovery="fast")
            self.out = [self.jd.start()]
        t0 = time.perf_counter()
        emitted = self.jd.cycle(min(self.k, self.n - len(self.out) - 1))
        keep = min(len(emitted), self.n - len(self.out))
        self.jd.commit(keep)
        dt = time.perf_counter() - t0
        self.out += emitted[:keep]
        return dt, keep


class MlxCycles:
    """mlx-lm's speculative_generate_step one cycle at a time (a cycle ends with the target's own token;
    it includes the previous cycle's cache rewind); the first cycle of each generation holds the
    prefill and is not timed."""

    def __init__(self, model, draft, prompt: list[int], k: int, n: int):
        self.model, self.draft, self.prompt, self.k, self.n = model, draft, prompt, k, n
        self.gen, self.out, self.finished = None, [], []

    def _one(self) -> int:
        m = 0
        for tok, _, from_draft in self.gen:
            self.out.append(int(tok))
            m += 1
            if not from_draft or len(self.out) >= self.n:
                break
        return m

    def cycle(self) -> tuple[float, int]:
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step

        while self.gen is None or len(self.out) >= self.n:
            if self.gen is not None:
                self.gen.close()
                self.finished.append(self.out)
            self.gen = speculative_generate_step(mx.array(self.prompt), self.model, self.draft,
                                                 num_draft_tokens=self.k, max_tokens=self.n)
            self.out = []
            self._one()
        t0 = time.perf_counter()
        m = self._one()
        return time.perf_counter() - t0, m


def duel(g: Group, draft_name: str, k: int, cycles: int) -> dict:
    """verity (fast) and mlx-lm alternate single cycles (ABBA), so that drift on a shared machine
    hits both alike; returns their tokens/s over all timed cycles and the ratio."""
    draft = g.duel_drafts[draft_name]
    players = [VerityCycles(g.target.model, draft, g.prompt, k, g.tokens),
               MlxCycles(g.target.model, draft, g.prompt, k, g.tokens)]
    for p in players:  # warm-up
        for _ in range(max(3, cycles // 10)):
            p.cycle()
    timed = [[], []]
    for i in range(cycles):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            timed[j].append(players[j].cycle())
    rate = [sum(m for _, m in t) / sum(dt for dt, _ in t) for t in timed]
    block = max(5, cycles // 10)

    def block_rate(t: list, b: int) -> float:
        return sum(m for _, m in t[b : b + block]) / sum(dt for dt, _ in t[b : b + block])

    blocks = [block_rate(timed[0], b) / block_rate(timed[1], b) for b in range(0, cycles - block + 1, block)]
    q = statistics.quantiles(blocks, n=4) if len(blocks) >= 2 else [blocks[0]] * 3
    ref = g.reference[: g.tokens]
    outs = [o for p in players for o in p.finished]
    mism = max((sum(a != b for a, b in zip(o, ref)) + abs(len(o) - len(ref)) for o in outs), default=0)
    return {"cycles": cycles, "verity_tps": rate[0], "mlx_tps": rate[1], "ratio": rate[0] / rate[1],
            "block_ratio_median": statistics.median(blocks), "block_ratio_iqr": [q[0], q[2]],
            "tokens_per_cycle": sum(m for _, m in timed[0]) / cycles,
            "generations_checked": len(outs), "mismatches": mism}


def run_duels(g: Group, s: argparse.Namespace) -> None:
    if not g.duel_drafts or s.duel_cycles <= 0:
        return
    for name in g.duel_drafts:
        for k in s.ks:
            t0 = time.perf_counter()
            d = g.duels.setdefault(name, {})[str(k)] = duel(g, name, k, s.duel_cycles)
            progress(f"[{g.name}] duel, {name} draft, k={k}: verity {d['verity_tps']:.1f} tok/s, mlx-lm "
                     f"{d['mlx_tps']:.1f} → {d['ratio']:.3f} ({time.perf_counter() - t0:.0f}s)")


# ---- exactness ----


def top2_gap(model, tokens: list[int]) -> float:
    import mlx.core as mx

    top = mx.sort(model(mx.array(tokens)[None])[0, -1])[-2:].tolist()
    return top[1] - top[0]


def check_exact(g: Group, row: Row, out: list[int]) -> None:
    ref = g.reference[: g.tokens]
    mismatches = sum(a != b for a, b in zip(out, ref)) + abs(len(out) - len(ref))
    e = row.exact
    e["mismatches"] = max(e.get("mismatches", 0), mismatches)
    e["runs_checked"] = e.get("runs_checked", 0) + 1
    if mismatches and "first_divergence" not in e:
        i = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        e["first_divergence"] = i
        e["top2_gap"] = top2_gap(g.target.model, g.prompt + ref[:i])
        e["near_tie"] = e["top2_gap"] < NEAR_TIE


# ---- the bench ----


def run_spec(args: argparse.Namespace) -> int:
    reexec_with_blas()
    s = _settings(args)
    if s.tokens < 2 or s.tiny_tokens < 2 or s.repeats < 1:
        progress("--tokens and --tiny-tokens must be ≥ 2, --repeats ≥ 1")
        return 2
    import mlx.core as mx

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verity-bench-spec-") as tmp:
        groups = build_groups(Path(tmp), s)
        for g in groups:
            measure_group(g, s)
            run_duels(g, s)
            mx.clear_cache()
    figures, rows, footer = report(groups, s, time.perf_counter() - t_start)
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "160")  # rich's default of 80 would wrap the table
    n_runs = s.repeats
    print_report(f"bench spec: greedy, decode tokens/s (prefill excluded), median of {n_runs} alternated "
                 f"round{'s' if n_runs > 1 else ''}; MLX on {mx.default_device()}",
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


def measure_group(g: Group, s: argparse.Namespace) -> None:
    timed = [r for r in g.rows if r.run is not None]
    base = timed[0]  # mlx-lm generate_step
    progress(f"[{g.name}] reference: {g.tokens} + {max(s.ks)} greedy tokens, {len(g.prompt)} prompt tokens")
    g.reference[:] = base.run(g.tokens + max(s.ks)).tokens  # in place: controlled drafts hold it
    warm = min(g.tokens, 2 * max(s.ks) + 2)
    progress(f"[{g.name}] warm-up: {len(timed)} rows × {warm} tokens")
    for r in timed:
        r.run(warm)
    for i in range(s.repeats):
        t0 = time.perf_counter()
        order = timed if i % 2 == 0 else timed[::-1]  # ABBA alternation
        for r in order:
            result = r.run(g.tokens)
            r.runs.append(result)
            check_exact(g, r, result.tokens)
        b = base.runs[-1].tps
        best = max((r for r in timed if r.method == "verity joint"), key=lambda r: r.runs[-1].tps, default=None)
        progress(f"[{g.name}] round {i + 1}/{s.repeats} ({time.perf_counter() - t0:.0f}s): baseline {b:.1f} tok/s"
                 + (f", best joint {best.label} ({best.draft_label}) {best.runs[-1].tps:.1f}" if best else ""))


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
    return {**f, "tps": tps, "tps_runs": [x.tps for x in r.runs], "speedup": tps / base_tps if base_tps else None,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            **shares, "tokens": len(r.runs[0].tokens), **{"mismatches": 0, **r.exact}}


def report(groups: list[Group], s: argparse.Namespace, wall_s: float) -> tuple[dict, list, str]:
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
                 "cycle time from verity's CycleStats (n/a for mlx-lm); × base = tok/s ÷ mlx-lm generate_step's; "
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
        "bench": "spec", "ks": list(s.ks), "alphas": list(s.alphas), "tokens": s.tokens, "tiny_tokens": s.tiny_tokens,
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
    p = benches.add_parser("spec", help="speculative decoding: verity's joint cycle vs plain decoding and mlx-lm's")
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
    p.add_argument("--groups", nargs="+", default=["llama", "hybrid", "embedded"],
                   choices=["llama", "hybrid", "embedded"], help="which groups of rows to run")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    p.set_defaults(run=run_spec)
