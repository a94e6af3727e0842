"""`python -m bench.first_calls`: what a GPU builds the first time it meets a shape. Each of a
forward's operations (at the 9B target's sizes) runs at row counts it has not met, and its first
call's time prints beside its second's; then whole forwards, mlx-lm's own caches against the
slot batch's. A first call far over the second builds something per shape (a kernel, a plan)."""

from __future__ import annotations

import argparse
import json
import time

from worker.backend_env import apply


def _time(fn) -> float:
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def ops(hidden: int, heads: int, kv_heads: int, dim: int, length: int) -> dict:
    """name -> (rows, width) -> a thunk computing the operation on fresh inputs of that shape."""
    import mlx.core as mx
    import mlx.nn as nn

    from worker.kernels import conv as conv_kernel
    from worker.kernels import gdn

    bf = mx.bfloat16
    w = mx.random.normal((hidden * 3, hidden)).astype(bf)
    norm = mx.ones((dim,), bf)
    conv = nn.Conv1d(hidden, hidden, 4, groups=hidden, bias=False)
    conv.set_dtype(bf)
    slab = mx.zeros((64, kv_heads, length + 64, dim), bf)
    mx.eval(w, norm, conv.parameters(), slab)

    def rnd(*shape, dtype=bf):
        return mx.random.normal(shape).astype(dtype)

    def scatter(r, t):
        rows = mx.arange(r)[:, None]
        pos = mx.arange(r)[:, None] * 3 + mx.arange(t)[None] + length // 2
        return (mx.array(slab), rows, pos, rnd(r, t, kv_heads, dim)), _scatter

    def sdpa(r, t, masked):
        q, k, v = rnd(r, heads, t, dim), rnd(r, kv_heads, length, dim), rnd(r, kv_heads, length, dim)
        mask = (mx.arange(length)[None, None, None] < (length - mx.arange(r) - 1)[:, None, None, None]) if masked else None
        return (q, k, v, mask), lambda q, k, v, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=m)

    def delta(r, t):
        hk, hv, dk, dv = 16, 32, 128, 128
        q, k = rnd(r, t, hk, dk), rnd(r, t, hk, dk)
        v, g, beta = rnd(r, t, hv, dv), rnd(r, t, hv).astype(mx.float32), rnd(r, t, hv)
        state = mx.zeros((r, hv, dv, dk), mx.float32)
        mask = mx.arange(t)[None] < mx.full((r, 1), t)
        return (q, k, v, g, beta, state, mask), (lambda *a: gdn.recurrence(*a)) if gdn.available() else (lambda *a: a[0])

    return {
        "matmul": lambda r, t: ((rnd(r, t, hidden),), lambda x: x @ w.T),
        "rms_norm": lambda r, t: ((rnd(r, heads, t, dim),), lambda x: mx.fast.rms_norm(x, norm, 1e-6)),
        "rope_offsets": lambda r, t: ((rnd(r, heads, t, dim), mx.arange(r) + 5), lambda x, o: mx.fast.rope(
            x, dim // 4, traditional=False, base=1e7, scale=1.0, offset=o)),
        "conv1d": lambda r, t: ((rnd(r, t + 3, hidden),), conv),
        "silu_conv_kernel": lambda r, t: ((rnd(r, t + 3, hidden),), lambda x: conv_kernel.conv_silu(conv, x, nn.silu)),
        "scatter_kv": scatter,
        "slice_kv": lambda r, t: ((slab,), lambda s: s[:r, :, : length - 7 + t]),
        "sdpa": lambda r, t: sdpa(r, t, False),
        "sdpa_array_mask": lambda r, t: sdpa(r, t, True),
        "gather_rows": lambda r, t: ((rnd(64, t, hidden), mx.arange(r) * 2 % 64), lambda x, i: x[i]),
        "take_along": lambda r, t: ((rnd(r, t + 4, hidden), (mx.arange(r) % 3)[:, None, None] + mx.arange(4)[None, :, None]),
                                    lambda x, i: mx.take_along_axis(x, i, axis=1)),
        "where_rows": lambda r, t: ((mx.arange(r) % 2 == 0, rnd(r, t, hidden), rnd(r, t, hidden)),
                                    lambda m, a, b: mx.where(m[:, None, None], a, b)),
        "argmax": lambda r, t: ((rnd(r, t, 4096),), lambda x: mx.argmax(x, axis=-1)),
        "concat_rows": lambda r, t: ((rnd(r - 1, t, hidden), rnd(1, t, hidden)), lambda a, b: mx.concatenate([a, b])),
        "gated_delta": delta,
    }


def _scatter(s, rows, pos, x):
    s[rows, :, pos] = x
    return s


def _measure(make, r: int, t: int) -> float:
    import mlx.core as mx

    inputs, run = make(r, t)
    mx.eval([x for x in inputs if x is not None])
    return _time(lambda: run(*inputs))


def check_conv(hidden: int) -> dict:
    """The convolution kernel against mlx-lm's Conv1d and SiLU, at several shapes."""
    import mlx.core as mx
    import mlx.nn as nn

    from worker.kernels import conv as conv_kernel

    conv = nn.Conv1d(hidden, hidden, 4, groups=hidden, bias=False)
    conv.set_dtype(mx.bfloat16)
    worst = 0.0
    for r, t in ((1, 1), (3, 5), (32, 1), (8, 9), (2, 300)):
        x = mx.random.normal((r, t + 3, hidden)).astype(mx.bfloat16)
        want = nn.silu(conv(x)).astype(mx.float32)
        got = conv_kernel.conv_silu(conv, x, nn.silu).astype(mx.float32)
        worst = max(worst, mx.abs(got - want).max().item() / (mx.abs(want).max().item() + 1e-6))
    return {"conv_kernel_runs": conv_kernel.fits(conv), "worst_relative_error": worst}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[3, 5, 6, 7, 9, 11])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 3])
    p.add_argument("--length", type=int, default=1024)
    a = p.parse_args()
    apply()
    import mlx.core as mx

    print(json.dumps(check_conv(8192)), flush=True)
    for name, fn in ops(4096, 16, 4, 256, a.length).items():
        _measure(fn, 2, 1)  # the op once at any shape: what is built once per kind is not counted below
        for t in a.widths:
            firsts, seconds = [], []
            for r in a.rows:
                firsts.append(round(_measure(fn, r, t), 2))
                seconds.append(round(_measure(fn, r, t), 2))
            print(json.dumps({"op": name, "width": t, "rows": a.rows, "first_ms": firsts, "second_ms": seconds}),
                  flush=True)


if __name__ == "__main__":
    main()
