"""The few large kernels of a Qwen3.5 draft's decode step (MLX's CUDA backend), and their ops.

On a GPU a kernel launch costs the host 4-12 µs through MLX (docs/design.md, "Draft kernels": a 1x64 matmul
11.6 µs, an elementwise op 4.3, a custom kernel 6.4), and the 0.75 B draft's step launched ~600
of them: 5-7 ms of dispatch for 1.5 GB of weights, as dear as a third of the 9 B step. These
kernels do a sublayer's work in one launch each:

- `gemv`: y = W·x over T rows (≤ MAX_T tokens of one sequence, or a batch's rows padded to
  8, 16 or 32), optionally on rms_norm(x)·γ (the norm recomputed by every block: x is 2-7 KB),
  optionally swiglu over two stacked weights, optionally plus a residual. One warp per output
  row, 16-byte loads, float32 sums.
- `gdn_step`: a Gated-DeltaNet layer between its in- and out-projection: the causal conv and its
  SiLU, the q/k l2-norms, the gates, the delta-rule recurrence over the T tokens and the gated
  RMSNorm. One block per value head, the state rows in registers.

Each has its ops (`*_ops`, mlx-lm's formulas): they run where the kernels do not (the CPU, the
tests) and are what `verity bench gpu` checks the kernels against. bfloat16 activations and
weights only (the kernels unpack bf16 by bits).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from worker.kernels import gdn

MAX_T = 8  # widest forward the kernels take (a draft feeds 1-2 tokens a step)
GDN_WARPS = 8  # warps of a gdn_step block (Dv / GDN_WARPS state rows each, in registers)

HEADER = """
__device__ __forceinline__ float verity_wsum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}
__device__ __forceinline__ void verity_bf16x8(uint4 u, float* f) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ float verity_bf16(const void* p, size_t i) {
  return __uint_as_float(((unsigned int)reinterpret_cast<const unsigned short*>(p)[i]) << 16);
}
"""

_GEMV = """
  constexpr int CH = K / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * 8 + warp;
  __shared__ float part[8];
  __shared__ float inv[T];
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  if (NORM) {
    for (int t = 0; t < T; ++t) {
      float s = 0.f;
      for (int c = threadIdx.x; c < CH; c += 256) {
        float f[8];
        verity_bf16x8(xv[(size_t)t * CH + c], f);
        for (int i = 0; i < 8; ++i) s += f[i] * f[i];
      }
      s = verity_wsum(s);
      if (lane == 0) part[warp] = s;
      __syncthreads();
      if (threadIdx.x == 0) {
        float a = 0.f;
        for (int i = 0; i < 8; ++i) a += part[i];
        inv[t] = rsqrtf(a / K + eps[0]);
      }
      __syncthreads();
    }
  }
  if (n >= N) return;
  float acc[T], acc2[T];
  for (int t = 0; t < T; ++t) acc[t] = acc2[t] = 0.f;
  const uint4* wv = reinterpret_cast<const uint4*>(w) + (size_t)n * CH;
  const uint4* wv2 = reinterpret_cast<const uint4*>(w) + (size_t)(n + N) * CH;
  const uint4* gv = reinterpret_cast<const uint4*>(GAMMA);
  for (int c = lane; c < CH; c += 32) {
    float wf[8], wf2[8], gf[8];
    verity_bf16x8(wv[c], wf);
    if (SWIGLU) verity_bf16x8(wv2[c], wf2);
    if (NORM) verity_bf16x8(gv[c], gf);
    for (int t = 0; t < T; ++t) {
      float xf[8];
      verity_bf16x8(xv[(size_t)t * CH + c], xf);
      float a = 0.f, a2 = 0.f;
      for (int i = 0; i < 8; ++i) {
        const float xi = NORM ? xf[i] * inv[t] * gf[i] : xf[i];
        a += wf[i] * xi;
        if (SWIGLU) a2 += wf2[i] * xi;
      }
      acc[t] += a;
      if (SWIGLU) acc2[t] += a2;
    }
  }
  for (int t = 0; t < T; ++t) {
    float v = verity_wsum(acc[t]);
    if (SWIGLU) v = v / (1.f + __expf(-v)) * verity_wsum(acc2[t]);
    if (ADD) v += verity_bf16(RES, (size_t)t * N + n);
    if (lane == 0) y[(size_t)t * N + n] = static_cast<OutT>(v);
  }
