"""The measuring side of `verity bench joint` (bench/joint.py holds the command, its settings
and the report): the groups of rows with their models, the runners that time greedy decoding,
the ABBA-alternated rounds and the token-for-token checks against each group's baseline. The
cycle-interleaved duels against mlx-lm live in bench/joint_duels.py.

Progress goes through the `progress` callable the caller passes in; nothing here prints.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from bench.divergence import first_divergence, top2_gap
from bench.engine_runs import Run

RECOVERIES = ("fast", "replay")
NEAR_TIE = 1e-3  # docs/design.md, "Exactness": a divergence is tolerated only where the top two logits differ less

LLAMA_SHAPE = dict(hidden=256, layers=6)
PERTURB_NOISE = 0.3
SMALL_DRAFT_LAYERS, SMALL_DRAFT_NOISE = 1, 0.65  # about half of its proposals accepted
HYBRID_SHAPE = dict(hidden=64, layers=4)
EMBEDDED_DRAFT_SHAPE = dict(hidden=256, layers=2)
EMBEDDED_VOCAB = 49152


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
    duel_drafts: dict = field(default_factory=dict)  # draft name -> LoadedModel, for the cycle-interleaved duels
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


def verity_joint(target, draft, prompt: list[int], k: int, recovery: str, controls=None) -> Callable[[int], Run]:
    """verity's engine (target and draft: LoadedModels), one joint request at a time at a fixed
    k; one engine for all the row's runs, as a server's. `controls`: the controlled draft."""
    from bench import engine_runs as er

    e = er.engine(target, draft, k, recovery, controls=controls)
    return lambda n: er.run_one(e, prompt, n)


def _rate(n: int, seconds: float) -> float:
    return n / seconds if n > 0 and seconds > 0 else math.nan


# ---- models ----


def small_draft(src: Path, dst: Path, layers: int, noise: float, seed: int = 1) -> Path:
    """A smaller llama of the same tokenizer: src's embeddings, first `layers` layers, final norm
    and head, each tensor plus relative Gaussian noise (as bench.tiny_models perturbs)."""
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
    from worker.state.checkpoint import install_recording

    lm = load_model(str(folder))
    install_recording(lm.model)
    return lm


def _prompt(lm, text: str) -> list[int]:
    from protocol.messages import GenerateRequest, Message
    from worker.text import render_prompt

    return render_prompt(lm.tokenizer, GenerateRequest(messages=[Message(role="user", content=text)]))


def _params_m(lm, own: bool = False) -> float:
    """Millions of parameters; own: without a shared embedding."""
    from mlx.utils import tree_flatten

    return sum(p.size for k, p in tree_flatten(lm.model.parameters()) if not (own and "embed_tokens" in k)) / 1e6


def build_groups(root: Path, s: argparse.Namespace, progress: Callable[[str], None]) -> list[Group]:
    from bench.drafters import controls
    from bench.tiny_models import build_tiny_model
    from worker.loader import check_tokenizers_agree, load_model
    from worker.state.checkpoint import install_recording

    groups = []

    def joint_and_spec(g: Group, draft_name: str, draft, mlx_ok: bool) -> None:
        for k in s.ks:
            for rec in RECOVERIES:
                g.rows.append(Row(g.name, "verity joint", draft_name, k, rec, None,
                                  verity_joint(g.target, draft, g.prompt, k, rec)))
            if mlx_ok:
                g.rows.append(Row(g.name, "mlx-lm speculative", draft_name, k, None, None,
                                  mlx_speculative(g.target.model, draft.model, g.prompt, k)))

    def baselines(g: Group, k0_draft) -> None:
        g.rows += [Row(g.name, "mlx-lm generate_step", None, 0, None, None, mlx_baseline(g.target.model, g.prompt)),
                   Row(g.name, "verity k=0", None, 0, "fast", None, verity_joint(g.target, k0_draft, g.prompt, 0, "fast"))]

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
        baselines(g, perturbed)
        joint_and_spec(g, "perturbed", perturbed, True)
        joint_and_spec(g, "1-layer", small, True)
        g.duel_drafts = {"perturbed": perturbed, "1-layer": small}
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
        baselines(g, perturbed)
        joint_and_spec(g, "perturbed", perturbed, False)
        g.rows.append(Row(g.name, "mlx-lm speculative", "perturbed", 0, None, None, None,
                          error=_mlx_refusal(target.model, perturbed.model, g.prompt)))
        groups.append(g)

    if "distilled" in s.groups:
        progress("loading the embedded model and its distilled draft …")
        from worker.loader import load_draft

        target = load_model("embedded")
        draft = load_draft("embedded", target)
        g = Group("distilled", f"distilled: {target.model_id} ({target.quantization}) with its draft distilled here "
                  f"({draft.model_id}@{draft.revision}, {_params_m(draft, own=True):.1f} M own params)",
                  _prompt(target, s.prompt), s.tokens, target, [])
        baselines(g, draft)
        joint_and_spec(g, "distilled", draft, True)
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
        baselines(g, draft)
        refs = {tuple(g.prompt): (0, g.reference)}  # the reference: filled in place by measure_group
        for alpha in s.alphas:
            chosen = controls(refs, lambda _, a=alpha: a, vocab)
            for k in s.ks:
                for rec in RECOVERIES:
                    g.rows.append(Row(g.name, "verity joint", "controlled", k, rec, alpha,
                                      verity_joint(target, draft, g.prompt, k, rec, chosen)))
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


# ---- exactness ----


def check_exact(g: Group, row: Row, out: list[int]) -> None:
    ref = g.reference[: g.tokens]
    mismatches = sum(a != b for a, b in zip(out, ref)) + abs(len(out) - len(ref))
    e = row.exact
    e["mismatches"] = max(e.get("mismatches", 0), mismatches)
    e["runs_checked"] = e.get("runs_checked", 0) + 1
    if mismatches and "first_divergence" not in e:
        i = first_divergence(out, ref)
        e["first_divergence"] = i
        e["top2_gap"] = top2_gap(g.target.model, g.prompt + ref[:i])
        e["near_tie"] = e["top2_gap"] < NEAR_TIE


# ---- the timed rounds ----


def measure_group(g: Group, s: argparse.Namespace, progress: Callable[[str], None]) -> None:
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



# ---- MLX state the command reports or resets ----


def device() -> str:
    import mlx.core as mx

    return str(mx.default_device())


def clear_cache() -> None:
    import mlx.core as mx

    mx.clear_cache()
