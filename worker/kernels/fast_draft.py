"""A Qwen3.5 draft's forward in a few large kernels a layer (worker/kernels/draft.py).

mlx-lm's forward of the 0.75 B draft launches ~600 kernels a token; on a GPU their dispatch,
not the 1.5 GB of weights, sets the step's cost. Here a Gated-DeltaNet layer is five launches:
the in-projection on the normed input (its four projections stacked), `gdn_step`, the
out-projection plus the residual, the MLP's gate and up projections with swiglu (stacked) on the
normed stream, the down projection plus the residual. Attention layers (one in four) keep
mlx-lm's norms, RoPE, KV cache and attention between kernel projections.

`narrow_forward(model)` is the model's forward that takes this path for narrow forwards (a draft's steps,
1-MAX_T tokens of one sequence on a plain cache); prompts, batches, padded or recording caches go
through mlx-lm's forward as before. Where the kernels do not run (the CPU) the same path runs their
ops, which is how the tests check it against mlx-lm's forward. The stacked weights are copies
(0.65 GB for the 0.75 B draft).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache

from worker.kernels import draft as dk
from worker.kernels import persistent_draft


@dataclass
class _Layer:
    """One decoder layer's weights as the kernels take them."""

    ln1: mx.array
    ln2: mx.array
    eps: float
    gate_up: mx.array  # [2I, H]: gate_proj over up_proj
    down: mx.array
    in_w: Optional[mx.array] = None  # Gated-DeltaNet: qkv, z, b, a projections stacked
    conv_w: Optional[mx.array] = None  # [C, 4]
    dims: tuple = ()  # (Hk, Dk, Hv, Dv)


def _prepare(model) -> Optional[list[_Layer]]:
    """The stacked weights, or None where the path does not apply (quantized or MoE layers, a
    quantized embedding or head)."""
    text = model.language_model
    head = getattr(text, "lm_head", None)
    if type(text.model.embed_tokens) is not nn.Embedding or (head is not None and type(head) is not nn.Linear):
        return None
    layers = []
    for layer in model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, qwen3_5.MLP) or any(
                type(m) is not nn.Linear for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return None
        entry = _Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                       layer.input_layernorm.eps, mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight]),
                       mlp.down_proj.weight)
        if layer.is_linear:
            g = layer.linear_attn
            projs = (g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a, g.out_proj)
            if any(type(m) is not nn.Linear for m in projs) or g.conv_kernel_size != 4:
                return None
            entry.in_w = mx.concatenate([m.weight for m in projs[:4]])
            entry.conv_w = g.conv1d.weight.reshape(g.conv_dim, 4)
            entry.dims = (g.num_k_heads, g.head_k_dim, g.num_v_heads, g.head_v_dim)
        elif any(type(m) is not nn.Linear for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                    layer.self_attn.v_proj, layer.self_attn.o_proj)):
            return None
        layers.append(entry)
    mx.eval([(l.gate_up, l.in_w, l.conv_w) for l in layers])
    return layers


def _eligible(inputs: mx.array, cache: Optional[list], widest: int = dk.MAX_T) -> bool:
    """One sequence of 1-`widest` tokens, on attention caches (mlx-lm's, or a batch's slot view of
    one row) and recurrent ones without padding or recording."""
    if cache is None or inputs.ndim != 2 or inputs.shape[0] != 1 or not 1 <= inputs.shape[1] <= widest:
        return False
    return all(_takes(c, padded=False) for c in cache)


def _takes(c, padded: bool) -> bool:
    """Whether the kernels' path takes this cache: any attention cache; a recurrent one not recording
    nor left-padded (`padded`: with rows of width 0 in `lengths`)."""
    if hasattr(c, "update_and_fetch"):
        return True
    return isinstance(c, ArraysCache) and not getattr(c, "record", False) and c.left_padding is None \
        and (padded or c.lengths is None)


def _gdn(g, w: _Layer, x: mx.array, c: ArraysCache, kernel: bool) -> mx.array:
    T = x.shape[0]
    Hk, Dk, Hv, Dv = w.dims
    p = dk.gemv(x, w.in_w, w.ln1, w.eps, kernel=kernel)
    conv_state = c[0].reshape(3, g.conv_dim) if c[0] is not None else mx.zeros((3, g.conv_dim), dtype=x.dtype)
    state = c[1].reshape(Hv, Dv, Dk) if c[1] is not None else mx.zeros((Hv, Dv, Dk), dtype=mx.float32)
    if state.dtype != mx.float32:
        state = state.astype(mx.float32)
    y, conv, state = dk.gdn_step(p, conv_state, w.conv_w, g.A_log, g.dt_bias, state, g.norm.weight, g.norm.eps,
                                 w.dims, kernel=kernel)
    c[0], c[1] = conv[None], state[None]
    c.advance(T)
    return dk.gemv(y, g.out_proj.weight, res=x, kernel=kernel)


