"""The CUDA source of the one-launch draft step (worker/kernels/persistent_draft.py): the kernel's
body, its template parameters filled in there."""

from worker.kernels import gdn

SOURCE = """
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
SOURCE = gdn.with_qk_norm(SOURCE)

HEADER_EXTRA = """
#define U16(p) reinterpret_cast<const unsigned short*>(p)
__device__ __forceinline__ float bfr(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
"""
