"""`verity distill`: the recipe that builds the embedded model's draft on this machine.

Stages, each resumable from what it left in the work folder:
1. generate: SmolLM2-135M continues every prompt of train_prompts.txt (batched, on the CPU, prompts of
   like length together), greedy or sampled in turn; each step keeps the teacher's top-K next-token
   log-probabilities.
2. train: a few llama layers, started as copies of chosen target layers and sharing the target's
   embedding, learn the teacher's next-token distribution (cross-entropy to its top-K) over the
   generated positions, plus a weighted term for the teacher's argmax (what greedy acceptance
   counts); AdamW with a cosine schedule; a checkpoint every few steps, held-out acceptance logged
   at each epoch's end.
3. evaluate: greedy acceptance per draft position on heldout_prompts.txt (never trained on).
4. export: float16 safetensors and config into worker/draft/embedded/.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from worker.draft.model import DRAFT_ID, DraftModel, init_from_target, own_weights, save_draft

HERE = Path(__file__).parent
TRAIN_PROMPTS, HELDOUT_PROMPTS = HERE / "train_prompts.txt", HERE / "heldout_prompts.txt"

# progress(description, total) -> advance(n): the CLI draws bars; tests pass a no-op
Progress = Callable[[str, int], Callable[[int], None]]


def no_progress(description: str, total: int) -> Callable[[int], None]:
    return lambda n=1: None


@dataclass
class Recipe:
    seed: int = 0
    layer_ids: list = field(default_factory=lambda: [0, 1, 2, 28, 29])  # target layers the draft starts from
    head_size: int = 8192  # vocabulary of the draft's output head: the teacher's most frequent tokens
    gen_tokens: int = 128  # per generated continuation
    temperatures: list = field(default_factory=lambda: [0.0, 0.8])  # prompt i samples at temperatures[i % len]
    gen_batch: int = 128
    top_k: int = 16  # teacher log-probabilities kept per position (sampling draws from these)
    batch: int = 16  # sequences per training step
    epochs: int = 3
    hard: float = 0.5  # weight of the cross-entropy to the teacher's argmax
    lr: float = 5e-4
    warmup: int = 20
    checkpoint_every: int = 20
    prompts: Optional[int] = None  # first N training prompts (tests use few)
    eval_prompts: Optional[int] = None  # first N held-out prompts (None: all)
    eval_tokens: int = 128


def read_prompts(path: Path, limit: Optional[int] = None) -> list[str]:
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip()]
    return lines[:limit] if limit else lines


def encode_prompt(tokenizer, text: str) -> list[int]:
    from protocol import messages as m
    from worker.text import render_prompt

    return render_prompt(tokenizer, m.GenerateRequest(messages=[m.Message("user", text)]))


# ---- 1. the teacher's continuations ----


def generate(target, tokenizer, prompts: list[str], work: Path, r: Recipe, progress: Progress = no_progress) -> list[Path]:
    """One shard per batch of prompts (sorted by length, so little padding); shards already written are kept."""
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), i))
    shards, jobs = [], []
    for b in range(0, len(order), r.gen_batch):
        path = work / "generate" / f"{b // r.gen_batch:04d}.npz"
        shards.append(path)
        if not path.exists():
            jobs.append((path, order[b: b + r.gen_batch], r.seed * 1000 + b))
    advance = progress("generate (teacher continuations)", len(shards))
    advance(len(shards) - len(jobs))
    for path, batch, seed in jobs:
        temps = [r.temperatures[i % len(r.temperatures)] for i in batch]
        rows = _generate_batch(target, [encoded[i] for i in batch], temps, r, set(tokenizer.eos_token_ids), seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **_pack(rows))
        tmp.rename(path)
        advance(1)
    return shards


def _generate_batch(model, prompts: list[list[int]], temps: list[float], r: Recipe, eos: set, seed: int) -> list[dict]:
    """Rows at temperature 0 take the argmax; the others sample from the teacher's top-K (Gumbel-max)."""
    from mlx_lm.models.cache import BatchKVCache

    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    cache = [BatchKVCache(pads) for _ in model.layers]
    x = mx.array([[0] * pad + p for p, pad in zip(prompts, pads)])
    logits = model(x, cache=cache)[:, -1]
    key = mx.random.key(seed)
    t = mx.array(temps, dtype=mx.float32)[:, None]
    rows = [{"prompt": p, "tokens": [], "ids": [], "logprobs": []} for p in prompts]
    live = list(range(len(prompts)))
    for _ in range(r.gen_tokens):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ids = mx.argpartition(-lp, r.top_k - 1, axis=-1)[:, : r.top_k]
        top = mx.take_along_axis(lp, ids, axis=-1)
        key, sub = mx.random.split(key)
        pick = mx.argmax(top / mx.maximum(t, 1e-6) + mx.random.gumbel(top.shape, key=sub), axis=-1)
        sampled = mx.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]
        tok = mx.where(t[:, 0] > 0, sampled, mx.argmax(lp, axis=-1).astype(sampled.dtype))
        mx.eval(tok, ids, top)
        toks, ids_np, top_np = tok.tolist(), np.array(ids), np.array(top.astype(mx.float32))
        for i in list(live):
            row = rows[i]
            row["tokens"].append(toks[i])
            row["ids"].append(ids_np[i])
            row["logprobs"].append(top_np[i])
            if toks[i] in eos:
                live.remove(i)
        if not live:
            break
        logits = model(tok[:, None], cache=cache)[:, -1]
    return rows


