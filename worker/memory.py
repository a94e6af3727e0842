"""Admission by memory: what a request's caches may take at most, and the budget they share.

A request is admitted to the batch only when its worst case (prompt + max_tokens, each token's
attention KV, plus the recurrent state it holds whatever its length) fits in what the admitted
ones leave; the rest wait in the FIFO. Prefix-reuse snapshots have their own budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from worker.kvformat import NATIVE, KVFormat

# rows decoded at once: a GPU's aggregate tokens/s still grows at 64 rows; on the CPU 16 rows
# already space each stream's tokens ~180 ms apart (docs/benchmarks.md, "bench gpu-batch", "bench batch")
MAX_ACTIVE = {"gpu": 64, "cpu": 16}
PREFILL_STEP = {"gpu": 512, "cpu": 128}  # prompt tokens a round: a CPU takes ~1 s for 128 (docs/benchmarks.md, "bench batch")
CPU_SHARE = 0.5  # of the machine's memory, less the weights, where MLX's device shares it with the host
# MLX's buffer cache on a GPU holds at most this share of MLX's memory limit (MLX's default: the whole
# limit, which crowds out the driver's own allocations; docs/memory.md, "MLX's buffer cache while serving")
GPU_CACHE_SHARE = 1 / 8


@dataclass(frozen=True)
class CacheCost:
    per_token: int  # bytes of attention KV one token adds
    fixed: int  # bytes of recurrent state a request holds whatever its length

    def worst_case(self, tokens: int) -> int:
        return self.per_token * tokens + self.fixed

    def __add__(self, other: "CacheCost") -> "CacheCost":
        return CacheCost(self.per_token + other.per_token, self.fixed + other.fixed)


def cache_cost(model, kv: KVFormat = NATIVE) -> CacheCost:
    """Measured on a one-token forward of a fresh cache; attention KV counted in format `kv`
    (quantized: packed bits and a scale and bias a group)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    per_token = fixed = 0
    for c in cache:
        if isinstance(c, KVCache) and c.keys is not None:
            heads, size = c.keys.shape[1], c.keys.dtype.size
            per_token += heads * (kv.bytes_per_position(c.keys.shape[3], size) + kv.bytes_per_position(c.values.shape[3], size))
        elif isinstance(c, ArraysCache):
            fixed += sum(a.nbytes for a in c.cache if a is not None)
    return CacheCost(per_token, fixed)


def weights_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def default_max_active() -> int:
    return MAX_ACTIVE["gpu" if mx.default_device() == mx.gpu else "cpu"]


def default_prefill_step() -> int:
    """A joining request's prompt tokens a round: short on the CPU, where they hold the others' step."""
    return PREFILL_STEP["gpu" if mx.default_device() == mx.gpu else "cpu"]


def default_budget(weights: int) -> int:
    """Bytes the admitted requests' caches may take: the GPU's memory (on Apple silicon its
    recommended working set) less the weights; on the CPU, CPU_SHARE of the machine's memory less
    the weights; at least 1 GiB."""
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:  # Metal
        total = int(info["max_recommended_working_set_size"])
    elif "total_memory" in info and mx.default_device() == mx.gpu:  # CUDA
        total = int(info["total_memory"])
    else:
        total = int(CPU_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return max(1 << 30, total - weights)


def bound_buffer_cache(gpu: Optional[bool] = None) -> int:
    """Caps MLX's buffer cache on a GPU (`gpu`: default, whether MLX's device is one) at
    GPU_CACHE_SHARE of MLX's memory limit and returns the cap; 0 on the CPU, whose cache MLX
    already keeps small."""
    if not (mx.default_device() == mx.gpu if gpu is None else gpu):
        return 0
    cap = int(mx.get_memory_limit() * GPU_CACHE_SHARE)
    mx.set_cache_limit(cap)
    return cap
