"""A Qwen3.5 draft's decode step in one kernel launch: every layer, grid-wide barriers between
sublayers (MLX's CUDA backend).

One persistent kernel runs all 24 layers for T tokens of one sequence, where a kernel a sublayer
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

from worker.kernels import draft as dk, gdn

BLOCKS = 128  # at most the SMs of a Hopper GPU (132): every block resident, as the barrier needs
WARPS = {1: 16}  # warps a block by T (16 at T = 2 asks for more registers than an SM has)
MAX_S = 4096  # longest attention window (its scores sit in shared memory)
GEMV_UNROLL = 4  # row chunks a warp's loads run ahead by
GDN_ROWS = 4  # state rows a warp owns in the delta rule
STAGE_X = True  # a gemv's input staged in shared memory where it fits (False: read from L2; timing probes)
STAGE_BYTES = 28 * 1024  # ... what it may take there (48 KB in all, the scores' 16 KB among them)

_SOURCE = """
  constexpr int NW = WARPS;  // warps a block
  constexpr int KD = Hk * Dk, C = 2 * KD + Hv * Dv, VD = Hv * Dv, P = C + VD + 2 * Hv;
  constexpr int QW = NH * HD * 2, QKV = QW + 2 * NKV * HD, AO = NH * HD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gw = blockIdx.x * NW + warp, nwarps = gridDim.x * NW;
  const int gt = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
  unsigned int* sync = const_cast<unsigned int*>(bar);
  __shared__ float inv[T];
  __shared__ float part[NW];
  __shared__ float sc[MAXS];
  // a gemv's input, staged once a block in bf16 (normed, gated) where it fits: read from L2 by
  // every warp for every row, with its gamma, it cost 2-3× the weights' traffic
  __shared__ __align__(16) unsigned short xs[XS ? T * KX : 8];
  const int pos = pos_in[0];

  auto grid_sync = [&]() {
    if (NOSYNC) return;  // (timing probes only)
    __syncthreads();
    if (threadIdx.x == 0) {
      volatile unsigned int* gen = sync + 1;
      const unsigned int g = *gen;
      __threadfence();
      if (atomicAdd(sync, 1u) == gridDim.x - 1) {
        atomicExch(sync, 0u);
        __threadfence();
        atomicAdd(sync + 1, 1u);
      } else {
        unsigned int spins = 0;
        volatile unsigned int* flag = sync + 2;
        while (*gen == g && !*flag) {
          if (++spins > (1u << 22)) { atomicOr(sync + 2, 1u); break; }
        }
      }
      __threadfence();
    }
    __syncthreads();
  };
  // 1 / rms of each of the T rows of src [T, K] (float32 scratch), into inv
  auto rms_rows = [&](const float* src, int K, float e) {
    for (int t = 0; t < T; ++t) {
      float s = 0.f;
      for (int i = threadIdx.x; i < K; i += blockDim.x) { const float v = __ldcg(src + (size_t)t * K + i); s += v * v; }
      s = verity_wsum(s);
      if (lane == 0) part[warp] = s;
      __syncthreads();
      if (threadIdx.x == 0) {
        float a = 0.f;
        for (int i = 0; i < NW; ++i) a += part[i];
        inv[t] = rsqrtf(a / K + e);
      }
      __syncthreads();
    }
  };
  // rows [0, N) of W [N(+N), K] (bf16) against x [T, K] (float32 scratch): one warp a row;
  // MODE 0: y = Wx; 1: y = silu(W_n x)·(W_{n+N} x); 2: y += Wx (the residual, in place).
  // NORM: x is rms-normed (inv) and scaled by gamma; GATED: x is the Gated-DeltaNet output
  // (normed by its head's sum of squares, scaled, times silu(z))
  auto gemv = [&](const unsigned short* w, const float* x, int N, int K, float* dst, int mode,
                  const unsigned short* gamma, bool gated, const float* zsrc, const float* ssq,
                  const unsigned short* gnw, float geps) {
    if (XS) {
      __syncthreads();  // the last gemv's warps are done with xs
      for (int i = threadIdx.x; i < T * K; i += blockDim.x) {
        const int t = i / K, k = i - t * K;
        float v = __ldcg(x + i);
        if (gamma) v *= inv[t] * verity_bf16(gamma, k);
        if (gated) {
          const float r = rsqrtf(__ldcg(ssq + t * Hv + k / Dv) / Dv + geps);
          const float z = __ldcg(zsrc + (size_t)t * P + C + k);
          v = v * r * verity_bf16(gnw, k % Dv) * (z / (1.f + __expf(-z)));
        }
        xs[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
      }
      __syncthreads();
    }
    for (int n = gw; n < N; n += nwarps) {
      float acc[T], acc2[T];
      for (int t = 0; t < T; ++t) acc[t] = acc2[t] = 0.f;
      const uint4* wv = reinterpret_cast<const uint4*>(w + (size_t)n * K);
      const uint4* wv2 = reinterpret_cast<const uint4*>(w + (size_t)(n + N) * K);
      #pragma unroll UNROLL
      for (int c = lane; c < K / 8; c += 32) {
        float wf[8], wf2[8], gf[8];
        verity_bf16x8(wv[c], wf);
        if (mode == 1) verity_bf16x8(wv2[c], wf2);
        if (gamma && !XS) verity_bf16x8(reinterpret_cast<const uint4*>(gamma)[c], gf);
        for (int t = 0; t < T; ++t) {
          float xf[8];
          if (XS) {
            verity_bf16x8(reinterpret_cast<const uint4*>(xs + t * K)[c], xf);
            float a = 0.f, a2 = 0.f;
            for (int i = 0; i < 8; ++i) { a += wf[i] * xf[i]; if (mode == 1) a2 += wf2[i] * xf[i]; }
            acc[t] += a;
            acc2[t] += a2;
            continue;
          }
          const float4 a4 = __ldcg(reinterpret_cast<const float4*>(x + (size_t)t * K) + 2 * c);
          const float4 b4 = __ldcg(reinterpret_cast<const float4*>(x + (size_t)t * K) + 2 * c + 1);
          xf[0] = a4.x; xf[1] = a4.y; xf[2] = a4.z; xf[3] = a4.w; xf[4] = b4.x; xf[5] = b4.y; xf[6] = b4.z; xf[7] = b4.w;
          if (gamma) for (int i = 0; i < 8; ++i) xf[i] *= inv[t] * gf[i];
          if (gated) {
            const int j0 = 8 * c, hv = j0 / Dv;
            const float r = rsqrtf(__ldcg(ssq + t * Hv + hv) / Dv + geps);
            for (int i = 0; i < 8; ++i) {
              const float z = __ldcg(zsrc + (size_t)t * P + C + j0 + i);
              xf[i] = bfr(xf[i] * r * verity_bf16(gnw, (j0 + i) % Dv) * (z / (1.f + __expf(-z))));
            }
          }
          float a = 0.f, a2 = 0.f;
          for (int i = 0; i < 8; ++i) { a += wf[i] * xf[i]; if (mode == 1) a2 += wf2[i] * xf[i]; }
          acc[t] += a;
          acc2[t] += a2;
        }
      }
      for (int t = 0; t < T; ++t) {
        float v = verity_wsum(acc[t]);
        if (mode == 1) v = v / (1.f + __expf(-v)) * verity_wsum(acc2[t]);
        if (lane == 0) {
          if (mode == 2) dst[(size_t)t * N + n] = bfr(__ldcg(dst + (size_t)t * N + n) + bfr(v));
          else dst[(size_t)t * N + n] = bfr(v);
        }
      }
    }
  };

  // the residual stream, float32 (values kept on the bf16 grid, as mlx-lm's are)
  for (int i = gt; i < T * H; i += nthreads) hs[i] = verity_bf16(x0, i);
  grid_sync();
  for (int l = 0; l < L; ++l) {
    const bool attn = (l + 1) % FAI == 0;
    const int la = l / FAI, lg = l - l / FAI;
    if (!attn) {
      // in-projection (qkv, z, b, a stacked) on the normed stream; zero the heads' sums of squares
      for (int i = gt; i < T * Hv; i += nthreads) ssq[i] = 0.f;
      rms_rows(hs, H, consts[0]);
      gemv(U16(in_w) + (size_t)lg * P * H, hs, P, H, p, 0, U16(ln1) + (size_t)l * H, false, nullptr, nullptr, nullptr, 0.f);
      grid_sync();
      // conv, q/k l2-norms, gates, the delta rule: a warp owns RW value rows of one head
      const unsigned short* cin = U16(conv_in) + (size_t)lg * 3 * C;
      #define VERITY_CIN(ch, i) ((i) < 3 ? verity_bf16(cin, (size_t)(i) * C + (ch)) : __ldcg(p + (size_t)((i) - 3) * P + (ch)))
      auto conv = [&](int ch, int t) {
        float a = 0.f;
        for (int j = 0; j < 4; ++j) a += verity_bf16(conv_w, ((size_t)lg * C + ch) * 4 + j) * VERITY_CIN(ch, t + j);
        a = bfr(a);
        return bfr(a / (1.f + __expf(-a)));
      };
      constexpr int NPT = Dk / 32, UNITS = Hv * (Dv / RW);
      for (int u = gw; u < UNITS; u += nwarps) {
        const int hv = u / (Dv / RW), r0 = (u % (Dv / RW)) * RW, hk = hv / (Hv / Hk);
        float s[RW][NPT];
        const float* st = state_in + (((size_t)lg * Hv + hv) * Dv + r0) * Dk;
        for (int r = 0; r < RW; ++r)
          for (int m = 0; m < NPT; ++m) s[r][m] = st[(size_t)r * Dk + lane + 32 * m];
        const float a_log = expf(A_log[lg * Hv + hv]), dt = dt_bias[lg * Hv + hv];
        for (int t = 0; t < T; ++t) {
          VERITY_GDN_QK
          const float ax = __ldcg(p + (size_t)t * P + C + VD + Hv + hv) + dt;
          const float g = expf(-a_log * (ax > 20.f ? ax : log1pf(expf(ax))));
          const float beta = 1.f / (1.f + expf(-__ldcg(p + (size_t)t * P + C + VD + hv)));
          float sq = 0.f;
          for (int r = 0; r < RW; ++r) {
            const int dv = r0 + r;
            float kv = 0.f;
            for (int m = 0; m < NPT; ++m) { s[r][m] *= g; kv += s[r][m] * k[m]; }
            const float delta = (conv(2 * KD + hv * Dv + dv, t) - verity_wsum(kv)) * beta;
            float o = 0.f;
            for (int m = 0; m < NPT; ++m) { s[r][m] += k[m] * delta; o += s[r][m] * q[m]; }
            o = verity_wsum(o);
            sq += o * o;
            if (lane == 0) y[(size_t)t * VD + hv * Dv + dv] = o;
          }
          if (lane == 0) atomicAdd(ssq + t * Hv + hv, sq);
        }
        float* so = state_out + (((size_t)lg * Hv + hv) * Dv + r0) * Dk;
        for (int r = 0; r < RW; ++r)
          for (int m = 0; m < NPT; ++m) so[(size_t)r * Dk + lane + 32 * m] = s[r][m];
      }
      for (int i = gt; i < 3 * C; i += nthreads) {
        const int row = i / C, ch = i % C;
        conv_out[(size_t)lg * 3 * C + i] = static_cast<OutT>(VERITY_CIN(ch, T + row));
      }
      #undef VERITY_CIN
      grid_sync();
      // the gated norm, then the out-projection plus the residual
      gemv(U16(out_w) + (size_t)lg * H * VD, y, H, VD, hs, 2, nullptr, true, p, ssq, U16(gnorm_w) + (size_t)lg * Dv, consts[1]);
      grid_sync();
    } else {
      rms_rows(hs, H, consts[0]);
      gemv(U16(qkv_w) + (size_t)la * QKV * H, hs, QKV, H, qkv, 0, U16(ln1) + (size_t)l * H, false, nullptr, nullptr, nullptr, 0.f);
      grid_sync();
      // q/k norms and RoPE; the new keys and values into the cache's buffer
      unsigned short* kc = const_cast<unsigned short*>(reinterpret_cast<const unsigned short*>(KEYS[la]));
      unsigned short* vc = const_cast<unsigned short*>(reinterpret_cast<const unsigned short*>(VALUES[la]));
      const int64_t ks1 = KSTR[la][1], ks2 = KSTR[la][2], ks3 = KSTR[la][3], vs1 = VSTR[la][1], vs2 = VSTR[la][2], vs3 = VSTR[la][3];
      for (int u = gw; u < T * (NH + NKV); u += nwarps) {
        const int t = u / (NH + NKV), h = u % (NH + NKV);
        const bool isq = h < NH;
        const int base = isq ? h * 2 * HD : QW + (h - NH) * HD;
        const unsigned short* nw = isq ? U16(qn_w) + (size_t)la * HD : U16(kn_w) + (size_t)la * HD;
        float e[HD / 32], ss = 0.f;
        for (int m = 0; m < HD / 32; ++m) { e[m] = __ldcg(qkv + (size_t)t * QKV + base + lane + 32 * m); ss += e[m] * e[m]; }
        const float r = rsqrtf(verity_wsum(ss) / HD + consts[0]);
        for (int m = 0; m < HD / 32; ++m) e[m] = bfr(e[m] * r * verity_bf16(nw, lane + 32 * m));
        // RoPE on the first ROT dims: pairs (i, i + ROT/2), i = lane + 32 m < ROT/2
        for (int m = 0; m < ROT / 64; ++m) {
          const int i = lane + 32 * m;
          const float ang = (float)(pos + t) * powf(consts[2], -2.f * i / ROT);
          float sn, cs;
          sincosf(ang, &sn, &cs);
          const float x1 = e[m], x2 = e[m + ROT / 64];
          e[m] = bfr(x1 * cs - x2 * sn);
          e[m + ROT / 64] = bfr(x1 * sn + x2 * cs);
        }
        if (isq) {
          for (int m = 0; m < HD / 32; ++m) qr[((size_t)t * NH + h) * HD + lane + 32 * m] = e[m];
        } else {
          const int kh = h - NH;
          for (int m = 0; m < HD / 32; ++m) {
            const int d = lane + 32 * m;
            kc[kh * ks1 + (int64_t)(pos + t) * ks2 + d * ks3] = __bfloat16_as_ushort(__float2bfloat16_rn(e[m]));
            const float v = __ldcg(qkv + (size_t)t * QKV + QW + NKV * HD + kh * HD + d);
            vc[kh * vs1 + (int64_t)(pos + t) * vs2 + d * vs3] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          }
        }
      }
      grid_sync();
      // attention: a block a (token, head), over the pos + t + 1 keys it sees
      for (int u = blockIdx.x; u < T * NH; u += gridDim.x) {
        const int t = u / NH, h = u % NH, kh = h / (NH / NKV), S = pos + t + 1;
        const float scale = rsqrtf((float)HD);
        for (int s0 = warp; s0 < S; s0 += NW) {
          float a = 0.f;
          for (int m = 0; m < HD / 32; ++m) {
            const int d = lane + 32 * m;
            a += __ldcg(qr + ((size_t)t * NH + h) * HD + d) * __uint_as_float(((unsigned int)__ldcg(kc + kh * ks1 + (int64_t)s0 * ks2 + d * ks3)) << 16);
          }
          a = verity_wsum(a);
          if (lane == 0) sc[s0] = a * scale;
        }
        __syncthreads();
        float mx_ = -1e30f;
        for (int s0 = threadIdx.x; s0 < S; s0 += blockDim.x) mx_ = fmaxf(mx_, sc[s0]);
        for (int o = 16; o > 0; o >>= 1) mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffff, mx_, o));
        if (lane == 0) part[warp] = mx_;
        __syncthreads();
        mx_ = part[0];
        for (int i = 1; i < NW; ++i) mx_ = fmaxf(mx_, part[i]);
        __syncthreads();
        float sum = 0.f;
        for (int s0 = threadIdx.x; s0 < S; s0 += blockDim.x) { const float e = __expf(sc[s0] - mx_); sc[s0] = e; sum += e; }
        sum = verity_wsum(sum);
        if (lane == 0) part[warp] = sum;
        __syncthreads();
        sum = 0.f;
        for (int i = 0; i < NW; ++i) sum += part[i];
        for (int d = threadIdx.x; d < HD; d += blockDim.x) {
          float o = 0.f;
          for (int s0 = 0; s0 < S; ++s0)
            o += sc[s0] * __uint_as_float(((unsigned int)__ldcg(vc + kh * vs1 + (int64_t)s0 * vs2 + d * vs3)) << 16);
          const float gate = __ldcg(qkv + (size_t)t * QKV + h * 2 * HD + HD + d);
          ao[(size_t)t * AO + h * HD + d] = bfr(bfr(o / sum) * (1.f / (1.f + __expf(-gate))));
        }
        __syncthreads();
      }
      grid_sync();
      gemv(U16(o_w) + (size_t)la * H * AO, ao, H, AO, hs, 2, nullptr, false, nullptr, nullptr, nullptr, 0.f);
      grid_sync();
    }
    // the MLP: gate and up with swiglu on the normed stream, then down plus the residual
    rms_rows(hs, H, consts[0]);
    gemv(U16(gate_up) + (size_t)l * 2 * I * H, hs, I, H, mid, 1, U16(ln2) + (size_t)l * H, false, nullptr, nullptr, nullptr, 0.f);
    grid_sync();
    gemv(U16(down) + (size_t)l * H * I, mid, H, I, hs, 2, nullptr, false, nullptr, nullptr, nullptr, 0.f);
    grid_sync();
  }
  for (int i = gt; i < T * H; i += nthreads) h_out[i] = static_cast<OutT>(__ldcg(hs + i));
  if (gt == 0) done[0] = after[0];
