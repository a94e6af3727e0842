"""Compiled decoder layers for the Gated-DeltaNet layers of Qwen3.5 models, where launches cost.

On a GPU, a decode step of a small hybrid model is bound by kernel launches and Python graph
building, not by bytes read (docs/design.md, "Draft kernels": 0.8 B draft step 9-12 ms against a 0.5 ms weight read).
Three of every four layers are Gated-DeltaNet layers whose state has a fixed shape, so the whole
layer (norms, projections, conv window, recurrence, MLP) compiles with mx.compile into one
graph per input shape, its elementwise chains fused. Attention layers stay as they are: their KV
cache grows, so their shapes change every step.

Compiled layers compute what mlx-lm's layers compute, but fusion may round intermediates
differently; a model is compiled or not as a whole (target and baseline alike), never mixed.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from worker.kernels.gdn import every_state
from worker.state.checkpoint import RecordingArraysCache

MAX_FUSED_TOKENS = 16  # longer inputs (prompt chunks) run eagerly: a compiled graph unrolls the loop


def _gdn_forward(attn: qwen3_5.GatedDeltaNet, x: mx.array, conv_state: mx.array, state: mx.array):
    """The Gated-DeltaNet mixer on explicit state: (output, conv input, state after each token)."""
    B, S, _ = x.shape
    qkv = attn.in_proj_qkv(x)
    z = attn.in_proj_z(x).reshape(B, S, attn.num_v_heads, attn.head_v_dim)
    b, a = attn.in_proj_b(x), attn.in_proj_a(x)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(attn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
                           [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
                           [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim])
    ]
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)
    y, states = every_state(q, k, v, mx.sigmoid(b), compute_g(attn.A_log, a, attn.dt_bias), state)
    out = attn.out_proj(attn.norm(y, z).reshape(B, S, -1))
    return out, conv_input, states


def _layer_fn(layer: qwen3_5.DecoderLayer, record: bool):
    """The whole linear decoder layer as a pure function of (x, conv state, state)."""
    n_keep = layer.linear_attn.conv_kernel_size - 1

    def fn(x, conv_state, state):
        r, conv_input, states = _gdn_forward(layer.linear_attn, layer.input_layernorm(x), conv_state, state)
        h = x + r
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        if record:
            return (out, conv_input, *states)
        return out, mx.contiguous(conv_input[:, -n_keep:, :]), states[-1]

    return mx.compile(fn)


class FusedDecoderLayer(qwen3_5.DecoderLayer):
    """A linear DecoderLayer whose unmasked steps on a plain (non-batched) cache run compiled."""

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        if (mask is not None or not isinstance(cache, ArraysCache) or cache.lengths is not None
                or x.shape[1] > MAX_FUSED_TOKENS):
            return super().__call__(x, mask, cache)
        attn = self.linear_attn
        B = x.shape[0]
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), x.dtype)
        state = cache[1] if cache[1] is not None else mx.zeros((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), mx.float32)
        record = isinstance(cache, RecordingArraysCache) and cache.record
        fns = self.__dict__.setdefault("_fused", {})
        key = (record, repr(mx.default_stream(mx.default_device())))  # a trace keeps the stream it ran on
        if key not in fns:
            fns[key] = _layer_fn(self, record)
        if record:
            out, conv_input, *states = fns[key](x, conv_state, state)
            cache.conv_input, cache.states, cache.n_keep = conv_input, states, attn.conv_kernel_size - 1
            cache[0], cache[1] = mx.contiguous(conv_input[:, -cache.n_keep:, :]), states[-1]
        else:
            out, cache[0], cache[1] = fns[key](x, conv_state, state)
        cache.advance(x.shape[1])
        return out


def set_fused(model, on: bool = True) -> int:
    """Compiles (or back to eager) the model's Gated-DeltaNet decoder layers; returns how many."""
    n = 0
    for layer in getattr(model, "layers", []):
        if isinstance(layer, qwen3_5.DecoderLayer) and layer.is_linear:
            layer.__class__ = FusedDecoderLayer if on else qwen3_5.DecoderLayer
            n += 1
    return n