def _pack(rows: list[dict]) -> dict:
    """Rows as flat numeric arrays (read back with allow_pickle=False): tokens of prompt+continuation,
    lengths, the teacher's top-K."""
    return {
        "tokens": np.array([t for r in rows for t in r["prompt"] + r["tokens"]], dtype=np.int32),
        "prompt_len": np.array([len(r["prompt"]) for r in rows], dtype=np.int32),
        "gen_len": np.array([len(r["tokens"]) for r in rows], dtype=np.int32),
        "top_ids": np.concatenate([np.stack(r["ids"]) for r in rows]).astype(np.int32),
        "top_logprobs": np.concatenate([np.stack(r["logprobs"]) for r in rows]).astype(np.float16),
    }


@dataclass
class Example:
    tokens: np.ndarray  # prompt + continuation
    prompt_len: int
    top_ids: np.ndarray  # [gen_len, K]: the teacher's distribution of each continuation token
    top_logprobs: np.ndarray


def load_examples(shards: list[Path]) -> list[Example]:
    out = []
    for path in shards:
        with np.load(path, allow_pickle=False) as z:
            t0 = g0 = 0
            for p, g in zip(z["prompt_len"].tolist(), z["gen_len"].tolist()):
                out.append(Example(z["tokens"][t0: t0 + p + g], p, z["top_ids"][g0: g0 + g], z["top_logprobs"][g0: g0 + g]))
                t0, g0 = t0 + p + g, g0 + g
    return out


def head_vocab(examples: list[Example], size: int, always: list[int]) -> list[int]:
    """At most `size` tokens: `always`, then those the teacher produced or ranked most often; sorted."""
    counts = np.zeros(int(max(e.top_ids.max() for e in examples)) + 1 + max(always, default=0), dtype=np.int64)
    for e in examples:
        np.add.at(counts, e.tokens[e.prompt_len:], 4)  # produced tokens weigh most
        np.add.at(counts, e.top_ids[:, :4].reshape(-1), 1)
    chosen = set(always) | set(np.argsort(-counts, kind="stable")[: size - len(always)].tolist())
    return sorted(chosen)[:size] if len(chosen) > size else sorted(chosen)


# ---- 2. training ----


def _batches(examples: list[Example], r: Recipe, epoch: int) -> list[list[int]]:
    order = list(range(len(examples)))
    random.Random(r.seed * 7919 + epoch).shuffle(order)
    return [order[i: i + r.batch] for i in range(0, len(order), r.batch)]


