"""A Qwen3.5 draft's decode step in one kernel launch: every layer, grid-wide barriers between
sublayers (MLX's CUDA backend).

One persistent kernel runs all 24 layers for T tokens of one sequence (or, `rows_step`, for
2-8 rows of a batch one token each, each at its own slot, length and state), where a kernel a sublayer
(worker/kernels/fast_draft.py) is ~190 launches whose dispatch outweighs the weights' read
(docs/design.md, "Draft kernels"). Its blocks (at most one per SM, so all are resident) split each
sublayer's rows, then meet at a barrier (an atomic counter and generation in a small buffer kept
across calls). Scratch written in the kernel is read with `__ldcg` (L2, not a block's stale L1).
Each block stages a projection's input in shared memory once, normed (or gated) and rounded to
bf16 as mlx-lm's norms round it.
The head (the tied embedding) is worker/kernels/draft.gemv, a second launch.

Attention layers write their new keys and values into the KV cache's buffer in place (a cache
without room grows first, as mlx-lm's does; a window past MAX_S takes the sublayer path), and the
Gated-DeltaNet layers' conv windows and states come back stacked, each layer's cache entry a
view of them. A barrier that waits past a bound sets a sticky flag (`failed`) instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from worker.kernels import draft as dk
from worker.kernels.persistent_source import HEADER_EXTRA, SOURCE

BLOCKS = 128  # at most the SMs of a Hopper GPU (132): every block resident, as the barrier needs
WARPS = {1: 16}  # warps a block by T (16 at T = 2 asks for more registers than an SM has)
MAX_S = 4096  # longest attention window (its scores sit in shared memory)
GEMV_UNROLL = 4  # row chunks a warp's loads run ahead by
GDN_ROWS = 4  # state rows a warp owns in the delta rule
STAGE_X = True  # a gemv's input staged in shared memory (False: read from L2; timing probes)
STAGE_F32 = False  # ... as float32 (no conversion a read, twice the room: chunks where it does not fit)
SMEM = 47 * 1024  # the shared buffer of the staged input and the attention's scores (48 KB a block in all)
ROWS = (2, 4, 8)  # a step of many rows pads them to one of these (each compiles once)

@dataclass
class _Weights:
    """Every layer's weights stacked by kind, as the kernel takes them."""

    ln1: mx.array  # [L, H]
    ln2: mx.array
    gate_up: mx.array  # [L, 2I, H]
    down: mx.array  # [L, H, I]
    in_w: mx.array  # [LG, P, H]
    out_w: mx.array  # [LG, H, VD]
    conv_w: mx.array  # [LG, C, 4]
    A_log: mx.array  # [LG, Hv] float32
    dt_bias: mx.array
    gnorm_w: mx.array  # [LG, Dv]
    qkv_w: mx.array  # [LA, QKV, H]
    o_w: mx.array  # [LA, H, AO]
    qn_w: mx.array  # [LA, HD]
    kn_w: mx.array
    consts: mx.array  # float32: the RMS norms' eps, the gated norm's eps, the RoPE base
    bar: mx.array  # the barrier's counter, generation and failure flag (kept across calls)
    after: mx.array  # the last call's `done`: each call is made to wait for the one before
    template: list
    attn_layers: int
    nosync: bool = False  # barriers skipped: wrong results, the phases' cost alone (timing probes)
    skip: int = 0  # phases left out (timing probes, wrong results): 1 gemvs, 2 the delta rule, 4 attention,
    # 8 the gemvs' dot products (their inputs still staged), 16 the RMS norms
    calls: int = 0