"""
_SOURCE = gdn.with_qk_norm(_SOURCE)

_HEADER_EXTRA = """
#define U16(p) reinterpret_cast<const unsigned short*>(p)
__device__ __forceinline__ float bfr(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
"""


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
    calls: int = 0


def prepare(model, layers: list) -> Optional[_Weights]:
    """Stacks the sublayer path's prepared weights (`layers`, fast_draft._prepare) by kind; None
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
                  ("MAXS", MAX_S), ("KX", max(args.hidden_size, args.intermediate_size, g.num_v_heads * g.head_v_dim,
                                              a.num_attention_heads * a.head_dim))],
        attn_layers=len(att),
    )
    mx.eval([v for v in w.__dict__.values() if isinstance(v, mx.array)])
    for i, x in enumerate(ws):  # the sublayer path's copies become views of these (0.65 GB less)
        x.gate_up, x.down = w.gate_up[i], w.down[i]
    for i, x in enumerate(gw):
        x.in_w, x.conv_w = w.in_w[i], w.conv_w[i]
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
                 "qkv_w", "o_w", "qn_w", "kn_w", "consts", "bar", "after", "pos_in", "conv_in", "state_in"] + keys + values
        outs = ["h_out", "conv_out", "state_out", "hs", "p", "y", "ssq", "qkv", "qr", "ao", "mid", "done"]
        source = table + _SOURCE
        _kernels[n_attn] = mx.fast.cuda_kernel(name="verity_draft_step", input_names=names, output_names=outs,
                                               source=source, header=dk.HEADER + _HEADER_EXTRA,
                                               ensure_row_contiguous=False)
    return _kernels[n_attn]


