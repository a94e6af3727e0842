"""Speed at real model sizes: Qwen3.5-9B- and 0.8B-shaped models with random weights.

Speed depends on shapes, not on weight values, so the models are built from their
configurations (bf16 by default). Runs wherever MLX has a GPU; `small=True` shrinks every shape
for a check on the CPU. Everything is timed after a warm-up of the same shape (the first
forward of a new shape compiles kernels on CUDA).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models import qwen3_5

from worker.scheduler import Scheduler
from worker.state import checkpoint as st
from bench.drafters import ControlledDrafter, ForcedDecoder, ForcedDrafter
from worker.kernels.fast_draft import set_fast
from bench.fused import set_fused
from worker.joint.decoder import JointDecoder
from worker.round import Row, plan_round, run_round
from worker.joint.sampling import SamplingParams
from bench.static import set_static
from bench.gpu_models import (DRAFT_08B, DTYPES, SMALL, TARGET_9B, build, bytes_per_token, copy_bandwidth,  # noqa: F401
                              device, kernel_available, median_time, n_params)

MODES = ("eager", "fused", "static")
DRAFT_MODES = MODES + ("kernels", "persistent")


def set_mode(model, mode: str) -> None:
    """eager: mlx-lm's layers; fused: Gated-DeltaNet layers compiled one by one (bench/fused.py);
    static: the whole forward compiled on fixed-shape state (bench/static.py); kernels (a draft's):
    narrow forwards in a few large kernels a layer (worker/kernels/fast_draft.py), the rest eager."""
    set_fast(model, False)
    set_static(model, mode == "static")
    set_fused(model, mode == "fused")
    if mode in ("kernels", "persistent") and not set_fast(model, persistent=mode == "persistent"):
        raise ValueError("the kernels' path needs a Qwen3.5 model of unquantized linear layers")


def forward_cost(model, n_tokens: int, context: int = 256, reps: int = 10, record: bool = False) -> float:
    """Seconds for one forward of n_tokens after `context` tokens (a verify of n_tokens - 1 drafts)."""
    cache = st.make_cache(model)
    mx.eval(model(mx.array([list(range(1, context + 1))]), cache=cache))
    x = mx.array([[7] * n_tokens])

    def step():
        st.set_record(cache, record)
        out = model(x, cache=cache)
        for c in cache:
            if isinstance(c, st.RecordingArraysCache):
                c.clear_record()
        return out

    def trimmed():
        out = step()
        mx.eval(out)
        for c in cache:  # back to `context` tokens: KV by offset, recurrent state left as is
            if not isinstance(c, st.RecordingArraysCache):
                c.trim(n_tokens)
        return out

    return median_time(trimmed, reps)


def warm_joint_shapes(target, draft, longest: int) -> float:
    """Compiles every shape a joint run may meet; returns the seconds it took. A new shape compiles
    for seconds on the device (the target's static trace per verify width, the one-launch draft
    step per width, an eager draft forward per input length), and an adaptive run, which may draft
    any depth and catch its draft up on any lag, met them in its timed runs (two runs of 20 tok/s
    where others read 130). The target: verifies of 1 to POSITIONS + 1 tokens, recorded or not;
    the draft: forwards of 1 to MAX_T tokens and its catch-up pieces (powers of two up to `longest`)."""
    from worker.scheduler import POSITIONS
    from worker.kernels.draft import MAX_T

    t0 = time.perf_counter()
    for n in range(1, POSITIONS + 2):
        for record in (False, True):
            forward_cost(target, n, reps=1, record=record)
    pieces = [1 << i for i in range(max(1, longest).bit_length())]
    for n in sorted(set(range(1, MAX_T + 1)) | set(pieces)):
        forward_cost(draft, n, reps=1)
    return time.perf_counter() - t0


def kernel_check(model, n_tokens: int = 4, context: int = 64) -> dict:
    """The Gated-DeltaNet kernel (worker/kernels/gdn.py) against mlx-lm's per-token ops on the
    model's first linear layer's shapes, random inputs: largest differences of the outputs and of
    every recorded state, and their scale."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    from worker.kernels import gdn as gdn_kernel

    attn = next(l.linear_attn for l in model.layers if hasattr(l, "linear_attn"))
    B, Hk, Dk, Hv, Dv = 2, attn.num_k_heads, attn.head_k_dim, attn.num_v_heads, attn.head_v_dim
    mx.random.seed(5)
    q, k = (mx.random.normal((B, n_tokens, Hk, Dk)) / Dk ** 0.5).astype(mx.bfloat16), mx.random.normal((B, n_tokens, Hk, Dk)) / Dk ** 0.5
    k = k.astype(mx.bfloat16)
    v = mx.random.normal((B, n_tokens, Hv, Dv)).astype(mx.bfloat16)
    g, beta = mx.random.uniform(0.8, 1.0, (B, n_tokens, Hv)), mx.random.uniform(0.0, 1.0, (B, n_tokens, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    mask = mx.array([[True] * n_tokens, [True] * (n_tokens - 1) + [False]])
    y, final, states = gdn_kernel.recurrence(q, k, v, g, beta, state, mask, keep=True)
    ys, ss, s = [], [], state
    for t in range(n_tokens):
        yt, s = gated_delta_ops(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s, mask[:, t:t + 1])
        ys.append(yt)
        ss.append(s)
    ref_y = mx.concatenate(ys, axis=1)
    on = mask[..., None, None]  # a masked (padding) token's output is 0 here, whatever ops leave there
    return {"tokens": n_tokens, "y_max_abs_diff": mx.abs(mx.where(on, y.astype(mx.float32) - ref_y.astype(mx.float32), 0)).max().item(),
            "y_max_abs": mx.abs(ref_y.astype(mx.float32)).max().item(),
            "state_max_abs_diff": max(mx.abs(states[t] - ss[t]).max().item() for t in range(n_tokens)),
            "final_equals_last_state": bool(mx.array_equal(final, states[-1]).item()),
            "state_max_abs": mx.abs(ss[-1]).max().item()}


def fast_check(model, context: int = 64) -> dict:
    """The draft's kernels' path (worker/kernels/fast_draft.py) against its ops and against mlx-lm's forward,
    one forward of 1 and of 2 tokens after `context`: the largest logit differences, their scale,
    whether the argmax agrees, and the largest difference of the recurrent states after them."""
    from worker.kernels import draft as dk
    from worker.kernels import fast_draft, persistent_draft

    layers = fast_draft._prepare(model)
    ran = dk.available(layers[0].ln1.dtype)
    one = persistent_draft.prepare(model, layers) if ran else None  # the one-launch step: CUDA only
    prompt = mx.array([list(range(1, context + 1))])
    caches = {name: st.make_cache(model) for name in ("kernel", "ops", "mlx_lm") + (("persistent",) if one else ())}
    for c in caches.values():
        mx.eval(model.language_model(prompt, cache=c))  # mlx-lm's forward, whatever path the model takes
    out: dict = {"kernels_ran": ran, "persistent_ran": one is not None}  # where they do not run, "kernel" is their ops again
    for x in (mx.array([[7]]), mx.array([[8, 9]])):
        got = {"kernel": fast_draft.forward(model, x, caches["kernel"], layers, kernel=ran),
               "ops": fast_draft.forward(model, x, caches["ops"], layers, kernel=False),
               "mlx_lm": model.language_model(x, cache=caches["mlx_lm"])}
        if one:
            got["persistent"] = persistent_draft.forward(model, x, caches["persistent"], one)
        got = {k: v.astype(mx.float32) for k, v in got.items()}
        n = x.shape[1]
        out[f"logits_{n}_max_abs"] = mx.abs(got["mlx_lm"]).max().item()
        for a, b in (("kernel", "ops"), ("kernel", "mlx_lm"), ("ops", "mlx_lm"), ("persistent", "mlx_lm")):
            if a in got:
                out[f"logits_{n}_{a}_vs_{b}"] = mx.abs(got[a] - got[b]).max().item()
        for a in ("kernel", "persistent"):
            if a in got:
                out[f"argmax_{n}_{a}_agrees"] = bool(mx.array_equal(mx.argmax(got[a], -1), mx.argmax(got["mlx_lm"], -1)).item())
    recurrent = [i for i, c in enumerate(caches["kernel"]) if isinstance(c, st.RecordingArraysCache)]
    diff = lambda a, b: max(mx.abs(caches[a][i][1].astype(mx.float32) - caches[b][i][1].astype(mx.float32)).max().item()
                            for i in recurrent)  # noqa: E731
    out["state_kernel_vs_ops"] = diff("kernel", "ops")
    out["state_max_abs"] = max(mx.abs(caches["ops"][i][1]).max().item() for i in recurrent)
    if one:
        out["state_persistent_vs_mlx_lm"], out["state_kernel_vs_mlx_lm"] = diff("persistent", "mlx_lm"), diff("kernel", "mlx_lm")
        out["persistent_barrier_failed"] = persistent_draft.failed(one)
    return out


def draft_chain_cost(model, k: int, context: int = 256, reps: int = 10) -> float:
    """Seconds per step of k greedy one-token steps chained on the device (each step's argmax is
    the next input, one evaluation at the end), as a greedy draft proposes."""
    cache = st.make_cache(model)
    mx.eval(model(mx.array([list(range(1, context + 1))]), cache=cache))

    def chain():
        ck, x, out = st.checkpoint(cache), mx.array([[7]]), []
        for _ in range(k):
            x = mx.argmax(model(x, cache=cache)[:, -1:], axis=-1)
            out.append(x)
        mx.eval(out)
        st.rollback(cache, ck)
        return out

    return median_time(chain, reps) / k


def plain_decode(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """mlx-lm's generate_step, greedy: (decode tokens/s after the first token, the tokens)."""
    out, t_first = [], 0.0
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(tok)
        if len(out) == 1:
            t_first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t_first), out


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy tokens as the joint path computes them (argmax of raw logits, one
    token a forward). mlx-lm's generate_step takes the argmax of bfloat16 log-probabilities, whose
    coarse rounding ties and flips near-equal tokens of a random-weight model: a reference from it
    would make the controlled draft's "right" tokens wrong ones."""
    cache = st.make_cache(model)
    st.prefill(model, cache, prompt[:-1])
    out, y = [], prompt[-1]
    for _ in range(n):
        y = mx.argmax(model(mx.array([[y]]), cache=cache)[0, -1]).item()
        out.append(y)
    return out


@dataclass
class JointRun:
    tokens_per_s: float
    acceptance: float
    budget_mean: float
    draft_s: float
    verify_s: float
    recovery_s: float
    tokens: list = field(default_factory=list)


_RUNS = itertools.count()  # request ids of joint_decode's runs


def joint_decode(*args, **kwargs) -> JointRun:
    """Greedy joint decoding with the controlled-acceptance draft (see _joint_decode), on mlx-lm's
    generation stream as the engine runs it."""
    with mx.stream(generation_stream):
        return _joint_decode(*args, **kwargs)


def _joint_decode(target, draft, prompt: list[int], reference: list[int], alpha: Callable[[int], float],
                  n: int, recovery: str, k: Optional[int], vocab: int, scheduler: Optional[Scheduler] = None,
                  forced: bool = False) -> JointRun:
    """k=None: the adaptive scheduler. forced: acceptance by the draft's intent (ForcedDecoder)."""
    if forced:
        drafter = ForcedDrafter(draft, reference, alpha, vocab, recovery=recovery)
        jd = ForcedDecoder(target, drafter, prompt, SamplingParams(), recovery=recovery)
    else:
        drafter = ControlledDrafter(draft, reference, alpha, vocab, recovery=recovery)
        jd = JointDecoder(target, drafter, prompt, SamplingParams(), recovery=recovery)
    out = [jd.start()]
    mx.synchronize()
    sched = scheduler or Scheduler(fixed=k)
    rid = f"r{next(_RUNS)}"  # each run a new request, as the engine's: the last run's held plan ends with it
    t0 = time.perf_counter()

    def emit(row: Row, tokens: list[int]) -> int:
        keep = min(len(tokens), n - len(out))
        out.extend(tokens[:keep])
        return keep

    def fail(row: Row, e: Exception) -> None:
        raise e

    while len(out) < n:  # the engine's round (worker/round.py), one request
        sr = plan_round([Row(rid, jd, n - len(out))], sched)
        sched.observe(run_round(sr, emit, fail))
    wall = time.perf_counter() - t0
    s = jd.stats
    sched.forget(rid)
    sched.flush_log()  # after the timed run, as the engine does when idle
    return JointRun((len(out) - 1) / wall, s.accepted / s.drafted if s.drafted else 0.0,
                    s.drafted / s.cycles if s.cycles else 0.0, s.draft_s, s.verify_s, s.recovery_s, out)
