"""A decode step's attention-cache work over the 32 layers of a Llama-3.1-8B shape, by KV format:
the slab's writes, then the reads attention takes (quantized: unpacked, worker/kvformat.attend),
then the attention itself; one row at each context given, medians of 35 steps, one wait a step.

    python -m bench.kv_parts 1024 8192      # docs/memory.md, "Quantized KV"
"""
from __future__ import annotations

import sys
import time

import mlx.core as mx

from worker.batch.slots import SlotKV, Span
from worker.kvformat import KVFormat

LAYERS, HEADS, KVH, D = 32, 32, 8, 128


def run(fmt, length, what, steps=40):
    q = mx.random.normal((1, HEADS, 1, D)).astype(mx.bfloat16)
    kv = mx.random.normal((1, KVH, 1, D)).astype(mx.bfloat16)
    slabs = []
    for _ in range(LAYERS):
        s = SlotKV(fmt=fmt)
        full = mx.random.normal((1, KVH, length, D)).astype(mx.bfloat16)
        s.write(Span(0, 1, (0,), (length,)), mx.array([0]), full, full)
        slabs.append(s)
    mx.eval([p for s in slabs for p in s.parts()])
    times = []
    n = length
    for i in range(steps):
        span = Span(0, 1, (n,), (1,))
        off = mx.array([n])
        mx.synchronize()
        t0 = time.perf_counter()
        outs = []
        for s in slabs:
            view = s.view(span, off)
            if what == "write":
                s.write(span, off, kv, kv)
                outs += s.parts()
                continue
            k, v = view.update_and_fetch(kv, kv)
            if what == "fetch":
                outs += [k, v]
                continue
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=None))
        mx.eval(outs)
        times.append(time.perf_counter() - t0)
        n += 1
    times = sorted(times[5:])
    return times[len(times) // 2] * 1e3


def main():
    for length in map(int, sys.argv[1:] or ["1024", "8192"]):
        for name, fmt in (("bf16", KVFormat()), ("q8", KVFormat(8, 64)), ("q4", KVFormat(4, 64))):
            row = [f"{run(fmt, length, w):.2f}" for w in ("write", "fetch", "all")]
            print(f"{length} {name}: write {row[0]} ms, write+fetch {row[1]} ms, write+fetch+sdpa {row[2]} ms "
                  f"(32 layers, one eval)", flush=True)


if __name__ == "__main__":
    main()
