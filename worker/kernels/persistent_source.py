"""The CUDA source of the one-launch draft step (worker/kernels/persistent_draft.py): the kernel's
body, its template parameters filled in there."""

from worker.kernels import gdn

SOURCE = """
  constexpr int NW = WARPS;  // warps a block
  static_assert(SMEM >= MAXS * 4, "the shared buffer holds the attention's scores");
  constexpr int KD = Hk * Dk, C = 2 * KD + Hv * Dv, VD = Hv * Dv, P = C + VD + 2 * Hv;
  constexpr int QW = NH * HD * 2, QKV = QW + 2 * NKV * HD, AO = NH * HD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gw = blockIdx.x * NW + warp, nwarps = gridDim.x * NW;
  const int gt = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
  unsigned int* sync = const_cast<unsigned int*>(bar);
  __shared__ float inv[T];
  __shared__ float part[NW * T];
  // the attention's scores and a gemv's input staged in bf16 (normed, gated) share one buffer:
  // their phases never overlap. Read from L2 by every warp for every row, with its gamma, the
  // input cost 2-3x the weights' traffic
  __shared__ __align__(16) unsigned char smem[SMEM];
  float* sc = reinterpret_cast<float*>(smem);
  unsigned short* xs = reinterpret_cast<unsigned short*>(smem);
  float* xsf = reinterpret_cast<float*>(smem);  // XF: the staged input kept as float (its bf16 values)
  // MANY: token t is row t's one token, at its own position, state and slot (rows not LIVE keep
  // theirs); else the T tokens of one sequence
  constexpr int NR = MANY ? T : 1;
  const int pos = pos_in[0];
  auto POS = [&](int t) { return MANY ? pos_in[t] : pos + t; };
  auto LIVE = [&](int t) { return !MANY || live_in[t] != 0; };

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
  // 1 / rms of each of the T rows of src [T, K] (float32 scratch), into inv: every row's sum in one
  // pass of float4 loads (all in flight), one block reduction
  auto rms_rows = [&](const float* src, int K, float e) {
    if (SKIP & 16) return;
    float s[T];
    for (int t = 0; t < T; ++t) s[t] = 0.f;
    for (int i = threadIdx.x; i < K / 4; i += blockDim.x) {
      #pragma unroll
      for (int t = 0; t < T; ++t) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(src + (size_t)t * K) + i);
        s[t] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
    }
    for (int t = 0; t < T; ++t) {
      const float a = verity_wsum(s[t]);
      if (lane == 0) part[t * NW + warp] = a;
    }
    __syncthreads();
    if (threadIdx.x < T) {
      float a = 0.f;
      for (int i = 0; i < NW; ++i) a += part[threadIdx.x * NW + i];
      inv[threadIdx.x] = rsqrtf(a / K + e);
    }
    __syncthreads();
  };
  // rows [0, N) of W [N(+N), K] (bf16) against x [T, K] (float32 scratch): one warp a row;
  // MODE 0: y = Wx; 1: y = silu(W_n x)·(W_{n+N} x); 2: y += Wx (the residual, in place).
  // NORM: x is rms-normed (inv) and scaled by gamma; GATED: x is the Gated-DeltaNet output
  // (normed by its head's sum of squares, scaled, times silu(z)). An input too wide to stage
  // whole is staged KC columns at a time where every warp owns at most one row.
  auto gemv = [&](const unsigned short* w, const float* x, int N, int K, float* dst, int mode,
                  const unsigned short* gamma, bool gated, const float* zsrc, const float* ssq,
                  const unsigned short* gnw, float geps) {
    if (SKIP & 1) return;  // (timing probes: SKIP leaves phases out, results wrong)
    const int KC = XS ? min(K, (SMEM / ((XF ? 4 : 2) * T)) & ~255) : K;
    const bool stage = XS && (KC == K || N <= nwarps);
    // columns [k0, k0 + kc) of every token's input into the buffer, four at a time: each thread's
    // loads for all T tokens in flight at once (one at a time, their latency cost 1.8 ms a step at T = 8)
    auto stage_cols = [&](int k0, int kc) {
      __syncthreads();  // the last reader of the buffer is done
      for (int j = threadIdx.x; j < kc / 4; j += blockDim.x) {
        const int k = k0 + 4 * j;
        float gm[4], gn[4], r[T];
        if (gamma) verity_bf16x4(gamma + k, gm);
        if (gated) verity_bf16x4(gnw + k % Dv, gn);
        #pragma unroll
        for (int t = 0; t < T; ++t) {
          const float4 q = __ldcg(reinterpret_cast<const float4*>(x + (size_t)t * K + k));
          float v[4] = {q.x, q.y, q.z, q.w};
          if (gamma) for (int i = 0; i < 4; ++i) v[i] *= inv[t] * gm[i];
          if (gated) {
            r[t] = rsqrtf(__ldcg(ssq + t * Hv + k / Dv) / Dv + geps);
            const float4 z4 = __ldcg(reinterpret_cast<const float4*>(zsrc + (size_t)t * P + C + k));
            const float z[4] = {z4.x, z4.y, z4.z, z4.w};
            for (int i = 0; i < 4; ++i) v[i] = v[i] * r[t] * gn[i] * (z[i] / (1.f + __expf(-z[i])));
          }
          const int at = t * kc + 4 * j;
          if (XF) {
            *reinterpret_cast<float4*>(xsf + at) = make_float4(bfr(v[0]), bfr(v[1]), bfr(v[2]), bfr(v[3]));
          } else {
            uint2 o;
            o.x = (unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(v[0])) | ((unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(v[1])) << 16);
            o.y = (unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(v[2])) | ((unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(v[3])) << 16);
            *reinterpret_cast<uint2*>(xs + at) = o;
          }
        }
      }
      __syncthreads();
    };
    // row n's dot with columns [k0, k0 + kc) of every token, added to acc (acc2: row n + N)
    auto dot = [&](int n, int k0, int kc, float* acc, float* acc2) {
      const uint4* wv = reinterpret_cast<const uint4*>(w + (size_t)n * K + k0);
      const uint4* wv2 = reinterpret_cast<const uint4*>(w + (size_t)(n + N) * K + k0);
      #pragma unroll UNROLL
      for (int c = lane; c < kc / 8; c += 32) {
        float wf[8], wf2[8], gf[8];
        verity_bf16x8(wv[c], wf);
        if (mode == 1) verity_bf16x8(wv2[c], wf2);
        if (gamma && !stage) verity_bf16x8(reinterpret_cast<const uint4*>(gamma + k0)[c], gf);
        for (int t = 0; t < T; ++t) {
          float xf[8];
          if (stage && XF) {
            const float4 a4 = reinterpret_cast<const float4*>(xsf + t * kc)[2 * c];
            const float4 b4 = reinterpret_cast<const float4*>(xsf + t * kc)[2 * c + 1];
            xf[0] = a4.x; xf[1] = a4.y; xf[2] = a4.z; xf[3] = a4.w; xf[4] = b4.x; xf[5] = b4.y; xf[6] = b4.z; xf[7] = b4.w;
          } else if (stage) {
            verity_bf16x8(reinterpret_cast<const uint4*>(xs + t * kc)[c], xf);
          } else {
            const float* xt = x + (size_t)t * K + k0;
            const float4 a4 = __ldcg(reinterpret_cast<const float4*>(xt) + 2 * c);
            const float4 b4 = __ldcg(reinterpret_cast<const float4*>(xt) + 2 * c + 1);
            xf[0] = a4.x; xf[1] = a4.y; xf[2] = a4.z; xf[3] = a4.w; xf[4] = b4.x; xf[5] = b4.y; xf[6] = b4.z; xf[7] = b4.w;
            if (gamma) for (int i = 0; i < 8; ++i) xf[i] *= inv[t] * gf[i];
            if (gated) {
              const int j0 = k0 + 8 * c, hv = j0 / Dv;
              const float r = rsqrtf(__ldcg(ssq + t * Hv + hv) / Dv + geps);
              for (int i = 0; i < 8; ++i) {
                const float z = __ldcg(zsrc + (size_t)t * P + C + j0 + i);
                xf[i] = bfr(xf[i] * r * verity_bf16(gnw, (j0 + i) % Dv) * (z / (1.f + __expf(-z))));
              }
            }
          }
          float a = 0.f, a2 = 0.f;
          for (int i = 0; i < 8; ++i) { a += wf[i] * xf[i]; if (mode == 1) a2 += wf2[i] * xf[i]; }
          acc[t] += a;
          acc2[t] += a2;
        }
      }
    };
    auto finish = [&](int n, float* acc, float* acc2) {
      for (int t = 0; t < T; ++t) {
        float v = verity_wsum(acc[t]);
        if (mode == 1) v = v / (1.f + __expf(-v)) * verity_wsum(acc2[t]);
        if (lane == 0) {
          if (mode == 2) dst[(size_t)t * N + n] = bfr(__ldcg(dst + (size_t)t * N + n) + bfr(v));
          else dst[(size_t)t * N + n] = bfr(v);
        }
      }
    };
    float acc[T], acc2[T];
    if (stage && KC < K) {
      for (int t = 0; t < T; ++t) acc[t] = acc2[t] = 0.f;
      for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = min(KC, K - k0);
        stage_cols(k0, kc);
        if (gw < N && !(SKIP & 8)) dot(gw, k0, kc, acc, acc2);
      }
      if (gw < N) finish(gw, acc, acc2);
      return;
    }
    if (stage) stage_cols(0, K);
    for (int n = gw; n < N; n += nwarps) {
      for (int t = 0; t < T; ++t) acc[t] = acc2[t] = 0.f;
      if (!(SKIP & 8)) dot(n, 0, K, acc, acc2);
      finish(n, acc, acc2);
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
      // conv, q/k l2-norms, gates, the delta rule: a warp owns RW value rows of one head (of one row)
      const unsigned short* cin = U16(conv_in) + (size_t)lg * NR * 3 * C;
      // position i of a sequence's conv window then its new inputs (one sequence)
      #define VERITY_CIN(ch, i) ((i) < 3 ? verity_bf16(cin, (size_t)(i) * C + (ch)) : __ldcg(p + (size_t)((i) - 3) * P + (ch)))
      auto conv = [&](int ch, int t) {
        float a = 0.f;
        for (int j = 0; j < 4; ++j) {
          const float v = !MANY ? VERITY_CIN(ch, t + j)
              : j < 3 ? verity_bf16(cin, ((size_t)t * 3 + j) * C + ch) : __ldcg(p + (size_t)t * P + ch);
          a += verity_bf16(conv_w, ((size_t)lg * C + ch) * 4 + j) * v;
        }
        a = bfr(a);
        return bfr(a / (1.f + __expf(-a)));
      };
      constexpr int NPT = Dk / 32, UNITS = Hv * (Dv / RW);
      for (int u = gw; u < (SKIP & 2 ? 0 : NR * UNITS); u += nwarps) {
        const int row = u / UNITS, hv = (u % UNITS) / (Dv / RW), r0 = (u % (Dv / RW)) * RW, hk = hv / (Hv / Hk);
        float s[RW][NPT];
        const size_t at = ((((size_t)lg * NR + row) * Hv + hv) * Dv + r0) * Dk;
        const float* st = state_in + at;
        for (int r = 0; r < RW; ++r)
          for (int m = 0; m < NPT; ++m) s[r][m] = st[(size_t)r * Dk + lane + 32 * m];
        const float a_log = expf(A_log[lg * Hv + hv]), dt = dt_bias[lg * Hv + hv];
        const int t0 = MANY ? row : 0, t1 = !MANY ? T : LIVE(row) ? row + 1 : row;
        if (lane == 0 && t1 == t0)
          for (int r = 0; r < RW; ++r) y[(size_t)row * VD + hv * Dv + r0 + r] = 0.f;
        for (int t = t0; t < t1; ++t) {
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
        float* so = state_out + at;
        for (int r = 0; r < RW; ++r)
          for (int m = 0; m < NPT; ++m) so[(size_t)r * Dk + lane + 32 * m] = s[r][m];
      }
      // the conv windows after: the last 3 inputs (a row not LIVE keeps its window)
      for (int i = gt; i < NR * 3 * C; i += nthreads) {
        const int row = i / (3 * C), j = (i / C) % 3, ch = i % C;
        float v;
        if (!MANY) v = VERITY_CIN(ch, T + j);
        else if (!LIVE(row)) v = verity_bf16(cin, (size_t)i);
        else v = j < 2 ? verity_bf16(cin, ((size_t)row * 3 + j + 1) * C + ch) : __ldcg(p + (size_t)row * P + ch);
        conv_out[(size_t)lg * NR * 3 * C + i] = static_cast<OutT>(v);
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
      const int64_t ks0 = MANY ? KSTR[la][0] : 0, vs0 = MANY ? VSTR[la][0] : 0;  // a row's slot
      for (int u = gw; u < T * (NH + NKV); u += nwarps) {
        const int t = u / (NH + NKV), h = u % (NH + NKV);
        if (!LIVE(t)) continue;
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
          const float ang = (float)POS(t) * powf(consts[2], -2.f * i / ROT);
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
            kc[t * ks0 + kh * ks1 + (int64_t)POS(t) * ks2 + d * ks3] = __bfloat16_as_ushort(__float2bfloat16_rn(e[m]));
            const float v = __ldcg(qkv + (size_t)t * QKV + QW + NKV * HD + kh * HD + d);
            vc[t * vs0 + kh * vs1 + (int64_t)POS(t) * vs2 + d * vs3] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          }
        }
      }
      grid_sync();
      // attention: a block a (token, head), over the pos + t + 1 keys it sees
      for (int u = blockIdx.x; u < (SKIP & 4 ? 0 : T * NH); u += gridDim.x) {
        const int t = u / NH, h = u % NH, kh = h / (NH / NKV), S = POS(t) + 1;
        const float scale = rsqrtf((float)HD);
        if (!LIVE(t)) {  // (block-uniform)
          for (int d = threadIdx.x; d < HD; d += blockDim.x) ao[(size_t)t * AO + h * HD + d] = 0.f;
          continue;
        }
        for (int s0 = warp; s0 < S; s0 += NW) {
          float a = 0.f;
          for (int m = 0; m < HD / 32; ++m) {
            const int d = lane + 32 * m;
            a += __ldcg(qr + ((size_t)t * NH + h) * HD + d) * __uint_as_float(((unsigned int)__ldcg(kc + t * ks0 + kh * ks1 + (int64_t)s0 * ks2 + d * ks3)) << 16);
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
            o += sc[s0] * __uint_as_float(((unsigned int)__ldcg(vc + t * vs0 + kh * vs1 + (int64_t)s0 * vs2 + d * vs3)) << 16);
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
__device__ __forceinline__ void verity_bf16x4(const unsigned short* p, float* f) {  // 4 bf16, 8-byte aligned
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  f[0] = __uint_as_float(u.x << 16); f[1] = __uint_as_float(u.x & 0xffff0000u);
  f[2] = __uint_as_float(u.y << 16); f[3] = __uint_as_float(u.y & 0xffff0000u);
}
"""
