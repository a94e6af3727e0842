"""Whole-model compiled forwards on fixed-shape state, for GPUs where launches and host work cost.

A Qwen3.5-9B decode step on the H200 reads 16 GB (~5 ms) but takes 10-17 ms eager: some 1,500
ops built in Python and launched one by one (docs/design.md, "GPU kernels"). Compiled whole, a step replays one
traced graph, its elementwise chains fused. That needs every shape fixed: attention KV lives in
a buffer of fixed capacity (mlx-lm's KVCache, its buffer grown to a multiple of CAPACITY_STEP),
written at a traced offset and read whole under a mask; recurrent state has a fixed shape already.
One trace per (input width, capacity, recording); anything else (prompt chunks, batched caches,
an empty cache) runs eagerly, and the two paths share the same cache objects.

Masked attention over the whole buffer sums in another order than attention over the valid
prefix, so logits may differ from the eager path's in the last bits; a model is static or not as
a whole (target and baseline alike).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from worker.state.checkpoint import RecordingArraysCache

CAPACITY_STEP = 1024  # KV capacity grows in these steps: each new capacity is one more trace
MAX_STATIC_TOKENS = 16  # wider inputs (prompt chunks) run eagerly


class _TracedKV:
    """KVCache's interface inside the trace: fixed-capacity buffers written at a traced offset."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), self.offset, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        # query i (at offset + i) sees every buffer position up to its own
        return mx.arange(self.keys.shape[2])[None] <= (self.offset + mx.arange(n))[:, None]


def _eligible(cache: list, width: int) -> bool:
    if width > MAX_STATIC_TOKENS:
        return False
    for c in cache:
        if type(c) is KVCache:
            if c.keys is None:
                return False
        elif isinstance(c, ArraysCache) and type(c) in (ArraysCache, RecordingArraysCache):
            if c.lengths is not None or c.left_padding is not None or any(a is None for a in c.cache):
                return False
        else:
            return False
    return True


def _fit_capacity(c: KVCache, width: int) -> None:
    """Grows c's buffers to a multiple of CAPACITY_STEP with room for width more tokens."""
    need = c.offset + width
    cap = c.keys.shape[2]
    if cap >= need and cap % CAPACITY_STEP == 0:
        return
    cap = -(-max(need, cap) // CAPACITY_STEP) * CAPACITY_STEP

    def grown(a: mx.array) -> mx.array:
        out = mx.zeros((*a.shape[:2], cap, a.shape[3]), a.dtype)
        return mx.slice_update(out, a[..., : c.offset, :], mx.array(0), axes=(2,))

    c.keys, c.values = grown(c.keys), grown(c.values)


def _trace_fn(model, base_call, layout: tuple):
    """The forward as a pure function of (inputs, offset, *state arrays). layout: per cache entry,
    "kv", "arrays" or "record"."""

    def fn(inputs, offset, *arrays):
        it, traced = iter(arrays), []
        for kind in layout:
            if kind == "kv":
                traced.append(_TracedKV(next(it), next(it), offset))
            else:
                t = RecordingArraysCache(2)
                t.cache = [next(it), next(it)]
                t.record = kind == "record"
                traced.append(t)
        logits = base_call(model, inputs, cache=traced)
        out = [logits]
        for t in traced:
            out += [t.keys, t.values] if isinstance(t, _TracedKV) else list(t.cache)
        for t in traced:
            if isinstance(t, RecordingArraysCache) and t.record:
                out += [t.conv_input, *t.states]
        return tuple(out)

    return mx.compile(fn)


class StaticForward:
    """Mixin put before a model's class by set_static: its __call__ runs compiled where the
    cache allows, else the model's own __call__."""

    def __call__(self, inputs: mx.array, cache: Optional[Any] = None, **kwargs):
        base_call = super().__call__
        if cache is None or kwargs or not _eligible(cache, inputs.shape[1]):
            return base_call(inputs, cache=cache, **kwargs)
        layout = tuple("kv" if type(c) is KVCache else "record" if getattr(c, "record", False) else "arrays"
                       for c in cache)
        fns = self.__dict__.setdefault("_static_fns", {})
        key = (layout, repr(mx.default_stream(mx.default_device())))  # a trace keeps its stream
        if key not in fns:
            fns[key] = _trace_fn(self, type(self).base_call, layout)
        width = inputs.shape[1]
        arrays = []
        for c in cache:
            if type(c) is KVCache:
                _fit_capacity(c, width)
                arrays += [c.keys, c.values]
            else:
                arrays += list(c.cache)
        offset = next((c.offset for c in cache if type(c) is KVCache), 0)
        out = fns[key](inputs, mx.array(offset, dtype=mx.int32), *arrays)
        _store(cache, out[1:], width)
        return out[0]


def _store(cache: list, out: tuple, width: int) -> None:
    """Puts the compiled forward's new state back into the cache objects."""
    it = iter(out)
    for c in cache:
        if type(c) is KVCache:
            c.keys, c.values = next(it), next(it)
            c.offset += width
        else:
            c.cache = [next(it), next(it)]
    for c in cache:
        if isinstance(c, RecordingArraysCache) and c.record:
            c.conv_input = next(it)
            c.states = [next(it) for _ in range(width)]
            c.n_keep = c.conv_input.shape[1] - width


def set_static(model, on: bool = True) -> None:
    """Makes the model's forward compile whole where its cache allows (see the module's note), or
    back to its own eager forward."""
    cls = type(model)
    if on and not issubclass(cls, StaticForward):
        model.__class__ = type(f"Static{cls.__name__}", (StaticForward, cls), {"base_call": cls.__call__})
    elif not on and issubclass(cls, StaticForward):
        model.__class__ = cls.__mro__[2]
