"""A forward's new keys and values written into an attention slab in place (MLX's CUDA backend).

A scatter or slice update writes its input's memory only when nothing else holds it; on a GPU a
forward is encoded while the round before may still read the slab, so MLX copies the whole slab
first, or not, by timing: a slab-sized copy and a graph of another topology (docs/design.md,
"Slab writes on a GPU"). This kernel writes the rows' new positions into the slab itself. Readers
of earlier rounds ran before it (one stream); the same forward's attention reads after the
evaluation `write` ends, since MLX orders a graph's kernels only by the buffers they output.
"""

from __future__ import annotations

import mlx.core as mx

from worker.kernels import gdn

_SOURCE = """
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int b = blockIdx.z;
  const int H = k_new_shape[1], W = k_new_shape[2], S = keys_shape[2];
  const int h = blockIdx.y / W, w = blockIdx.y % W;
  const size_t src = ((size_t)(b * H + h) * W + w);
  const size_t dst = ((size_t)(b * H + h) * S + pos[b] + w);
  if (d < Dk) const_cast<T*>(keys)[dst * Dk + d] = k_new[src * Dk + d];
  if (d < Dv) const_cast<T*>(values)[dst * Dv + d] = v_new[src * Dv + d];
  if (d == 0 && b == 0 && blockIdx.y == 0) done[0] = 1;
"""

BIG = 256 << 20  # a layer's keys and values: copying them costs a cut's ~0.2 ms (docs/design.md)
_kernel = None
MODES = ("wide", "every", "none", "settle")
_mode = "wide"  # how slabs are written where the kernel runs: one of MODES


def set_mode(mode: str) -> None:
    """A bench's side by side: "wide" (as served: the kernel for forwards wider than one token and
    big slabs), "every" (every write), "none" (MLX's scatter everywhere), "settle" (the scatter,
    with the batch waiting for the device before it encodes each round: `settles`)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"slab write mode {mode!r}: one of {', '.join(MODES)}")
    _mode = mode


def settles() -> bool:
    """The batch waits for the device before it encodes a round, so MLX's scatter finds the slab
    let go by the round before and writes it in place (a lab mode)."""
    return _mode == "settle" and mx.default_device() != mx.cpu


def mode() -> str:
    return _mode


def available() -> bool:
    """True where the kernel runs: a CUDA GPU is the default device (and it is not switched off)."""
    return _mode not in ("none", "settle") and gdn.available()


def takes(slab: mx.array, new: mx.array) -> bool:
    """The kernel writes these new keys [B, H, W, D] into a slab of their own float type: a forward
    wider than one token, or any into a layer's slab of BIG bytes or more (a one-token forward's
    copy of a smaller slab costs less than the kernel's graph cut)."""
    big = 2 * slab.nbytes >= BIG  # keys and values
    return available() and (new.shape[2] > 1 or big or _mode == "every") and slab.dtype == new.dtype \
        and slab.dtype in (mx.bfloat16, mx.float16, mx.float32) and new.shape[-1] <= 1024


def write(keys: mx.array, values: mx.array, start: int, offsets: mx.array, k_new: mx.array,
          v_new: mx.array) -> tuple[mx.array, mx.array]:
    """Rows start.. of slabs [slots, H, S, D] take k_new, v_new [B, H, W, D] at their offsets [B]
    (positions offsets[b] .. + W, within S). Returns the slabs, to be read after the write."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="verity_kv_write", input_names=["keys", "values", "k_new", "v_new", "pos"],
                                      output_names=["done"], source=_SOURCE)
    B, H, W, Dk = k_new.shape
    Dv = v_new.shape[-1]
    rows = slice(start, start + B)  # a leading-axis slice stays contiguous: the kernel gets the slab itself
    done = _kernel(inputs=[keys[rows], values[rows], k_new, v_new, offsets.astype(mx.int32)],
                   template=[("T", keys.dtype), ("Dk", Dk), ("Dv", Dv)],
                   grid=(max(Dk, Dv), H * W, B), threadgroup=(max(Dk, Dv), 1, 1),
                   output_shapes=[(1,)], output_dtypes=[mx.int32])[0]
    mx.async_eval(done)  # ends the graph: this forward's attention reads the slab after the write
    return mx.depends(keys, done), mx.depends(values, done)
