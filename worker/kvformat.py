"""How attention layers keep their keys and values (`--kv-bits`, `--kv-group-size`; docs/memory.md,
"Quantized KV"): in the model's own dtype, or quantized by `mx.quantize` to `bits` a value with a
scale and a bias per `group_size` values of the head dim, as mlx-lm's QuantizedKVCache keeps them
(its attention then takes mlx-lm's quantized path). Recurrent state is never quantized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

ATTEND_ENV = "VERITY_KV_ATTEND"  # "quantized" or "dequantized": overrides `attend()`'s choice
ATTEND_FORMS = ("quantized", "dequantized")
BITS = (4, 8)  # what --kv-bits takes (mx.quantize allows more; the issue names these)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes


@dataclass(frozen=True)
class KVFormat:
    bits: Optional[int] = None  # None: the model's dtype
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def name(self) -> str:
        """The format in a cache identity and a snapshot's layout: "native" or e.g. "q4g64"."""
        return "native" if self.bits is None else f"q{self.bits}g{self.group_size}"

    @classmethod
    def parse(cls, name: str) -> "KVFormat":
        if name == "native":
            return cls()
        bits, group = name.removeprefix("q").split("g")
        return cls(int(bits), int(group))

    def encode(self, x: mx.array) -> list[mx.array]:
        """New keys or values as the slab's parts: [x], or [packed, scales, biases]."""
        return [x] if self.bits is None else list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def bytes_per_position(self, dim: int, itemsize: int) -> int:
        """One head's keys (or values) of one position: packed bits and a scale and bias a group."""
        if self.bits is None:
            return dim * itemsize
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * itemsize

    def empty_cache(self):
        """An empty mlx-lm cache of this format (a snapshot's form)."""
        return KVCache() if self.bits is None else QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    def holds(self, c) -> bool:
        """Whether an mlx-lm cache is of this format."""
        if self.bits is None:
            return type(c) is KVCache
        return isinstance(c, QuantizedKVCache) and (c.bits, c.group_size) == (self.bits, self.group_size)


NATIVE = KVFormat()


def attend() -> str:
    """How attention reads a quantized slab: "quantized" (mlx-lm's quantized attention, matmuls on
    the packed values) on Metal, whose kernels fuse the unpacking; elsewhere "dequantized" (the
    fetched range unpacked to the model's dtype, one layer at a time, then MLX's fused attention):
    MLX's CUDA backend has no quantized matmul for a prefill's scores, and on the CPU the unpacked
    form prefilled 4-6x and decoded 1.1-1.5x faster (docs/memory.md)."""
    form = os.environ.get(ATTEND_ENV)
    if form is not None:
        if form not in ATTEND_FORMS:
            raise ValueError(f"{ATTEND_ENV}={form!r}: expected one of {', '.join(ATTEND_FORMS)}")
        return form
    return "quantized" if mx.metal.is_available() else "dequantized"


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's cache: kv heads, key and value head dims, the dtype's bytes."""

    heads: int
    key_dim: int
    value_dim: int
    itemsize: int


def attention_shapes(model) -> list[AttentionShape]:
    """The model's attention layers' caches, measured on a one-token forward of a fresh cache."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return [AttentionShape(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype.size)
            for c in cache if isinstance(c, KVCache) and c.keys is not None]


def kv_format(bits: Optional[int], group_size: Optional[int]) -> KVFormat:
    """The format the flags ask, or ValueError naming the flag."""
    if bits is None:
        if group_size is not None:
            raise ValueError("--kv-group-size needs --kv-bits")
        return NATIVE
    if bits not in BITS:
        raise ValueError(f"--kv-bits {bits} is not one of {', '.join(map(str, BITS))}")
    group_size = 64 if group_size is None else group_size
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--kv-group-size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    return KVFormat(bits, group_size)


def format_problem(fmt: KVFormat, shapes: list[AttentionShape]) -> Optional[str]:
    """Why this model's attention caches cannot take the format (None: they can)."""
    if not fmt.quantized:
        return None
    try:
        attend()
    except ValueError as e:
        return str(e)
    dims = sorted({d for s in shapes for d in (s.key_dim, s.value_dim)})
    if any(d % fmt.group_size for d in dims):
        return (f"--kv-group-size {fmt.group_size} does not divide this model's attention head_dim "
                f"({', '.join(map(str, dims))}); pick one that does, or serve without --kv-bits")
    return None
