"""The Gated-DeltaNet recurrence as one CUDA kernel per layer forward (MLX's CUDA backend).

Off Metal, mlx-lm runs the recurrence one token at a time, some ten kernels a token in every
Gated-DeltaNet layer, and on a GPU each launch costs more than its work (docs/design.md, "GPU kernels": a 9 B
step is 5.5 ms of dispatch; a 4-token verify costs 2.5 one-token steps). This kernel runs all T
tokens of a forward in one launch: one warp per (batch row, value head, value row), the row's
state in registers, and writes the state after every token when the joint path records them
(fast recovery) — no per-position copies.

Per token it computes what mlx-lm's `_gated_delta_step_ops` computes (decay, delta rule, read
out, a masked token leaving the state as it was), in float32, summing over the key dimension in
another order: on a CUDA GPU every forward of a model uses it (`install`), so plain decoding, the
baseline and the verify agree with one another.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

_HEADER = """
__device__ __forceinline__ float verity_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}
"""

_SOURCE = """
  constexpr int NPT = Dk / 32;
  const int T = dims[0];  // tokens: a runtime value, so one compiled kernel serves every width and batch
  const int lane = threadIdx.x;
  const int dv = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;  // batch row * Hv + value head
  const int b = n / Hv, hv = n % Hv, hk = hv / (Hv / Hk);
  const InT* q_ = q + (size_t)b * T * Hk * Dk + hk * Dk;
  const InT* k_ = k + (size_t)b * T * Hk * Dk + hk * Dk;
  const InT* v_ = v + (size_t)b * T * Hv * Dv + hv * Dv;
  InT* y_ = y + (size_t)b * T * Hv * Dv + hv * Dv;
  const size_t row = ((size_t)n * Dv + dv) * Dk;
  float s[NPT];
  for (int i = 0; i < NPT; ++i) s[i] = static_cast<float>(state_in[row + lane + 32 * i]);
  for (int t = 0; t < T; ++t) {
    if (ON) {
      const float decay = static_cast<float>(g[((size_t)b * T + t) * Hv + hv]);
      float kv = 0.f;
      for (int i = 0; i < NPT; ++i) {
        s[i] *= decay;
        kv += s[i] * static_cast<float>(k_[t * Hk * Dk + lane + 32 * i]);
      }
      kv = verity_warp_sum(kv);
      const float delta = (static_cast<float>(v_[t * Hv * Dv + dv]) - kv) *
                          static_cast<float>(beta[((size_t)b * T + t) * Hv + hv]);
      float out = 0.f;
      for (int i = 0; i < NPT; ++i) {
        s[i] += static_cast<float>(k_[t * Hk * Dk + lane + 32 * i]) * delta;
        out += s[i] * static_cast<float>(q_[t * Hk * Dk + lane + 32 * i]);
      }
      out = verity_warp_sum(out);
      if (lane == 0) y_[t * Hv * Dv + dv] = static_cast<InT>(out);
    } else if (lane == 0) {
      y_[t * Hv * Dv + dv] = static_cast<InT>(0.f);
    }
  }
  for (int i = 0; i < NPT; ++i) state_out[row + lane + 32 * i] = static_cast<StT>(s[i]);
"""

# One token's q and k in a fused draft kernel (worker/kernels/draft.py and persistent_draft.py put
# it where they write VERITY_GDN_QK): the short conv's output (`conv`), L2-normed, q also by 1/sqrt(Dk).
QK_NORM = """
    float q[NPT], k[NPT], qs = 0.f, ks = 0.f;
    for (int m = 0; m < NPT; ++m) {
      q[m] = conv(hk * Dk + lane + 32 * m, t);
      k[m] = conv(KD + hk * Dk + lane + 32 * m, t);
      qs += q[m] * q[m];
      ks += k[m] * k[m];
    }
    const float qn = rsqrtf(verity_wsum(qs) + 1e-6f) * rsqrtf((float)Dk), kn = rsqrtf(verity_wsum(ks) + 1e-6f);
    for (int m = 0; m < NPT; ++m) { q[m] *= qn; k[m] *= kn; }"""


def with_qk_norm(source: str) -> str:
    return source.replace("VERITY_GDN_QK", QK_NORM)


_kernels: dict = {}
_dims: dict[int, mx.array] = {}  # the width of a forward, as the kernel reads it
_enabled = True


def set_enabled(on: bool) -> None:
    """Switches the kernel off (mlx-lm's per-token ops then run): `verity bench gpu` measures both."""
    global _enabled
    _enabled = on


def available() -> bool:
    """True where the kernel runs: the default device is a CUDA GPU (and it is not switched off)."""
    return _enabled and mx.default_device() == mx.gpu and mx.cuda.is_available()


def fits(q: mx.array, v: mx.array) -> bool:
    return q.shape[-1] % 32 == 0 and v.shape[-1] % 4 == 0 and v.shape[-2] % q.shape[-2] == 0


def _kernel(masked: bool):
    if masked not in _kernels:
        inputs = ["q", "k", "v", "g", "beta", "state_in", "dims"] + (["mask"] if masked else [])
        source = _SOURCE.replace("ON", "mask[b * T + t]" if masked else "true")
        _kernels[masked] = mx.fast.cuda_kernel(name=f"verity_gated_delta_{int(masked)}", input_names=inputs,
                                               output_names=["y", "state_out"], source=source, header=_HEADER)
    return _kernels[masked]


def recurrence(q, k, v, g, beta, state, mask: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk]; mask [B, T].
    Returns (y [B, T, Hv, Dv], the final state). B and T are runtime values: a new batch size or
    width compiles nothing (each compile took 1-2 s on the GPU)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    dims = _dims.get(T)
    if dims is None:
        dims = _dims[T] = mx.array([T], dtype=mx.int32)
    inputs = [q, k, v, g, beta, state, dims] + ([mask.astype(mx.bool_)] if mask is not None else [])
    out = _kernel(mask is not None)(
        inputs=inputs,
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype],
    )
    return out[0], out[1]


def zero_state(q: mx.array, v: mx.array) -> mx.array:
    """The recurrence's state before any token: [B, Hv, Dv, Dk], float32."""
    return mx.zeros((q.shape[0], *v.shape[2:], q.shape[-1]), dtype=mx.float32)


def final_state(q, k, v, beta, g, state, mask=None) -> tuple[mx.array, mx.array]:
    """The recurrence's outputs and its last state: this kernel where it runs, else mlx-lm's ops."""
    if available() and fits(q, v):
        return recurrence(q, k, v, g, beta, state, mask)
    from mlx_lm.models.gated_delta import gated_delta_ops

    return gated_delta_ops(q, k, v, g, beta, state, mask)