def _collate(examples: list[Example], index: np.ndarray, vocab_size: int, K: int):
    """Inputs, per-position teacher ids (mapped into the head's vocabulary) and probabilities, and the
    teacher's argmax (-1 where unscored or outside the head)."""
    width = max(len(e.tokens) for e in examples) - 1
    x = np.zeros((len(examples), width), dtype=np.int32)
    ids = np.zeros((len(examples), width, K), dtype=np.int32)
    probs = np.zeros((len(examples), width, K), dtype=np.float32)
    best = np.full((len(examples), width), -1, dtype=np.int32)
    for b, e in enumerate(examples):
        n = len(e.tokens) - 1
        x[b, :n] = e.tokens[:-1]
        start = e.prompt_len - 1  # the position whose output is the first continuation token
        g = len(e.top_ids)
        sub = index[e.top_ids]  # -1: outside the head's vocabulary
        p = np.exp(e.top_logprobs.astype(np.float32)) * (sub >= 0)
        p /= np.maximum(p.sum(-1, keepdims=True), 1e-9)
        ids[b, start: start + g] = np.maximum(sub, 0)
        probs[b, start: start + g] = p
        best[b, start: start + g] = np.take_along_axis(sub, e.top_logprobs.argmax(-1)[:, None], -1)[:, 0]
    return mx.array(x), mx.array(ids), mx.array(probs), mx.array(best)


def loss_fn(draft: DraftModel, x: mx.array, ids: mx.array, probs: mx.array, best: mx.array,
            hard: float = 0.0) -> mx.array:
    """Cross-entropy of the draft's head distribution to the teacher's top-K, plus `hard` × the
    cross-entropy to the teacher's argmax, per scored position."""
    logits = draft.subset_logits(x)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -(probs * mx.take_along_axis(logq, ids, axis=-1)).sum(-1)
    has = best >= 0
    ce_best = -mx.take_along_axis(logq, mx.maximum(best, 0)[..., None], axis=-1)[..., 0] * has
    return (ce.sum() + hard * ce_best.sum()) / mx.maximum((probs.sum(-1) > 0).sum(), 1)


def train(target, target_args: dict, examples: list[Example], vocab: list[int], work: Path, r: Recipe,
          progress: Progress = no_progress, on_epoch: Optional[Callable[[DraftModel], dict]] = None) -> DraftModel:
    """`on_epoch(draft)` -> figures logged with each epoch's last checkpoint (held-out acceptance)."""
    draft = init_from_target(target, target_args, r.layer_ids, vocab)
    draft.freeze()
    for layer in draft.model.layers:
        layer.unfreeze()
    draft.model.norm.unfreeze()
    steps_per_epoch = math.ceil(len(examples) / r.batch)
    total = steps_per_epoch * r.epochs
    sched = optim.join_schedules([optim.linear_schedule(r.lr / 20, r.lr, r.warmup),
                                  optim.cosine_decay(r.lr, max(total - r.warmup, 1), r.lr / 20)], [r.warmup])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    step = _resume(draft, opt, work)
    index = np.full(target_args["vocab_size"], -1, dtype=np.int64)
    index[vocab] = np.arange(len(vocab))
    value_and_grad = nn.value_and_grad(draft, loss_fn)
    advance = progress("train (distil the teacher's distribution)", total)
    advance(step)
    losses = []
    for epoch in range(r.epochs):
        for i, batch in enumerate(_batches(examples, r, epoch)):
            if epoch * steps_per_epoch + i < step:
                continue
            loss, grads = value_and_grad(draft, *_collate([examples[j] for j in batch], index, len(vocab), r.top_k), r.hard)
            opt.update(draft, grads)
            mx.eval(draft.trainable_parameters(), opt.state, loss)
            losses.append(loss.item())
            step += 1
            advance(1)
            last = i == steps_per_epoch - 1
            if step % r.checkpoint_every == 0 or last:
                extra = {"epoch": epoch + 1, **on_epoch(draft)} if last and on_epoch else {}
                _checkpoint(draft, opt, work, step, losses[-r.checkpoint_every:], extra)
    return draft


def _checkpoint(draft: DraftModel, opt, work: Path, step: int, losses: list[float], extra: dict) -> None:
    folder = work / "train"
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {f"w.{k}": v for k, v in own_weights(draft).items()}
    arrays.update({f"o.{k}": v for k, v in tree_flatten(opt.state)})
    mx.save_safetensors(str(folder / "checkpoint.tmp.safetensors"), arrays)
    (folder / "checkpoint.tmp.safetensors").rename(folder / "checkpoint.safetensors")
    log = {"step": step, "loss": sum(losses) / max(len(losses), 1), **extra}
    with open(folder / "log.jsonl", "a") as f:
        f.write(json.dumps(log) + "\n")
    (folder / "state.json").write_text(json.dumps({"step": step}))


