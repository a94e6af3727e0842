"""What `verity bench gpu` measures besides whole runs: forward costs on the engine's slot batch,
the draft's chained steps, and the kernels' numerical checks, on the shapes bench/gpu_models.py
builds (random weights). Everything is timed after a warm-up of the same shape (the first forward
of a new shape compiles kernels on CUDA). Forwards run as the engine runs them: on a one-row slot
batch (worker/batch/slotbatch.py), through mlx-lm's model code, the draft's through the kernels'
path where it runs (worker/kernels/fast_draft.py).
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache

from bench.gpu_models import median_time
from worker.batch.slotbatch import SlotBatch
from worker.batch.slots import Span
from worker.state import checkpoint as st


def one_row(model, context: int, forward=None) -> SlotBatch:
    """A slot batch of one row holding `context` tokens (`forward`: the model's, as the engine's)."""
    b = SlotBatch(model, forward)
    b.add("r")
    b.commit(b.forward(["r"], mx.array([list(range(1, context + 1))]), [context]), [context])
    mx.eval(b.arrays())
    return b


def _back(b: SlotBatch, context: int, start: list) -> None:
    """The row back to `context` tokens: KV by its length, the recurrent state put back."""
    b.lengths["r"] = context
    b.put_recurrent(["r"], start)


def forward_cost(model, n_tokens: int, context: int = 256, reps: int = 10, record: bool = False,
                 forward=None) -> float:
    """Seconds for one forward of n_tokens after `context` tokens and its commit of them all (a
    verify of n_tokens - 1 drafts: `record`, its recurrent states kept by position), on a
    one-row slot batch put back after each."""
    b = one_row(model, context, forward)
    start = b.recurrent_rows(Span(0, 1, (), ()))
    x = mx.array([[7] * n_tokens])

    def step():
        f = b.forward(["r"], x, [n_tokens], record=record)
        b.commit(f, [n_tokens])
        mx.eval(f.logits, b.arrays())
        _back(b, context, start)
        return f.logits

    return median_time(step, reps)


def draft_chain_cost(model, k: int, context: int = 256, reps: int = 10, forward=None) -> float:
    """Seconds per step of k greedy one-token steps chained on the device (each step's argmax is
    the next input, one evaluation at the end), as the draft proposes in the engine."""
    b = one_row(model, context, forward)
    start = b.recurrent_rows(Span(0, 1, (), ()))

    def chain():
        x, out = mx.array([[7]]), []
        for _ in range(k):
            f = b.forward(["r"], x, [1])
            b.commit(f, [1])
            x = mx.argmax(f.logits[:, -1:], axis=-1)
            out.append(x)
        mx.eval(out)
        _back(b, context, start)
        return out

    return median_time(chain, reps) / k


def warm_joint_shapes(target, draft, widest_catch_up: int = 8, draft_forward=None) -> float:
    """Compiles the shapes a joint run of one request meets; returns the seconds it took (a new
    shape compiles for seconds on a GPU, and an adaptive run, which may draft any depth, met them
    in its timed runs). The target: verifies of 1 to POSITIONS + 1 tokens, recorded or not; the
    draft: forwards of 1 to `widest_catch_up` tokens (its proposals and catch-ups)."""
    from worker.scheduler import POSITIONS

    t0 = time.perf_counter()
    for n in range(1, POSITIONS + 2):
        for record in (False, True):
            forward_cost(target, n, reps=1, record=record)
    for n in range(1, widest_catch_up + 1):
        forward_cost(draft, n, reps=1, forward=draft_forward)
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
    y, final = gdn_kernel.recurrence(q, k, v, g, beta, state, mask)
    # the state after each prefix, as fast recovery computes it: the same kernel, masked past the prefix
    states = [gdn_kernel.recurrence(q, k, v, g, beta, state, mask & (mx.arange(n_tokens)[None] <= t))[1]
              for t in range(n_tokens)]
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
    recurrent = [i for i, c in enumerate(caches["kernel"]) if isinstance(c, ArraysCache)]
    diff = lambda a, b: max(mx.abs(caches[a][i][1].astype(mx.float32) - caches[b][i][1].astype(mx.float32)).max().item()
                            for i in recurrent)  # noqa: E731
    out["state_kernel_vs_ops"] = diff("kernel", "ops")
    out["state_max_abs"] = max(mx.abs(caches["ops"][i][1]).max().item() for i in recurrent)
    if one:
        out["state_persistent_vs_mlx_lm"], out["state_kernel_vs_mlx_lm"] = diff("persistent", "mlx_lm"), diff("kernel", "mlx_lm")
        out["persistent_barrier_failed"] = persistent_draft.failed(one)
    return out


def mlx_lm_decode(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """mlx-lm's generate_step, greedy (the reference): (decode tokens/s after the first token, the tokens)."""
    out, t_first = [], 0.0
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
        if len(out) == 1:
            t_first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t_first), out



def slab_write_check(dtype=mx.bfloat16) -> dict:
    """The in-place slab write (worker/kernels/kv_write.py) against the scatter the CPU runs: rows
    1-3 of a 5-slot slab take 3 positions each at uneven lengths. Equal, and the memory the write
    took beyond what was held, against one slab (a write that copied the slab takes one or more)."""
    from worker.batch.slots import SlotKV, Span
    from worker.kernels import kv_write

    if not kv_write.available():
        return {"kernel": "not run (no CUDA GPU)"}
    mx.random.seed(3)
    base = mx.random.normal((5, 2, 300, 64)).astype(dtype)
    k, v = mx.random.normal((3, 2, 3, 64)).astype(dtype), mx.random.normal((3, 2, 3, 64)).astype(dtype)
    lengths = (7, 41, 255)
    offsets = mx.array(lengths)
    slab = SlotKV()
    slab.keys, slab.values = [base + 0], [base + 1]
    mx.eval(slab.parts(), k, v, offsets)
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    slab.write(Span(1, 4, lengths, (3, 3, 3)), offsets, k, v)
    mx.eval(slab.parts())
    took = max(0, mx.get_peak_memory() - held)  # a reset peak reads below what is held when nothing new was taken
    rows, pos = mx.arange(1, 4)[:, None], offsets[:, None] + mx.arange(3)[None]
    want_k, want_v = base + 0, base + 1
    want_k[rows, :, pos] = k.transpose(0, 2, 1, 3)
    want_v[rows, :, pos] = v.transpose(0, 2, 1, 3)
    return {"kernel": "on", "keys_equal": bool(mx.array_equal(slab.keys[0], want_k).item()),
            "values_equal": bool(mx.array_equal(slab.values[0], want_v).item()),
            "took_over_slab": took / base.nbytes}