"""

_GDN = """
  // one block per value head: WARPS warps, warp w owns value rows w, w + WARPS, ...; lane owns key dims lane + 32 m
  constexpr int RPW = Dv / WARPS, NPT = Dk / 32;
  constexpr int KD = Hk * Dk, C = 2 * KD + Hv * Dv, VD = Hv * Dv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hv = blockIdx.x, hk = hv / (Hv / Hk);
  __shared__ float part[WARPS];
  __shared__ float total;
  // the conv's input at sequence index i: the 3 rows of conv_state, then the T new rows of p
  #define VERITY_CONV_IN(ch, i) ((i) < 3 ? verity_bf16(conv_state, (size_t)(i) * C + (ch)) \\
                                          : verity_bf16(p, (size_t)((i) - 3) * P + (ch)))
  auto conv = [&](int ch, int t) {
    float a = 0.f;
    for (int j = 0; j < 4; ++j) a += verity_bf16(conv_w, (size_t)ch * 4 + j) * VERITY_CONV_IN(ch, t + j);
    return a / (1.f + __expf(-a));
  };
  float s[RPW][NPT];
  for (int r = 0; r < RPW; ++r)
    for (int m = 0; m < NPT; ++m)
      s[r][m] = state[((size_t)hv * Dv + warp + WARPS * r) * Dk + lane + 32 * m];
  const float a_log = expf(verity_bf16(A_log, hv)), dt = verity_bf16(dt_bias, hv);
  for (int t = 0; t < T; ++t) {
    VERITY_GDN_QK
    const float ax = verity_bf16(p, (size_t)t * P + C + VD + Hv + hv) + dt;
    const float g = expf(-a_log * (ax > 20.f ? ax : log1pf(expf(ax))));
    const float beta = 1.f / (1.f + expf(-verity_bf16(p, (size_t)t * P + C + VD + hv)));
    float o[RPW], sq = 0.f;
    for (int r = 0; r < RPW; ++r) {
      const int dv = warp + WARPS * r;
      float kv = 0.f;
      for (int m = 0; m < NPT; ++m) { s[r][m] *= g; kv += s[r][m] * k[m]; }
      const float delta = (conv(2 * KD + hv * Dv + dv, t) - verity_wsum(kv)) * beta;
      float out = 0.f;
      for (int m = 0; m < NPT; ++m) { s[r][m] += k[m] * delta; out += s[r][m] * q[m]; }
      o[r] = verity_wsum(out);
      sq += o[r] * o[r];
    }
    if (lane == 0) part[warp] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
      float a = 0.f;
      for (int i = 0; i < WARPS; ++i) a += part[i];
      total = rsqrtf(a / Dv + eps[0]);
    }
    __syncthreads();
    if (lane == 0) {
      for (int r = 0; r < RPW; ++r) {
        const int dv = warp + WARPS * r;
        const float z = verity_bf16(p, (size_t)t * P + C + hv * Dv + dv);
        y[(size_t)t * VD + hv * Dv + dv] = static_cast<OutT>(o[r] * total * verity_bf16(norm_w, dv) * z / (1.f + __expf(-z)));
      }
    }
    __syncthreads();
  }
  for (int r = 0; r < RPW; ++r)
    for (int m = 0; m < NPT; ++m)
      state_out[((size_t)hv * Dv + warp + WARPS * r) * Dk + lane + 32 * m] = s[r][m];
  // the conv window after the T tokens, for the channels this head owns
  const bool owns_qk = hv % (Hv / Hk) == 0;
  for (int i = threadIdx.x; i < 3 * (Dv + 2 * Dk); i += blockDim.x) {
    const int row = i / (Dv + 2 * Dk), j = i % (Dv + 2 * Dk);
    int ch;
    if (j < Dv) ch = 2 * KD + hv * Dv + j;
    else if (!owns_qk) continue;
    else ch = j < Dv + Dk ? hk * Dk + (j - Dv) : KD + hk * Dk + (j - Dv - Dk);
    conv_out[(size_t)row * C + ch] = static_cast<OutT>(VERITY_CONV_IN(ch, T + row));
  }
"""
_GDN = gdn.with_qk_norm(_GDN)
# the same for B sequences at once (grid y: the sequence), each at its own offset of every array
_GDN_ROWS = _GDN.replace("  const int hv = blockIdx.x, hk = hv / (Hv / Hk);\n", """  const int hv = blockIdx.x, hk = hv / (Hv / Hk);
  const size_t vb = blockIdx.y;
  const auto* p = p_rows + vb * T * P;
  const auto* conv_state = conv_rows + vb * 3 * C;
  const auto* state = state_rows + vb * Hv * Dv * Dk;
  auto* y = y_rows + vb * T * VD;
  auto* conv_out = conv_out_rows + vb * 3 * C;
  auto* state_out = state_out_rows + vb * Hv * Dv * Dk;
