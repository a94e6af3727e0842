"""Target/draft pairs for the joint-path tests, and the runs they compare."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from bench.divergence import first_divergence, top2_gap as model_top2_gap  # noqa: F401 (tests take first_divergence from here)
from bench.drafters import Controlled
from bench.tiny_models import build_tiny_model
from protocol import messages as m
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, check_tokenizers_agree, load_model
from worker.round import RoundInput, RoundPlan
from worker.scheduler import Scheduler
from worker.state.checkpoint import install_recording
from worker.text import render_prompt

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
    """The prompt the engine renders for `greedy(text, n)`."""
    return render_prompt(lm.tokenizer, greedy(text, 1))


def baseline_greedy(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    out = []
    for tok, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n):
        out.append(tok)
    return out


class Schedule(Scheduler):
    """Plans draft lengths from a fixed schedule (row i of a round takes the entry i further on),
    within each row's room: every verify width, and plain rounds between them."""

    def __init__(self, ks=K_SCHEDULE):
        super().__init__(fixed=0)
        self.ks, self.round = ks, 0

    def plan_round(self, inp: RoundInput) -> RoundPlan:
        self.round += 1
        return RoundPlan({s.request_id: min(self.ks[(self.round + i) % len(self.ks)], s.room)
                          for i, s in enumerate(inp.rows)})


def controls_for(pair: Pair, kind: str, references: dict[tuple, list[int]]):
    """The engine's controls for a draft kind: "wrong" proposes wrong tokens, "copy" of another
    architecture proposes the target's own (by construction); the others are the real draft."""
    if kind == "wrong" or (kind == "copy" and pair.cross):
        alpha = 0.0 if kind == "wrong" else 1.0
        vocab = len(pair.target.tokenizer.get_vocab())

        def make(rid, prompt):
            return Controlled(references[tuple(prompt)], lambda _: alpha, vocab).choose, None

        return make
    return None


def draft_of(pair: Pair, kind: str) -> LoadedModel:
    return pair.drafts["perturbed" if kind == "wrong" else kind]


def greedy(text: str, n: int, mode: str = "joint") -> m.GenerateRequest:
    return m.GenerateRequest(messages=[m.Message("user", text)], max_tokens=n, temperature=0.0, ignore_eos=True,
                             mode=mode)


def joint_engine(pair: Pair, kind: str, recovery: str, references: dict[tuple, list[int]], max_active: int = 1,
                 schedule=K_SCHEDULE) -> Engine:
    eng = Engine(pair.target, EngineConfig(max_active=max_active, recovery=recovery, prefill_step=16),
                 draft_of(pair, kind), controls_for(pair, kind, references))
    eng.scheduler = Schedule(schedule)
    return eng


def run_engine(eng: Engine, reqs: dict[str, m.GenerateRequest], on_step=None) -> dict[str, list[int]]:
    """Submits every request, steps to the end; each request's tokens (no errors allowed)."""
    out = {rid: [] for rid in reqs}
    for rid, req in reqs.items():
        eng.submit(rid, req)
    while eng.has_work():
        for ev in eng.step():
            assert not isinstance(ev, m.Error), ev
            if isinstance(ev, m.TextDelta):
                out[ev.request_id] += ev.token_ids
        if on_step:
            on_step(eng)
    return out


def top2_gap(lm: LoadedModel, prefix: list[int]) -> float:
    return model_top2_gap(lm.model, prefix)
