"""A Gated-DeltaNet layer's short convolution and its SiLU as one CUDA kernel (MLX's CUDA backend).

mlx-lm runs the depthwise convolution as `nn.Conv1d`; on a CUDA GPU MLX builds a convolution plan
the first time it meets a (rows, width) shape, 150-200 ms each (docs/benchmarks.md, "Shapes on a
GPU"), and a batch whose rows join and leave, drafting widths that vary, meets new shapes all the
time. This kernel takes the rows and positions at run time: one compile per model serves every
shape. It sums each channel's kernel taps in float32 and applies SiLU before rounding; on a CUDA GPU
every forward of a model uses it (worker/state/checkpoint.py), so plain decoding, the baseline and
the verify agree with one another.
"""

from __future__ import annotations

import mlx.core as mx

from worker.kernels import gdn

_SOURCE = """
  const int S = dims[0];  // output positions: a runtime value, as are the rows (grid z)
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int t = blockIdx.y;
  const int b = blockIdx.z;
  if (c >= C) return;
  const InT* x_ = x + ((size_t)b * (S + K - 1) + t) * C + c;
  float acc = 0.f;
  for (int i = 0; i < K; ++i) acc += static_cast<float>(x_[(size_t)i * C]) * static_cast<float>(w[c * K + i]);
  y[((size_t)b * S + t) * C + c] = static_cast<InT>(acc / (1.f + expf(-acc)));
"""

_kernel = None
_dims: dict[int, mx.array] = {}
THREADS = 256


def fits(conv) -> bool:
    """A depthwise convolution without a bias (Qwen3.5's), where the kernel runs."""
    w = getattr(conv, "weight", None)
    return gdn.available() and w is not None and "bias" not in conv and w.ndim == 3 and w.shape[2] == 1


def silu_conv(conv, x: mx.array) -> mx.array:
    """silu(conv(x)) for x [B, S + K - 1, C]: [B, S, C]."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="verity_silu_conv", input_names=["x", "w", "dims"], output_names=["y"],
                                      source=_SOURCE)
    C, K = conv.weight.shape[0], conv.weight.shape[1]
    B, S = x.shape[0], x.shape[1] - K + 1
    dims = _dims.get(S)
    if dims is None:
        dims = _dims[S] = mx.array([S], dtype=mx.int32)
    return _kernel(inputs=[x, conv.weight.reshape(C, K), dims],
                   template=[("InT", x.dtype), ("K", K), ("C", C)],
                   grid=((C + THREADS - 1) // THREADS * THREADS, S, B), threadgroup=(THREADS, 1, 1),
                   output_shapes=[(B, S, C)], output_dtypes=[x.dtype])[0]


def conv_silu(conv, x: mx.array, nn_silu) -> mx.array:
    """The kernel where it runs, else mlx-lm's convolution and SiLU."""
    return silu_conv(conv, x) if fits(conv) else nn_silu(conv(x))

