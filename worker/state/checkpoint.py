"""Model state for the joint path: checkpoints, trimming, and per-position recurrent states.

Attention KV (mlx-lm KVCache) is trimmed by moving its offset: positions below it are never
written again, so a checkpoint of it is just the offset. Recurrent state (ArraysCache: the conv
window and the Gated-DeltaNet state) cannot be trimmed; ArraysCache replaces its arrays on
update, so a checkpoint holds references to immutable arrays, never an alias of a buffer that a
later update writes in place.

The fast path needs the recurrent state after every position of a multi-token verify forward.
`install_recording` gives each Gated-DeltaNet layer a subclass that, when its cache asks for it,
keeps the conv input and the state after each token (the per-token loop mlx-lm runs off Metal
computes them anyway; on Metal this path runs that loop instead of the kernel: not run here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from worker.kernels import gdn as gdn_kernel


class RecordingArraysCache(ArraysCache):
    """An ArraysCache that can keep the per-position states of one forward."""

    def __init__(self, size: int):
        super().__init__(size)
        self.record = False
        self.conv_input: Optional[mx.array] = None  # [B, n_keep + S, C]
        self.states: Optional[list[mx.array]] = None  # state after token i, i < S
        self.n_keep = 0

    def keep(self, n: int) -> None:
        """Sets the state to the one after the first n tokens of the recorded forward."""
        self.cache[0] = mx.contiguous(self.conv_input[:, n : n + self.n_keep, :])
        self.cache[1] = self.states[n - 1]
        self.clear_record()

    def clear_record(self) -> None:
        self.conv_input, self.states, self.record = None, None, False


class RecordingGatedDeltaNet(qwen3_5.GatedDeltaNet):
    """mlx-lm's GatedDeltaNet, plus a path that records per-position states."""

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
        if not (isinstance(cache, RecordingArraysCache) and cache.record):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(inputs), self.in_proj_a(inputs)
        n_keep = self.conv_kernel_size - 1
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, self.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        out, states = _recurrence(q, k, v, a, b, self.A_log, self.dt_bias, cache[1], mask)
        cache.conv_input, cache.states, cache.n_keep = conv_input, states, n_keep
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        cache[1] = states[-1]
        cache.advance(S)
        out = self.out_proj(self.norm(out, z).reshape(B, S, -1))
        if self.sharding_group is not None:  # tensor-sharded (worker/distributed): join the ranks' parts
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


def _recurrence(q, k, v, a, b, A_log, dt_bias, state, mask):
    """mlx-lm's gated_delta_ops (its gating, the same recurrence), keeping every state."""
    state = gdn_kernel.zero_state(q, v) if state is None else state
    return gdn_kernel.every_state(q, k, v, mx.sigmoid(b), compute_g(A_log, a, dt_bias), state, mask)


def install_recording(model) -> bool:
    """Lets the model's Gated-DeltaNet layers record per-position states; True if it has any.
    On a CUDA GPU their recurrence then runs as one kernel a forward (worker/kernels/gdn.py)."""
    found = False
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "linear_attn", None)
        if isinstance(attn, qwen3_5.GatedDeltaNet):
            attn.__class__ = RecordingGatedDeltaNet
            found = True
    if found:
        gdn_kernel.install()
    return found


def make_cache(model) -> list:
    """The model's prompt cache, with recording ArraysCaches; refuses caches it cannot recover."""
    cache = make_prompt_cache(model)
    out = []
    for c in cache:
        if type(c) is ArraysCache:
            c = RecordingArraysCache(len(c.cache))
        elif type(c) is not KVCache:
            raise ValueError(f"the joint path cannot recover a {type(c).__name__}")
        out.append(c)
    return out


@dataclass(frozen=True)
class Checkpoint:
    """KV offsets and references to the (immutable) recurrent arrays."""

    offsets: tuple
    arrays: tuple


def checkpoint(cache: list) -> Checkpoint:
    return Checkpoint(
        tuple(c.offset if isinstance(c, KVCache) else None for c in cache),
        tuple(tuple(c.cache) if isinstance(c, ArraysCache) else None for c in cache),
    )


def rollback(cache: list, ck: Checkpoint) -> None:
    for c, off, arrays in zip(cache, ck.offsets, ck.arrays):
        if isinstance(c, KVCache):
            c.trim(c.offset - off)
        else:
            c.cache = list(arrays)


def set_record(cache: list, on: bool) -> None:
    for c in cache:
        if isinstance(c, RecordingArraysCache):
            c.record = on


def keep_recorded(cache: list, consumed: int, keep: int) -> None:
    """After a recorded forward of `consumed` tokens, keeps the state after the first `keep`."""
    for c in cache:
        if isinstance(c, KVCache):
            c.trim(consumed - keep)
        elif isinstance(c, RecordingArraysCache):
            if keep == consumed:
                c.clear_record()
            else:
                c.keep(keep)


def prefill(model, cache: list, tokens: list[int], step: int = 512) -> None:
    """Feeds tokens into the cache in chunks of `step`, evaluating each chunk."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval(cache_arrays(cache))


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array that defines the state (the valid KV range, conv window, recurrent state)."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            if c.keys is not None:
                out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        else:
            out += [a for a in c.cache if a is not None]
    return out


def eval_state(cache: list) -> None:
    """Evaluates whatever of the state is still lazy (after a recovery). It evaluates the state's
    own arrays, whole KV buffers included, and not the views cache_arrays() makes: those are new
    ops, two per attention layer, at every evaluation (on CPU, 6 layers: 60-170 us against 1-2 us,
    most of what a fast-path recovery cost). What gets computed is the same."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            if c.keys is not None:
                out += [c.keys, c.values]
        else:
            out += [a for a in c.cache if a is not None]
    mx.eval(out)


def eval_recovered(cache: list) -> None:
    """After a recovery: on the CPU, evaluates the recovered state at once, so recovery time is
    what it costs (MLX's CPU evaluation waits for the work either way); on a GPU leaves it lazy,
    for the next forward to compute: an evaluation there waits for the device, which then idles
    while the host builds the next cycle's graph."""
    if mx.default_device() == mx.cpu:
        eval_state(cache)


def state_nbytes(cache: list) -> int:
    return sum(a.nbytes for a in cache_arrays(cache))