def prepare(model, layers: list) -> Optional[_Weights]:
    """Stacks the sublayer path's prepared weights (`layers`, as fast_draft prepares them) by kind; None
    where the kernel does not apply (RoPE scaling, shapes it does not take)."""
    text = model.language_model
    args = text.args
    lin = [l for l in model.layers if l.is_linear]
    att = [l for l in model.layers if not l.is_linear]
    fai = args.full_attention_interval
    if not lin or not att or any(l.is_linear == ((i + 1) % fai == 0) for i, l in enumerate(model.layers)):
        return None
    a, g = att[0].self_attn, lin[0].linear_attn
    rope = a.rope
    rot, base = getattr(rope, "dims", None), getattr(rope, "base", None)
    if type(rope).__name__ != "RoPE" or rope.traditional or getattr(rope, "scale", 1.0) != 1.0 or rot is None \
            or rot % 64 or a.head_dim % 32 or g.head_k_dim % 32 or g.head_v_dim % 4 or args.hidden_size % 8 \
            or args.intermediate_size % 8:
        return None
    ws = list(layers)
    gw = [w for w, l in zip(layers, model.layers) if l.is_linear]
    w = _Weights(
        ln1=mx.stack([x.ln1 for x in ws]), ln2=mx.stack([x.ln2 for x in ws]),
        gate_up=mx.stack([x.gate_up for x in ws]), down=mx.stack([x.down for x in ws]),
        in_w=mx.stack([x.in_w for x in gw]), out_w=mx.stack([l.linear_attn.out_proj.weight for l in lin]),
        conv_w=mx.stack([x.conv_w for x in gw]), A_log=mx.stack([l.linear_attn.A_log for l in lin]).astype(mx.float32),
        dt_bias=mx.stack([l.linear_attn.dt_bias for l in lin]).astype(mx.float32), gnorm_w=mx.stack([l.linear_attn.norm.weight for l in lin]),
        qkv_w=mx.stack([mx.concatenate([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight])
                        for l in att]),
        o_w=mx.stack([l.self_attn.o_proj.weight for l in att]),
        qn_w=mx.stack([l.self_attn.q_norm.weight for l in att]), kn_w=mx.stack([l.self_attn.k_norm.weight for l in att]),
        consts=mx.array([ws[0].eps, g.norm.eps, float(base)], dtype=mx.float32),
        bar=mx.zeros((4,), dtype=mx.uint32), after=mx.zeros((1,), dtype=mx.uint32),
        template=[("H", args.hidden_size), ("I", args.intermediate_size), ("L", len(model.layers)), ("FAI", fai),
                  ("Hk", g.num_k_heads), ("Dk", g.head_k_dim), ("Hv", g.num_v_heads), ("Dv", g.head_v_dim),
                  ("NH", a.num_attention_heads), ("NKV", a.num_key_value_heads), ("HD", a.head_dim), ("ROT", rot),
                  ("MAXS", MAX_S)],
        attn_layers=len(att),
    )
    mx.eval([v for v in w.__dict__.values() if isinstance(v, mx.array)])
    for i, x in enumerate(ws):  # the sublayer path's copies become views of these (0.65 GB less)
        x.gate_up, x.down = w.gate_up[i], w.down[i]
    for i, x in enumerate(gw):
        x.in_w, x.conv_w = w.in_w[i], w.conv_w[i]
    failed(w)
    return w


_kernels: dict = {}


def _kernel(n_attn: int):
    if n_attn not in _kernels:
        keys, values = ([f"{kind}{i}" for i in range(n_attn)] for kind in ("keys", "values"))
        table = ("  const void* KEYS[] = {%s};\n  const void* VALUES[] = {%s};\n"
                 "  const int64_t KSTR[][4] = {%s};\n  const int64_t VSTR[][4] = {%s};\n") % (
            ", ".join(keys), ", ".join(values),
            ", ".join("{%s_strides[0], %s_strides[1], %s_strides[2], %s_strides[3]}" % ((k,) * 4) for k in keys),
            ", ".join("{%s_strides[0], %s_strides[1], %s_strides[2], %s_strides[3]}" % ((v,) * 4) for v in values))
        names = ["x0", "ln1", "ln2", "gate_up", "down", "in_w", "out_w", "conv_w", "A_log", "dt_bias", "gnorm_w",
                 "qkv_w", "o_w", "qn_w", "kn_w", "consts", "bar", "after", "pos_in", "live_in", "conv_in", "state_in"] + keys + values
        outs = ["h_out", "conv_out", "state_out", "hs", "p", "y", "ssq", "qkv", "qr", "ao", "mid", "done"]
        source = table + SOURCE
        _kernels[n_attn] = mx.fast.cuda_kernel(name="verity_draft_step", input_names=names, output_names=outs,
                                               source=source, header=dk.HEADER + HEADER_EXTRA,
                                               ensure_row_contiguous=False)
    return _kernels[n_attn]


def eligible(cache: list, T: int) -> bool:
    """Every attention cache holds a prompt and stays within MAX_S (mlx-lm's KVCache, or a batch's
    view of one row that lets a kernel write in place), every recurrent one a state."""
    for c in cache:
        if type(c) is KVCache:
            if c.keys is None or c.offset + T > MAX_S:
                return False
        elif hasattr(c, "in_place"):
            if c.span.rows != 1 or not _slab_takes(c, T):
                return False
        elif hasattr(c, "update_and_fetch") or c[0] is None or c[1] is None or getattr(c, "record", False):
            return False
    return True