def eligible(cache: list, T: int) -> bool:
    """Every attention cache holds a prompt and stays within MAX_S, every recurrent one a state."""
    for c in cache:
        if type(c) is KVCache:
            if c.keys is None or c.offset + T > MAX_S:
                return False
        elif hasattr(c, "update_and_fetch") or c[0] is None or c[1] is None or getattr(c, "record", False):
            return False
    return True


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
    """The residual stream after every layer ([T, H] bf16) for the embedded tokens h [T, H]; the
    caches advanced by T (keys and values written in place)."""
    T, args = h.shape[0], model.language_model.args
    kvs = [c for c in cache if type(c) is KVCache]
    rec = [c for c in cache if type(c) is not KVCache]
    for c in kvs:
        _make_room(c, T)
    pos = kvs[0].offset
    conv_in = mx.concatenate([c[0] for c in rec]) if len(rec) > 1 else rec[0][0]  # [LG, 3, C]
    state_in = mx.concatenate([c[1] for c in rec]).astype(mx.float32)  # [LG, Hv, Dv, Dk]
    LG, _, C = conv_in.shape
    Hv, Dv, Dk = state_in.shape[1:]
    P = C + Hv * Dv + 2 * Hv
    a = model.layers[args.full_attention_interval - 1].self_attn
    qkv_n = a.num_attention_heads * a.head_dim * 2 + 2 * a.num_key_value_heads * a.head_dim
    ao_n = a.num_attention_heads * a.head_dim
    inputs = [h, w.ln1, w.ln2, w.gate_up, w.down, w.in_w, w.out_w, w.conv_w, w.A_log, w.dt_bias, w.gnorm_w,
              w.qkv_w, w.o_w, w.qn_w, w.kn_w, w.consts, w.bar, w.after, mx.array([pos], dtype=mx.int32), conv_in, state_in] \
        + [c.keys for c in kvs] + [c.values for c in kvs]
    f32 = mx.float32
    warps = WARPS.get(T, 8)
    outs = _kernel(len(kvs))(
        inputs=inputs, template=[("OutT", h.dtype), ("T", T), ("WARPS", warps), ("NOSYNC", w.nosync),
                                 ("XS", STAGE_X and T * dict(w.template)["KX"] * 2 <= STAGE_BYTES),
                                 ("UNROLL", GEMV_UNROLL), ("RW", GDN_ROWS)] + w.template,
        grid=(BLOCKS * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(T, args.hidden_size), conv_in.shape, state_in.shape, (T, args.hidden_size), (T, P),
                       (T, Hv * Dv), (T, Hv), (T, qkv_n), (T, ao_n), (T, ao_n), (T, args.intermediate_size), (1,)],
        output_dtypes=[h.dtype, conv_in.dtype, f32, f32, f32, f32, f32, f32, f32, f32, f32, mx.uint32])
    h_out, conv_out, state_out = outs[:3]
    w.after = outs[-1]  # the next call waits for this one: two at once would share the barrier
    for i, c in enumerate(rec):
        c[0], c[1] = conv_out[i : i + 1], state_out[i : i + 1]
        c.advance(T)
    for c in kvs:
        c.offset += T
    return h_out


def failed(w: _Weights) -> bool:
    """A barrier of some call waited past its bound (blocks not all resident): results are wrong."""
    return bool(w.bar[2].item())


CHECK_EVERY = 256  # calls between reads of the barrier's failure flag (a read waits for the device)


def forward(model, inputs: mx.array, cache: list, w: _Weights) -> mx.array:
    """Logits [1, T, V] of one sequence's T tokens: the layers in one launch, the head in another."""
    w.calls += 1
    if w.calls % CHECK_EVERY == 0 and failed(w):
        raise RuntimeError("the one-launch draft step's barrier timed out (its blocks were not all resident)")
    text = model.language_model
    h = text.model.embed_tokens(inputs).reshape(inputs.shape[1], -1)
    h = layers_step(model, w, h, cache)
    norm = text.model.norm
    head = text.model.embed_tokens.weight if text.args.tie_word_embeddings else text.lm_head.weight
    return dk.gemv(h, head, norm.weight, norm.eps)[None]