def _resume(draft: DraftModel, opt, work: Path) -> int:
    state = work / "train" / "state.json"
    if not state.exists():
        return 0
    arrays = mx.load(str(work / "train" / "checkpoint.safetensors"))
    draft.load_weights([(k[2:], v) for k, v in arrays.items() if k.startswith("w.")], strict=False)
    opt.state = tree_unflatten([(k[2:], v) for k, v in arrays.items() if k.startswith("o.")])
    return json.loads(state.read_text())["step"]


# ---- 3. held-out acceptance ----


def greedy_continuations(target, prompts: list[list[int]], tokens: int, eos: set, batch: int = 24) -> list[list[int]]:
    r = Recipe(gen_tokens=tokens, top_k=1)
    out = []
    for b in range(0, len(prompts), batch):
        chunk = prompts[b: b + batch]
        out += [row["tokens"] for row in _generate_batch(target, chunk, [0.0] * len(chunk), r, eos, 0)]
    return out


def acceptance_per_position(draft, prompts: list[list[int]], continuations: list[list[int]], depth: int = 8) -> dict:
    """Greedy acceptance from one teacher-forced pass: with the target's greedy text as context,
    draft position j after a cycle start is accepted iff the draft's argmax matches there and at
    every earlier position of the cycle, so a[j] = P(match at t+j | matches at t..t+j-1)."""
    reached, accepted = [0] * depth, [0] * depth
    for p, c in zip(prompts, continuations):
        seq = p + c
        logits = draft(mx.array(seq[:-1])[None])[0]
        match = (mx.argmax(logits[len(p) - 1:], axis=-1) == mx.array(c)).tolist()
        for t in range(len(match)):
            for j in range(min(depth, len(match) - t)):
                reached[j] += 1
                if not match[t + j]:
                    break
                accepted[j] += 1
    rates = [a / n if n else 0.0 for a, n in zip(accepted, reached)]
    return {"per_position": rates, "positions": reached, "first": rates[0]}


# ---- the whole recipe ----


def run(target_lm, target_args: dict, work: Path, out: Path, r: Recipe, progress: Progress = no_progress) -> dict:
    mx.random.seed(r.seed)
    work.mkdir(parents=True, exist_ok=True)
    (work / "recipe.json").write_text(json.dumps(asdict(r), indent=1))
    tok = target_lm.tokenizer
    prompts = read_prompts(TRAIN_PROMPTS, r.prompts)
    shards = generate(target_lm.model, tok, prompts, work, r, progress)
    examples = load_examples(shards)
    vocab = head_vocab(examples, r.head_size, sorted(tok.eos_token_ids))
    held = heldout_set(target_lm, progress, r.eval_tokens, r.eval_prompts)
    draft = train(target_lm.model, target_args, examples, vocab, work, r, progress,
                  lambda dr: {"heldout_first": round(acceptance_per_position(dr, *held)["first"], 4)})
    report = acceptance_per_position(draft, *held) | {"prompts": len(held[0])}
    meta = {"draft_id": DRAFT_ID, "teacher": target_lm.model_id, "teacher_revision": target_lm.revision,
            "layers": len(r.layer_ids), "init_layers": r.layer_ids, "head_vocab": vocab, "recipe": asdict(r),
            "training_tokens": int(sum(len(e.top_ids) for e in examples)), "heldout": report}
    save_draft(draft, out, meta)
    return meta


def heldout_set(target_lm, progress: Progress = no_progress, tokens: int = 128, limit: Optional[int] = None):
    """The held-out prompts and the target's greedy continuations of them."""
    held = [encode_prompt(target_lm.tokenizer, p) for p in read_prompts(HELDOUT_PROMPTS, limit)]
    advance = progress("held-out prompts (the target's greedy text)", 1)
    cont = greedy_continuations(target_lm.model, held, tokens, set(target_lm.tokenizer.eos_token_ids))
    advance(1)
    return held, cont