def rows_eligible(cache: list) -> bool:
    """A batch's views of 2-max(ROWS) rows, one token each: every attention view lets a kernel
    write its rows in place within MAX_S, every recurrent one holds a state and does not record."""
    for c in cache:
        if hasattr(c, "in_place"):
            if not 2 <= c.span.rows <= ROWS[-1] or not _slab_takes(c, 1):
                return False
        elif hasattr(c, "update_and_fetch") or c[0] is None or c[1] is None or getattr(c, "record", False):
            return False
    return True


def _slab_takes(c, T: int) -> bool:
    return c.takes_in_place() and c.slab.keys[0].dtype == mx.bfloat16 and max(c.span.lengths) + T <= MAX_S


def _make_room(c: KVCache, T: int) -> None:
    """Grows a KV cache without room for T more tokens as mlx-lm's update_and_fetch does (the
    kernel writes only within the arrays; a cache restored from a snapshot is a view with none)."""
    if c.offset + T <= c.keys.shape[2]:
        return
    B, n_kv, _, D = c.keys.shape
    grow = (B, n_kv, ((c.step + T - 1) // c.step) * c.step, D)
    keys, values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    c.keys = mx.concatenate([keys, mx.zeros(grow, keys.dtype)], axis=2)
    c.values = mx.concatenate([values, mx.zeros(grow, values.dtype)], axis=2)


def layers_step(model, w: _Weights, h: mx.array, cache: list) -> mx.array:
    """The residual stream after every layer ([T, H] bf16) for the embedded tokens h [T, H] of one
    sequence; the caches advanced by T (keys and values written in place)."""
    T = h.shape[0]
    kvs = [c for c in cache if type(c) is KVCache or hasattr(c, "in_place")]
    rec = [c for c in cache if not (type(c) is KVCache or hasattr(c, "in_place"))]
    slabs = [_in_place(c, T) for c in kvs]  # (keys, values, length) each, written in place
    conv_in = mx.concatenate([c[0] for c in rec]) if len(rec) > 1 else rec[0][0]  # [LG, 3, C]
    state_in = mx.concatenate([c[1] for c in rec]).astype(mx.float32)  # [LG, Hv, Dv, Dk]
    h_out, conv_out, state_out = _launch(model, w, h, slabs, conv_in, state_in, [slabs[0][2]], [1], many=False)
    for i, c in enumerate(rec):
        c[0], c[1] = conv_out[i : i + 1], state_out[i : i + 1]
        c.advance(T)
    for c in kvs:
        if type(c) is KVCache:
            c.offset += T
        else:  # a batch's view: the batch moves the row's length on at its commit
            c.written(w.after)
    return h_out


def rows_step(model, w: _Weights, h: mx.array, cache: list) -> mx.array:
    """The residual stream after every layer ([TP, H] bf16) for R rows' one token each (h [TP, H]:
    rows past R are padding) on a batch's views: each row's key and value written into its slot
    in place, the recurrent views' arrays replaced; rows of width 0 keep their state."""
    TP = h.shape[0]
    kvs = [c for c in cache if hasattr(c, "in_place")]
    rec = [c for c in cache if not hasattr(c, "in_place")]
    slabs = [c.in_place(1) for c in kvs]
    R, pad = kvs[0].span.rows, TP - kvs[0].span.rows
    pos = list(kvs[0].span.lengths) + [0] * pad
    live = [int(n > 0) for n in kvs[0].span.widths] + [0] * pad
    conv_in = _pad_rows(mx.stack([c[0] for c in rec]), pad)  # [LG, TP, 3, C]
    state_in = _pad_rows(mx.stack([c[1] for c in rec]).astype(mx.float32), pad)  # [LG, TP, Hv, Dv, Dk]
    h_out, conv_out, state_out = _launch(model, w, h, slabs, conv_in, state_in, pos, live, many=True)
    for i, c in enumerate(rec):
        c[0], c[1] = conv_out[i, :R].astype(c[0].dtype), state_out[i, :R].astype(c[1].dtype)
    for c in kvs:
        c.written(w.after)
    return h_out


def _pad_rows(x: mx.array, pad: int) -> mx.array:
    return x if not pad else mx.concatenate([x, mx.zeros((x.shape[0], pad, *x.shape[2:]), x.dtype)], axis=1)


def _launch(model, w: _Weights, h: mx.array, slabs: list, conv_in: mx.array, state_in: mx.array,
            pos: list[int], live: list[int], many: bool) -> tuple[mx.array, mx.array, mx.array]:
    """One launch over the T tokens of h: the stream after every layer, the conv windows and states."""
    T, args = h.shape[0], model.language_model.args
    C, (Hv, Dv, Dk) = conv_in.shape[-1], state_in.shape[-3:]
    P = C + Hv * Dv + 2 * Hv
    a = model.layers[args.full_attention_interval - 1].self_attn
    qkv_n = a.num_attention_heads * a.head_dim * 2 + 2 * a.num_key_value_heads * a.head_dim
    ao_n = a.num_attention_heads * a.head_dim
    inputs = [h, w.ln1, w.ln2, w.gate_up, w.down, w.in_w, w.out_w, w.conv_w, w.A_log, w.dt_bias, w.gnorm_w,
              w.qkv_w, w.o_w, w.qn_w, w.kn_w, w.consts, w.bar, w.after, mx.array(pos, dtype=mx.int32),
              mx.array(live, dtype=mx.int32), conv_in, state_in] + [k for k, _, _ in slabs] + [v for _, v, _ in slabs]
    f32 = mx.float32
    warps = WARPS.get(T, 8)
    outs = _kernel(len(slabs))(
        inputs=inputs, template=[("OutT", h.dtype), ("T", T), ("MANY", many), ("WARPS", warps), ("NOSYNC", w.nosync), ("SKIP", w.skip),
                                 ("XS", STAGE_X), ("XF", STAGE_F32), ("SMEM", SMEM), ("UNROLL", GEMV_UNROLL), ("RW", GDN_ROWS)] + w.template,
        grid=(BLOCKS * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(T, args.hidden_size), conv_in.shape, state_in.shape, (T, args.hidden_size), (T, P),
                       (T, Hv * Dv), (T, Hv), (T, qkv_n), (T, ao_n), (T, ao_n), (T, args.intermediate_size), (1,)],
        output_dtypes=[h.dtype, conv_in.dtype, f32, f32, f32, f32, f32, f32, f32, f32, f32, mx.uint32])
    w.after = outs[-1]  # the next call waits for this one: two at once would share the barrier
    return outs[0], outs[1], outs[2]


def _in_place(c, T: int) -> tuple[mx.array, mx.array, int]:
    """An attention cache's keys, values and length, with room for T more positions."""
    if type(c) is KVCache:
        _make_room(c, T)
        return c.keys, c.values, c.offset
    keys, values, lengths = c.in_place(T)
    return keys, values, lengths[0]


def failed(w: _Weights) -> bool:
    """A barrier of some call waited past its bound (blocks not all resident): results are wrong.
    Reads the whole flag array (prepare reads it once, so whatever the read builds is built at load):
    on a GPU, a round every CHECK_EVERY calls took 2.3-2.6 s where a slice's read may have built a kernel."""
    return bool(w.bar.tolist()[2])


CHECK_EVERY = 256  # calls between reads of the barrier's failure flag (a read waits for the device)


def forward(model, inputs: mx.array, cache: list, w: _Weights) -> mx.array:
    """Logits [1, T, V] of one sequence's T tokens: the layers in one launch, the head in another."""
    _count(w)
    h = model.language_model.model.embed_tokens(inputs).reshape(inputs.shape[1], -1)
    return head_logits(model, layers_step(model, w, h, cache))[None]


def forward_rows(model, inputs: mx.array, cache: list, w: _Weights) -> mx.array:
    """Logits [R, 1, V] of R rows' one token each on a batch's views (rows_eligible): the rows
    padded to one of ROWS, the layers in one launch, the head in another."""
    _count(w)
    R = inputs.shape[0]
    TP = next(n for n in ROWS if n >= R)
    x = inputs if TP == R else mx.concatenate([inputs, mx.zeros((TP - R, 1), inputs.dtype)])
    h = model.language_model.model.embed_tokens(x).reshape(TP, -1)
    return head_logits(model, rows_step(model, w, h, cache))[:R, None]


def _count(w: _Weights) -> None:
    w.calls += 1
    if w.calls % CHECK_EVERY == 0 and failed(w):
        raise RuntimeError("the one-launch draft step's barrier timed out (its blocks were not all resident)")


def head_logits(model, h: mx.array) -> mx.array:
    """The logits of the final norm of h [T, H]: for many rows the norm runs once, not in each of
    the head's blocks (tens of thousands of them, each a pass over every row)."""
    text = model.language_model
    norm = text.model.norm
    head = text.model.embed_tokens.weight if text.args.tie_word_embeddings else text.lm_head.weight
    if h.shape[0] > 1:
        return dk.gemv(mx.fast.rms_norm(h, norm.weight, norm.eps), head)
    return dk.gemv(h, head, norm.weight, norm.eps)