""", 1)

_kernels: dict = {}
_scalars: dict = {}


def available(dtype=mx.bfloat16) -> bool:
    """True where the kernels run: a CUDA GPU is the default device, activations in bfloat16."""
    return dtype == mx.bfloat16 and mx.default_device() == mx.gpu and mx.cuda.is_available()


def _kernel(name: str, inputs: list[str], outputs: list[str], source: str):
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source, header=HEADER)


def _scalar(x: float) -> mx.array:
    """A float32 [1] array made once: each new one is a host-to-device copy, launched every call."""
    if x not in _scalars:
        _scalars[x] = mx.array([x], dtype=mx.float32)
    return _scalars[x]


def _gemv_kernel(norm: bool, add: bool, swiglu: bool):
    key = ("gemv", norm, add, swiglu)
    if key not in _kernels:
        names = ["x", "w", "eps"] + (["gamma"] if norm else []) + (["res"] if add else [])
        source = _GEMV.replace("GAMMA", "gamma" if norm else "w").replace("RES", "res" if add else "x")
        _kernels[key] = _kernel("verity_gemv_%d%d%d" % key[1:], names, ["y"], source)
    return _kernels[key]


def gemv(x: mx.array, w: mx.array, gamma: Optional[mx.array] = None, eps: float = 1e-6,
         res: Optional[mx.array] = None, swiglu: bool = False, kernel: bool = True) -> mx.array:
    """x [T, K] -> [T, N]: x·Wᵀ with W [N, K] (swiglu: W [2N, K], silu(x·W[:N]ᵀ) · x·W[N:]ᵀ);
    `gamma`: on rms_norm(x)·γ; `res` [T, N]: plus it."""
    if not kernel:
        return gemv_ops(x, w, gamma, eps, res, swiglu)
    T, K = x.shape
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    norm, add = gamma is not None, res is not None
    inputs = [x, w, _scalar(eps)] + ([gamma] if norm else []) + ([res] if add else [])
    return _gemv_kernel(norm, add, swiglu)(
        inputs=inputs, template=[("OutT", x.dtype), ("T", T), ("K", K), ("N", N), ("NORM", norm), ("ADD", add),
                                 ("SWIGLU", swiglu)],
        grid=(((N + 7) // 8) * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(T, N)], output_dtypes=[x.dtype])[0]


def gemv_ops(x, w, gamma=None, eps=1e-6, res=None, swiglu=False) -> mx.array:
    h = mx.fast.rms_norm(x, gamma, eps) if gamma is not None else x
    y = h @ w.T
    if swiglu:
        g, u = mx.split(y, 2, axis=-1)
        y = nn.silu(g) * u
    return y + res if res is not None else y


def gdn_step(p: mx.array, conv_state: mx.array, conv_w: mx.array, A_log: mx.array, dt_bias: mx.array,
             state: mx.array, norm_w: mx.array, eps: float, dims: tuple[int, int, int, int],
             kernel: bool = True) -> tuple[mx.array, mx.array, mx.array]:
    """One Gated-DeltaNet layer between its projections, for one sequence of T tokens.

    p [T, P]: the stacked in-projection (qkv of the conv's C channels, z, b, a); conv_state
    [3, C]; conv_w [C, 4]; state [Hv, Dv, Dk] float32; dims (Hk, Dk, Hv, Dv). Returns (the gated,
    normed outputs [T, Hv·Dv], the conv window after them [3, C], the state after them)."""
    if not kernel:
        return gdn_step_ops(p, conv_state, conv_w, A_log, dt_bias, state, norm_w, eps, dims)
    Hk, Dk, Hv, Dv = dims
    T, P = p.shape
    if "gdn" not in _kernels:
        _kernels["gdn"] = _kernel("verity_gdn_step", ["p", "conv_state", "conv_w", "A_log", "dt_bias", "state",
                                                      "norm_w", "eps"], ["y", "conv_out", "state_out"], _GDN)
    return tuple(_kernels["gdn"](inputs=[p, conv_state, conv_w, A_log, dt_bias, state, norm_w, _scalar(eps)],
                      template=[("OutT", p.dtype), ("T", T), ("P", P), ("Hk", Hk), ("Dk", Dk), ("Hv", Hv), ("Dv", Dv),
                                ("WARPS", GDN_WARPS)],
                      grid=(Hv * 32 * GDN_WARPS, 1, 1), threadgroup=(32 * GDN_WARPS, 1, 1),
                      output_shapes=[(T, Hv * Dv), conv_state.shape, state.shape],
                      output_dtypes=[p.dtype, conv_state.dtype, state.dtype]))


def gdn_step_rows(p: mx.array, conv_state: mx.array, conv_w: mx.array, A_log: mx.array, dt_bias: mx.array,
                  state: mx.array, norm_w: mx.array, eps: float, dims: tuple[int, int, int, int],
                  kernel: bool = True) -> tuple[mx.array, mx.array, mx.array]:
    """`gdn_step` for B sequences of T tokens each, in one launch: p [B, T, P], conv_state [B, 3, C],
    state [B, Hv, Dv, Dk] float32; returns ([B, T, Hv·Dv], [B, 3, C], [B, Hv, Dv, Dk])."""
    if not kernel:
        outs = [gdn_step_ops(p[b], conv_state[b], conv_w, A_log, dt_bias, state[b], norm_w, eps, dims)
                for b in range(p.shape[0])]
        return tuple(mx.stack(x) for x in zip(*outs))
    Hk, Dk, Hv, Dv = dims
    B, T, P = p.shape
    if "gdn_rows" not in _kernels:
        _kernels["gdn_rows"] = _kernel("verity_gdn_rows", ["p_rows", "conv_rows", "conv_w", "A_log", "dt_bias",
                                                           "state_rows", "norm_w", "eps"],
                                       ["y_rows", "conv_out_rows", "state_out_rows"], _GDN_ROWS)
    return tuple(_kernels["gdn_rows"](
        inputs=[p, conv_state, conv_w, A_log, dt_bias, state, norm_w, _scalar(eps)],
        template=[("OutT", p.dtype), ("T", T), ("P", P), ("Hk", Hk), ("Dk", Dk), ("Hv", Hv), ("Dv", Dv),
                  ("WARPS", GDN_WARPS)],
        grid=(Hv * 32 * GDN_WARPS, B, 1), threadgroup=(32 * GDN_WARPS, 1, 1),
        output_shapes=[(B, T, Hv * Dv), conv_state.shape, state.shape],
        output_dtypes=[p.dtype, conv_state.dtype, state.dtype]))


def gdn_step_ops(p, conv_state, conv_w, A_log, dt_bias, state, norm_w, eps, dims):
    """mlx-lm's GatedDeltaNet.__call__ from its in-projection on (qwen3_5.py, gated_delta.py)."""
    Hk, Dk, Hv, Dv = dims
    T = p.shape[0]
    C = 2 * Hk * Dk + Hv * Dv
    qkv, z, b, a = mx.split(p, [C, C + Hv * Dv, C + Hv * Dv + Hv], axis=-1)
    window = mx.concatenate([conv_state, qkv], axis=0)  # [3 + T, C]
    conv = sum(window[j: j + T] * conv_w[:, j] for j in range(4))
    conv = nn.silu(conv)
    q, k, v = mx.split(conv, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q, k, v = q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), v.reshape(T, Hv, Dv)
    q = q.astype(mx.float32) * mx.rsqrt((q.astype(mx.float32) ** 2).sum(-1, keepdims=True) + 1e-6) / Dk ** 0.5
    k = k.astype(mx.float32) * mx.rsqrt((k.astype(mx.float32) ** 2).sum(-1, keepdims=True) + 1e-6)
    if Hv > Hk:
        q, k = mx.repeat(q, Hv // Hk, 1), mx.repeat(k, Hv // Hk, 1)
    g = mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32)))  # [T, Hv]
    beta = mx.sigmoid(b.astype(mx.float32))
    ys = []
    for t in range(T):
        state = state * g[t][:, None, None]
        kv = (state * k[t][:, None, :]).sum(-1)  # [Hv, Dv]
        delta = (v[t].astype(mx.float32) - kv) * beta[t][:, None]
        state = state + delta[..., None] * k[t][:, None, :]
        ys.append((state * q[t][:, None, :]).sum(-1))
    o = mx.stack(ys)  # [T, Hv, Dv]
    o = o * mx.rsqrt((o * o).mean(-1, keepdims=True) + eps) * norm_w.astype(mx.float32)
    zf = z.reshape(T, Hv, Dv).astype(mx.float32)
    y = (o * nn.silu(zf)).reshape(T, Hv * Dv).astype(p.dtype)
    return y, window[T:], state