def _attention(a, w: _Layer, x: mx.array, c: KVCache, kernel: bool) -> mx.array:
    T = x.shape[0]
    q = dk.gemv(x, a.q_proj.weight, w.ln1, w.eps, kernel=kernel)
    k = dk.gemv(x, a.k_proj.weight, w.ln1, w.eps, kernel=kernel)
    v = dk.gemv(x, a.v_proj.weight, w.ln1, w.eps, kernel=kernel)
    queries, gate = mx.split(q.reshape(1, T, a.num_attention_heads, -1), 2, axis=-1)
    queries = a.q_norm(queries).transpose(0, 2, 1, 3)
    keys = a.k_norm(k.reshape(1, T, a.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = v.reshape(1, T, a.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = a.rope(queries, offset=c.offset), a.rope(keys, offset=c.offset)
    mask = create_attention_mask(x[None], c)
    keys, values = c.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=c, scale=a.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(T, -1) * mx.sigmoid(gate.reshape(T, -1))
    return dk.gemv(out, a.o_proj.weight, res=x, kernel=kernel)


def forward(model, inputs: mx.array, cache: list, layers: list[_Layer], kernel: bool) -> mx.array:
    """Logits [1, T, V] of one sequence's T tokens, the cache advanced as mlx-lm's forward does."""
    text = model.language_model
    h = text.model.embed_tokens(inputs).reshape(inputs.shape[1], -1)
    for layer, w, c in zip(model.layers, layers, cache):
        if layer.is_linear:
            h = _gdn(layer.linear_attn, w, h, c, kernel)
        else:
            h = _attention(layer.self_attn, w, h, c, kernel)
        m = dk.gemv(h, w.gate_up, w.ln2, w.eps, swiglu=True, kernel=kernel)
        h = dk.gemv(m, w.down, res=h, kernel=kernel)
    norm = text.model.norm
    head = text.model.embed_tokens.weight if text.args.tie_word_embeddings else text.lm_head.weight
    return dk.gemv(h, head, norm.weight, norm.eps, kernel=kernel)[None]


def _rows_eligible(inputs: mx.array, cache: Optional[list]) -> bool:
    """Several sequences of one token each (a batch's draft step) on the batch's views: attention
    caches of any kind, recurrent ones holding a state and not recording."""
    if cache is None or inputs.ndim != 2 or inputs.shape[0] < 2 or inputs.shape[1] != 1:
        return False
    return all(_takes(c, padded=True) and (hasattr(c, "update_and_fetch") or c[0] is not None and c[1] is not None)
               for c in cache)


def _gdn_rows(g, w: _Layer, h: mx.array, R: int, c: ArraysCache, kernel: bool, gemv_kernel: bool) -> mx.array:
    """A Gated-DeltaNet layer over R one-token rows (h: [R or padded, H]); rows of width 0 in
    `c.lengths` keep their state."""
    p = dk.gemv(h, w.in_w, w.ln1, w.eps, kernel=gemv_kernel)[:R]
    y, conv, state = dk.gdn_step_rows(p[:, None], c[0], w.conv_w, g.A_log, g.dt_bias, c[1], g.norm.weight,
                                      g.norm.eps, w.dims, kernel=kernel)
    if c.lengths is not None:
        live = c.lengths > 0
        conv, state = mx.where(live[:, None, None], conv, c[0]), mx.where(live[:, None, None, None], state, c[1])
    c[0], c[1] = conv.astype(c[0].dtype), state.astype(c[1].dtype)
    return dk.gemv(_pad(y.reshape(R, -1), h.shape[0]), g.out_proj.weight, res=h, kernel=gemv_kernel)


def _attention_rows(a, w: _Layer, h: mx.array, R: int, c, kernel: bool) -> mx.array:
    """An attention layer over R one-token rows at their own offsets (the batch's KV view)."""
    q, k, v = (dk.gemv(h, m.weight, w.ln1, w.eps, kernel=kernel)[:R] for m in (a.q_proj, a.k_proj, a.v_proj))
    queries, gate = mx.split(q.reshape(R, 1, a.num_attention_heads, -1), 2, axis=-1)
    queries = a.q_norm(queries).transpose(0, 2, 1, 3)
    keys = a.k_norm(k.reshape(R, 1, a.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = v.reshape(R, 1, a.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = a.rope(queries, offset=c.offset), a.rope(keys, offset=c.offset)
    mask = create_attention_mask(h[:R, None], c)  # [R, 1, H]: one query a row
    keys, values = c.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=c, scale=a.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(R, -1) * mx.sigmoid(gate.reshape(R, -1))
    return dk.gemv(_pad(out, h.shape[0]), a.o_proj.weight, res=h, kernel=kernel)


def _pad(x: mx.array, rows: int) -> mx.array:
    return x if x.shape[0] == rows else mx.concatenate([x, mx.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


ROW_PADS = (8, 16, 32)  # a draft step of many rows pads them to one of these for the gemv kernels (a compile
# each); more rows take the gemvs' ops


def forward_rows(model, inputs: mx.array, cache: list, layers: list[_Layer], kernel: bool) -> mx.array:
    """Logits [R, 1, V] of R sequences' one token each on the batch's views. The stream is padded
    to the least of ROW_PADS that holds the rows, so each gemv kernel compiles once for every row
    count up to it (padded rows compute garbage nobody reads); more rows take the gemvs' ops."""
    text, R = model.language_model, inputs.shape[0]
    rows = next((n for n in ROW_PADS if n >= R), R)
    h = text.model.embed_tokens(_pad(inputs, rows)).reshape(rows, -1)
    kernel_gemv = kernel and rows in ROW_PADS
    for layer, w, c in zip(model.layers, layers, cache):
        if layer.is_linear:
            h = _gdn_rows(layer.linear_attn, w, h, R, c, kernel, kernel_gemv)
        else:
            h = _attention_rows(layer.self_attn, w, h, R, c, kernel_gemv)
        m = dk.gemv(h, w.gate_up, w.ln2, w.eps, swiglu=True, kernel=kernel_gemv)
        h = dk.gemv(m, w.down, res=h, kernel=kernel_gemv)
    norm = text.model.norm
    head = text.model.embed_tokens.weight if text.args.tie_word_embeddings else text.lm_head.weight
    return dk.gemv(h, head, norm.weight, norm.eps, kernel=kernel_gemv)[:R, None]


WIDEST = 2  # a batch's draft forward of one row takes the kernels up to this width: a draft lags two tokens
# after a round that kept every draft. The kernels compile for each width (seconds on a GPU; the warm-up
# meets these), and wider forwards (a catch-up, a replay) are rare: they take mlx-lm's forward.


class NarrowForward:
    """A Qwen3.5 draft's forward: narrow forwards of one sequence take the kernels' path (see the
    module's note), the rest the model's own. `persistent`: the one-launch step where it applies
    (worker/kernels/persistent_draft.py; mlx-lm's own KV caches only)."""

    def __init__(self, model, layers: list[_Layer], persistent: bool = False, widest: int = dk.MAX_T):
        self.model, self.layers, self.widest = model, layers, widest
        self.one = persistent_draft.prepare(model, layers) if persistent and dk.available(layers[0].ln1.dtype) else None

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        if _rows_eligible(inputs, cache):
            if self.one is not None and persistent_draft.rows_eligible(cache):
                try:
                    return persistent_draft.forward_rows(self.model, inputs, cache, self.one)
                except RuntimeError:  # a barrier timed out: the rows kernels from now on
                    self.one = None
            return forward_rows(self.model, inputs, cache, self.layers, dk.available(self.layers[0].ln1.dtype))
        if not _eligible(inputs, cache, self.widest):
            return self.model(inputs, cache=cache)
        if self.one is not None and persistent_draft.eligible(cache, inputs.shape[1]):
            try:
                return persistent_draft.forward(self.model, inputs, cache, self.one)
            except RuntimeError:  # a barrier timed out: this forward and those after take the kernels a sublayer
                self.one = None
        return forward(self.model, inputs, cache, self.layers, dk.available(self.layers[0].ln1.dtype))


def narrow_forward(model, persistent: bool = False, widest: int = dk.MAX_T) -> Optional[NarrowForward]:
    """The kernels' path for a Qwen3.5 model of unquantized linear layers (None: it does not apply)."""
    if not isinstance(model, qwen3_5.Model):
        return None
    layers = _prepare(model)
    return None if layers is None else NarrowForward(model, layers, persistent, widest)


def where_it_runs(model) -> Optional[NarrowForward]:
    """A draft's forward through the kernels where they run (a CUDA GPU, bfloat16); None elsewhere."""
    weight = getattr(getattr(getattr(model, "language_model", None), "model", None), "embed_tokens", None)
    if weight is None or not dk.available(weight.weight.dtype):
        return None
    return narrow_forward(model, persistent=True, widest=WIDEST)
