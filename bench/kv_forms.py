"""The two ways attention reads a quantized KV slab (worker/kvformat.attend), timed and checked:
"quantized" (mlx-lm's quantized attention, `quantized_matmul` on the packed values) and
"dequantized" (unpacked to the model's dtype, then MLX's fused attention), against bf16 attention
over the unquantized keys and values; each form's output is compared with a float32 reference on
the CPU over the same quantized values, so a device whose kernels disagree shows which is off.
One decode step's attention over the 32 layers of a Llama-3.1-8B shape, medians of 20.

    python -m bench.kv_forms                 # contexts 1k, 8k; rows 1, 8; query widths 1, 3
    python -m bench.kv_forms --small         # tiny shapes, a check anywhere (tests run it)
"""

from __future__ import annotations

import argparse
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from bench.gpu_models import median_time

SHAPE = dict(layers=32, kv_heads=8, repeats=4, dim=128)  # Llama-3.1-8B's attention
SMALL = dict(layers=2, kv_heads=2, repeats=2, dim=64)


def _median_ms(fn: Callable[[], list], reps: int) -> float:
    return median_time(fn, reps) * 1e3


def _reference(q: mx.array, k: mx.array, v: mx.array, causal: bool) -> mx.array:
    """Attention in float32 on the CPU over keys and values already unpacked there."""
    with mx.stream(mx.cpu):
        q, k, v = (x.astype(mx.float32) for x in (q, k, v))
        mask = "causal" if causal else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)


def forms(q: mx.array, k: mx.array, v: mx.array, bits: int, causal: bool):
    """The two forms' attention over one layer's packed keys and values (callables), and the
    float32 reference over the same packed values."""
    pk, pv = mx.quantize(k, group_size=64, bits=bits), mx.quantize(v, group_size=64, bits=bits)
    scale, mask = q.shape[-1] ** -0.5, "causal" if causal else None

    def quantized():  # mlx-lm scales its queries in place: each call gets a copy
        return quantized_scaled_dot_product_attention(q + 0, pk, pv, scale, mask, 64, bits)

    def dequantized():
        dk, dv = (mx.dequantize(*p, group_size=64, bits=bits) for p in (pk, pv))
        return mx.fast.scaled_dot_product_attention(q, dk, dv, scale=scale, mask=mask)

    with mx.stream(mx.cpu):  # the reference unpacks on the CPU: the device's unpacking is under test too
        rk, rv = (mx.dequantize(*map(_host, p), group_size=64, bits=bits) for p in (pk, pv))
        return quantized, dequantized, _reference(_host(q), rk, rv, causal)


def _host(x: mx.array) -> mx.array:
    """A copy made from host memory (through NumPy), whatever device computed it."""
    return mx.array(np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x))


def error(out: mx.array, ref: mx.array) -> float:
    """Largest difference over the reference's largest magnitude."""
    with mx.stream(mx.cpu):
        return (mx.abs(_host(out) - ref).max() / mx.abs(ref).max()).item()


def row(shape: dict, ctx: int, rows: int, width: int, reps: int) -> dict:
    L, H, R, D = shape["layers"], shape["kv_heads"], shape["repeats"], shape["dim"]
    mx.random.seed(0)
    q = mx.random.normal((rows, H * R, width, D)).astype(mx.bfloat16)
    ks = [mx.random.normal((rows, H, ctx, D)).astype(mx.bfloat16) for _ in range(L)]
    vs = [mx.random.normal((rows, H, ctx, D)).astype(mx.bfloat16) for _ in range(L)]
    causal = width > 1
    bf16 = _median_ms(lambda: [mx.fast.scaled_dot_product_attention(
        q, k, v, scale=D ** -0.5, mask="causal" if causal else None) for k, v in zip(ks, vs)], reps)
    out = {"context": ctx, "rows": rows, "width": width, "bf16_ms": round(bf16, 3)}
    for bits in (4, 8):
        layers = [forms(q, k, v, bits, causal) for k, v in zip(ks, vs)]
        for name, i in (("quantized", 0), ("dequantized", 1)):
            try:
                ms = _median_ms(lambda: [f[i]() for f in layers], reps)
                out[f"q{bits}_{name}_ms"] = round(ms, 3)
                out[f"q{bits}_{name}_error"] = round(error(layers[0][i](), layers[0][2]), 4)
            except (RuntimeError, ValueError) as e:  # a shape the device has no kernel for
                out[f"q{bits}_{name}_ms"] = f"none: {str(e)[:80]}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--contexts", type=int, nargs="+")
    a = p.parse_args(argv)
    shape = SMALL if a.small else SHAPE
    contexts = a.contexts or ([128] if a.small else [1024, 8192])
    for ctx in contexts:
        for rows in (1, 8):
            for width in (1, 3):
                print(row(shape, ctx, rows, width, 3 if a.small else 20), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
