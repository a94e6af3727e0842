"""Per-position recurrent states, and the caches the batch and prefix reuse start from.

The batch's fast recovery needs the recurrent state after any prefix of a verify forward.
`install_recording` puts a `RecordingGatedDeltaNet` in each Gated-DeltaNet layer's place (a new
module holding the layer's own weights, set through MLX's module API): when its cache asks for
it (`cache.record`), it keeps the conv input and the recurrence's inputs, from which the state
after each row's kept prefix is computed once acceptance is known (one masked pass: a verify of
W tokens writes the state once, not W times). On a CUDA GPU it also runs every forward's
recurrence as one kernel (worker/kernels/gdn.py); elsewhere its plain forwards are mlx-lm's own.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from worker.kernels import conv as conv_kernel
from worker.kernels import gdn as gdn_kernel


class RecordingGatedDeltaNet(qwen3_5.GatedDeltaNet):
    """mlx-lm's GatedDeltaNet, plus a forward that records per-position states."""

    @classmethod
    def of(cls, layer: qwen3_5.GatedDeltaNet) -> "RecordingGatedDeltaNet":
        """A recording layer with `layer`'s weights and settings (the layer itself is untouched)."""
        new = cls.__new__(cls)
        dict.update(new, layer)  # MLX modules keep their parameters and children as dict items
        new.__dict__.update(layer.__dict__)
        return new

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
        record = bool(getattr(cache, "record", False))
        if not record and not gdn_kernel.available():
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(inputs), self.in_proj_a(inputs)
        n_keep = self.conv_kernel_size - 1
        conv_state = cache[0] if cache is not None and cache[0] is not None else \
            mx.zeros((B, n_keep, self.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = conv_kernel.conv_silu(self.conv1d, conv_input, nn.silu)
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        state = cache[1] if cache is not None else None
        state = gdn_kernel.zero_state(q, v) if state is None else state
        g, beta = compute_g(self.A_log, a, self.dt_bias), mx.sigmoid(b)
        out, final = gdn_kernel.final_state(q, k, v, beta, g, state, mask)
        if record:  # what the state after any prefix is computed from again (StateView.kept)
            cache.conv_input, cache.n_keep = conv_input, n_keep
            cache.recurrence = (q, k, v, beta, g, state)
        if cache is not None:
            cache[0] = _conv_window(conv_input, cache.lengths, S, n_keep)
            cache[1] = final
        out = self.out_proj(self.norm(out, z).reshape(B, S, -1))
        if self.sharding_group is not None:  # tensor-sharded (worker/distributed): join the ranks' parts
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


def _conv_window(conv_input: mx.array, lengths: Optional[mx.array], S: int, n_keep: int) -> mx.array:
    """The conv inputs after each row's last real token (mlx-lm's rule for padded rows)."""
    if lengths is None:
        return mx.contiguous(conv_input[:, -n_keep:, :])
    ends = mx.clip(lengths, 0, S)
    return mx.take_along_axis(conv_input, (ends[:, None] + mx.arange(n_keep))[..., None], axis=1)


def install_recording(model) -> bool:
    """Puts a recording layer in each Gated-DeltaNet layer's place; True if the model has any."""
    found = False
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "linear_attn", None)
        if isinstance(attn, qwen3_5.GatedDeltaNet) and not isinstance(attn, RecordingGatedDeltaNet):
            layer.linear_attn = RecordingGatedDeltaNet.of(attn)
            found = True
    return found


def make_cache(model) -> list:
    """The model's prompt cache; refuses caches that cannot be snapshotted (rotating, quantized)."""
    cache = make_prompt_cache(model)
    for c in cache:
        if type(c) is not KVCache and not isinstance(c, ArraysCache):
            raise ValueError(f"prefix reuse cannot keep a {type(c).__name__}")
    return cache


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array that defines the state (the valid KV range, conv window, recurrent state)."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            if c.keys is not None:
                out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        elif isinstance(c, QuantizedKVCache):  # packed, scales, biases: their bytes are what it holds
            if c.keys is not None:
                out += [a[..., : c.offset, :] for a in (*c.keys, *c.values)]
        else:
            out += [a for a in c.cache if a is not None]
    return out


def state_nbytes(cache: list) -> int:
    return sum(a.nbytes for a in cache_arrays(cache))
