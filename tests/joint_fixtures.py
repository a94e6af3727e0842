"""Target/draft pairs for the joint-path tests, and the runs they compare."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import generate_step

from bench.tiny_models import build_tiny_model
from worker.loader import LoadedModel, check_tokenizers_agree, load_model
from bench.drafters import ControlledDrafter
from worker.joint.draft import Drafter
from worker.joint.decoder import JointDecoder
from worker.joint.sampling import SamplingParams
from worker.state.checkpoint import install_recording

PAIRS = {"llama+llama": ("llama", "llama"), "qwen3_5+qwen3_5": ("qwen3_5", "qwen3_5"),
         "qwen3_5+llama": ("qwen3_5", "llama")}
DRAFTS = ("copy", "wrong", "perturbed")
PERTURB_NOISE = 0.3  # about half the proposals accepted (bench/tiny_models.py)
K_SCHEDULE = (4, 0, 0, 1, 3, 0, 2, 5)  # every verify width, and pipelined plain cycles (k = 0) between
PROMPTS = [
    "the quick brown fox", "hello world", "once upon a time", "one two three four", "tell me a story",
    "what is the capital", "a b c d e f", "the cat sat on the mat", "numbers 12345", "good morning",
    "why is the sky blue", "list three colors", "the end of the road", "hi", "make a plan for today",
    "it was a dark and stormy night", "the rain in spain", "to be or not to be", "abc", "translate this",
]


@dataclass
class Pair:
    target: LoadedModel
    drafts: dict  # kind -> LoadedModel
    cross: bool  # draft of another architecture: no copy of the target exists


def build_pair(root: Path, target_arch: str, draft_arch: str) -> tuple[Path, dict]:
    target = build_tiny_model(root / f"{target_arch}-target", target_arch, seed=0)
    if draft_arch == target_arch:
        perturbed = build_tiny_model(root / f"{draft_arch}-perturbed", draft_arch, seed=1,
                                     perturb_from=target, noise=PERTURB_NOISE)
        return target, {"copy": target, "perturbed": perturbed}
    # another architecture with the target's tokenizer: a copy is impossible, so its drafts are
    # a random model (mostly wrong) and a controlled one
    vocab = load_model(str(target)).tokenizer
    other = build_tiny_model(root / f"{draft_arch}-other", draft_arch, seed=2, vocab=len(vocab))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / f, other / f)
    return target, {"copy": other, "perturbed": other}


def load_pair(root: Path, name: str) -> Pair:
    t_arch, d_arch = PAIRS[name]
    target_dir, draft_dirs = build_pair(root / name, t_arch, d_arch)
    target = load_model(str(target_dir))
    install_recording(target.model)
    drafts = {}
    for kind, d in draft_dirs.items():
        lm = load_model(str(d))
        check_tokenizers_agree(target.tokenizer, lm.tokenizer)
        install_recording(lm.model)
        drafts[kind] = lm
    return Pair(target, drafts, t_arch != d_arch)


def prompt_ids(lm: LoadedModel, text: str) -> list[int]:
    hf = lm.tokenizer._tokenizer
    rendered = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return lm.tokenizer.encode(rendered, add_special_tokens=False)


def baseline_greedy(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    out = []
    for tok, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n):
        out.append(tok)
    return out


def make_drafter(pair: Pair, kind: str, recovery: str, reference: list[int]) -> Drafter:
    if kind == "wrong":
        d = pair.drafts["perturbed"]
        return ControlledDrafter(d.model, reference, lambda _: 0.0, len(pair.target.tokenizer), recovery=recovery)
    if kind == "copy" and pair.cross:  # proposes the target's own continuation
        d = pair.drafts["copy"]
        return ControlledDrafter(d.model, reference, lambda _: 1.0, len(pair.target.tokenizer), recovery=recovery)
    return Drafter(pair.drafts[kind].model, recovery=recovery)


def joint_greedy(pair: Pair, drafter: Drafter, prompt: list[int], n: int, recovery: str,
                 on_cycle=None, pipelined_start: bool = True) -> tuple[list[int], JointDecoder]:
    """Greedy joint decoding through K_SCHEDULE; the start pipelined by default, so its first,
    drafting cycle throws the forward computed ahead away (the engine starts unpipelined where
    drafting comes first, which the engine's tests run)."""
    jd = JointDecoder(pair.target.model, drafter, prompt, SamplingParams(), recovery=recovery)
    out = [jd.start(pipelined_start)]
    i = 0
    while len(out) < n:
        room = max(0, n - len(out) - 1 - jd.looking_ahead)  # as the engine caps drafts (a taken look-ahead emits one more)
        emitted = jd.cycle(min(K_SCHEDULE[i % len(K_SCHEDULE)], room), n - len(out) <= 1)
        keep = min(len(emitted), n - len(out))
        jd.commit(keep)
        out += emitted[:keep]
        i += 1
        if on_cycle:
            on_cycle(jd)
    return out, jd


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def top2_gap(lm: LoadedModel, prefix: list[int]) -> float:
    logits = lm.model(mx.array(prefix)[None])[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]
