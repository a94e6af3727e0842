"""Slot caches: every active row's model state in one batch, each row in its own slot.

An attention layer keeps one slab of keys and values, [slots, heads, capacity, dim]; a row's
first `length` positions are its tokens. A forward writes each row's new keys at that row's own
length (a scatter, or one slice where every row has the same length) and masks what lies past
each row's position, so a rejected draft is only a row length lowered: what it wrote past there
is masked now and overwritten later. A recurrent layer (Gated-DeltaNet) keeps its arrays with
one row a slot; the forward's per-row lengths keep padded positions from changing them, and a
wide forward records the state after every position, so each row keeps the one after its own
accepted length.

The views passed to the model implement mlx-lm's cache protocol (`offset`, `update_and_fetch`,
`make_mask`; `cache[0]`, `cache[1]`, `lengths` for recurrent layers), so mlx-lm's model code runs
unchanged on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from worker.kernels import kv_write
from worker.kvformat import NATIVE, KVFormat, attend

STEP = 256  # positions a slab grows by
CAUSAL_FROM = 32  # narrower forwards (a verify) get an array mask: a "causal" one may take a path built per shape


@dataclass(frozen=True)
class Span:
    """The slots [start, stop) of one forward, each row's length before it and its real width."""

    start: int
    stop: int
    lengths: tuple[int, ...]
    widths: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def width(self) -> int:
        return max(self.widths, default=0)

    @property
    def even(self) -> bool:
        """Every row at one length and one width: plain slices, no scatter or mask."""
        return len(set(self.lengths)) <= 1 and len(set(self.widths)) <= 1


@dataclass(frozen=True)
class Rolling:
    """A row that decodes past the context over a sliding window (context_overflow "rolling"), as
    mlx-lm's RotatingKVCache(max_size=window, keep=keep): a query sees the first `keep` positions
    and the latest `window - keep` up to its own. The slab still holds every position: the mask
    hides the others, so the row's memory is bounded by its max_tokens, not by the window."""

    window: int
    keep: int


FAR = 1 << 30  # a reach no position attains: a row without a window


class SlotKV:
    """One attention layer's keys and values for every slot. `window`: a sliding-window layer
    (mlx-lm's RotatingKVCache); the slab keeps every position and the mask hides the old ones.
    `fmt`: how they are kept; a quantized slab is three parts (packed, scales, biases), each
    [slots, heads, capacity, n], written and moved alike."""

    def __init__(self, window: Optional[int] = None, fmt: KVFormat = NATIVE):
        self.keys: Optional[list[mx.array]] = None  # the parts: [slab], or [packed, scales, biases]
        self.values: Optional[list[mx.array]] = None
        self.window, self.fmt = window, fmt
        # how attention reads a quantized slab, chosen once (worker/kvformat.attend)
        self.view_kind = KVView if not fmt.quantized else QuantizedKVView if attend() == "quantized" else DequantizedKVView

    def reserve(self, slots: int, positions: int, like: Optional[tuple[list, list]] = None) -> None:
        """Room for `slots` rows of `positions` each (grown, never shrunk; `like` gives the parts'
        shapes and dtypes of the first arrays)."""
        if self.keys is None:
            if like is None:
                return
            self.keys, self.values = ([mx.zeros((slots, p.shape[1], _round(positions), p.shape[3]), p.dtype) for p in ps]
                                      for ps in like)
            return
        if positions > self.keys[0].shape[2]:
            grow = _round(positions) - self.keys[0].shape[2]
            self.keys, self.values = ([mx.concatenate([p, mx.zeros((p.shape[0], p.shape[1], grow, p.shape[3]), p.dtype)],
                                                      axis=2) for p in ps] for ps in (self.keys, self.values))
        if slots > self.keys[0].shape[0]:  # rows grow by doubling: a join does not copy the slab each time
            extra = max(slots, 2 * self.keys[0].shape[0]) - self.keys[0].shape[0]
            self.keys, self.values = ([mx.concatenate([p, mx.zeros((extra, *p.shape[1:]), p.dtype)]) for p in ps]
                                      for ps in (self.keys, self.values))

    def parts(self) -> list[mx.array]:
        return [] if self.keys is None else self.keys + self.values

    def write(self, span: Span, offsets: mx.array, keys: mx.array, values: mx.array) -> None:
        """Each row's W new positions at its own length."""
        w = keys.shape[2]
        new_k, new_v = self.fmt.encode(keys), self.fmt.encode(values)
        self.reserve(span.stop, max(span.lengths) + w, (new_k, new_v))
        if not self.fmt.quantized and kv_write.takes(self.keys[0], keys):  # a GPU's wide forward: in place
            self.keys[0], self.values[0] = kv_write.write(self.keys[0], self.values[0], span.start, offsets,
                                                          keys, values)
            return
        if span.even:
            n = span.lengths[0]
            for part, new in zip(self.parts(), new_k + new_v):
                part[span.start: span.stop, :, n: n + w, :] = new
            return
        rows = mx.arange(span.start, span.stop)[:, None]
        pos = offsets[:, None] + mx.arange(w)[None]
        for part, new in zip(self.parts(), new_k + new_v):
            part[rows, :, pos] = new.transpose(0, 2, 1, 3)

    def fetch(self, span: Span, upto: int) -> tuple:
        """The rows' keys and values up to `upto`: arrays, or (packed, scales, biases) tuples."""
        k, v = ([p[span.start: span.stop, :, :upto, :] for p in ps] for ps in (self.keys, self.values))
        return (k[0], v[0]) if not self.fmt.quantized else (tuple(k), tuple(v))

    def move_rows(self, moves: list[tuple[int, int]], slots: int) -> None:
        """Rows to other slots at once: (dst, src) pairs."""
        if self.keys is None or not moves:
            return
        self.reserve(slots, 0)
        dst = mx.array([d for d, _ in moves])
        src = mx.array([s for _, s in moves])
        moved = [part[src] for part in self.parts()]
        mx.eval(moved)  # read apart first: a scatter whose input a pending read holds copies the whole slab
        for part, rows in zip(self.parts(), moved):
            part[dst] = rows

    def row(self, slot: int, length: int):
        """A copy of a row as mlx-lm's KVCache, or QuantizedKVCache (a snapshot's form)."""
        c = self.fmt.empty_cache()
        if self.keys is not None and length:
            k, v = ([mx.array(p[slot: slot + 1, :, :length, :]) for p in ps] for ps in (self.keys, self.values))
            c.keys, c.values = (k[0], v[0]) if not self.fmt.quantized else (tuple(k), tuple(v))
            c.offset = length
        return c

    def put(self, slot: int, c, length: int) -> None:
        """A row from an mlx-lm cache of this slab's format holding at least `length` positions."""
        if c.keys is None or length == 0:
            return
        if not self.fmt.holds(c):
            raise ValueError(f"a {type(c).__name__} cannot restore a row of {self.fmt.name} KV")
        k, v = ([a[..., :length, :] for a in ([x] if not self.fmt.quantized else list(x))] for x in (c.keys, c.values))
        self.reserve(slot + 1, length, (k, v))
        for part, new in zip(self.parts(), k + v):
            part[slot: slot + 1, :, :length, :] = new

    def view(self, span: Span, offsets: mx.array, rolling: Optional[list[Optional["Rolling"]]] = None,
             width: Optional[int] = None) -> "KVView":
        """The view a forward of these rows passes the model (quantized: in the form `attend()` chose);
        `width`: the forward's tokens a row, padding included (default: its widest row's)."""
        return self.view_kind(self, span, offsets, rolling, width)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())


def _round(n: int) -> int:
    return max(STEP, (n + STEP - 1) // STEP * STEP)


class KVView:
    """mlx-lm's attention-cache protocol over one forward's rows of a SlotKV."""

    def __init__(self, slab: SlotKV, span: Span, offsets: mx.array, rolling: Optional[list[Optional[Rolling]]] = None,
                 width: Optional[int] = None):
        self.slab, self.span, self.offset = slab, span, offsets
        # keys up to every position written, padding too: a "causal" mask aligns the queries with the last keys
        self.upto = max(span.lengths) + (span.width if width is None else width)
        past = rolling and any(r is not None and n + span.width > r.window for r, n in zip(rolling, span.lengths))
        self.rolling = rolling if past else None  # only once a row's queries pass its window

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.slab.write(self.span, self.offset, keys, values)
        return self.slab.fetch(self.span, self.upto)

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        """Query i of row r (position length_r + i) sees keys at positions up to its own, and
        within the window on sliding layers."""
        window = window_size or self.slab.window
        plain = window is None and self.rolling is None
        if self.span.even and plain and not return_array and (n == 1 or n >= CAUSAL_FROM):
            return None if n == 1 else "causal"
        q = self.offset[:, None] + mx.arange(n)[None]  # [B, n]
        k = mx.arange(self.upto)
        mask = k[None, None, :] <= q[:, :, None]
        if window is not None:
            mask = mask & (k[None, None, :] > q[:, :, None] - window)
        if self.rolling is not None:
            keep = mx.array([r.keep if r else 0 for r in self.rolling])[:, None, None]
            reach = mx.array([r.window - r.keep if r else FAR for r in self.rolling])[:, None, None]
            mask = mask & ((k[None, None, :] < keep) | (k[None, None, :] > q[:, :, None] - reach))
        return mask[:, None]

    def in_place(self, extra: int) -> Optional[tuple[mx.array, mx.array, tuple]]:
        """For a kernel that writes its rows' new keys and values into the slab itself: the rows'
        keys and values (views of their slots, with room for `extra` more positions) and their
        lengths; None unless the view holds native keys on a layer without a window. The
        kernel's caller then calls `written`."""
        s, slab = self.span, self.slab
        if not self.takes_in_place():
            return None
        slab.reserve(s.stop, max(s.lengths) + extra)
        return slab.keys[0][s.start: s.stop], slab.values[0][s.start: s.stop], s.lengths

    def takes_in_place(self) -> bool:
        """Whether `in_place` applies: native keys, held already, on a layer without a window."""
        slab = self.slab
        return not slab.fmt.quantized and slab.window is None and self.rolling is None and slab.keys is not None

    def written(self, done: mx.array) -> None:
        """A kernel wrote into the slab in place: whatever reads it from now on waits for `done`."""
        self.slab.keys = [mx.depends(p, done) for p in self.slab.keys]
        self.slab.values = [mx.depends(p, done) for p in self.slab.values]

    @property
    def state(self):
        return self.slab.fetch(self.span, self.upto)

    def is_trimmable(self) -> bool:
        return False


class QuantizedKVView(KVView):
    """A KVView over a quantized slab: `bits` and `group_size` send mlx-lm's attention to its
    quantized path, which reads the (packed, scales, biases) tuples update_and_fetch returns."""

    @property
    def bits(self) -> int:
        return self.slab.fmt.bits

    @property
    def group_size(self) -> int:
        return self.slab.fmt.group_size


class DequantizedKVView(KVView):
    """A KVView over a quantized slab that hands attention the fetched range unpacked to the
    model's dtype (one layer's at a time), so MLX's fused attention reads it."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fmt = self.slab.fmt
        k, v = super().update_and_fetch(keys, values)
        return tuple(mx.dequantize(*x, group_size=fmt.group_size, bits=fmt.bits) for x in (k, v))


class SlotArrays:
    """One recurrent layer's arrays (conv window, state), one row a slot, for the live rows only."""

    def __init__(self, size: int):
        self.arrays: list[Optional[mx.array]] = [None] * size

    def rows(self, span: Span) -> list[Optional[mx.array]]:
        return [None if a is None else a[span.start: span.stop] for a in self.arrays]

    def set_rows(self, span: Span, new: list[Optional[mx.array]], total: int) -> None:
        """A forward's arrays for its rows back in place (all rows: replaced)."""
        for e, a in enumerate(new):
            if a is None:
                continue
            old = self.arrays[e]
            if span.start == 0 and span.stop == total:
                self.arrays[e] = a
                continue
            if old is None:
                old = mx.zeros((total, *a.shape[1:]), a.dtype)
            self.arrays[e] = mx.concatenate([old[: span.start], a.astype(old.dtype), old[span.stop:]])

    def apply(self, order: list[int], fresh: dict[int, list]) -> None:
        """Rows rearranged: new row i is old row order[i], or (-1) a joining row's arrays from
        `fresh` (zeros where it has none: the state before any token)."""
        for e, a in enumerate(self.arrays):
            like = a if a is not None else next((f[e] for f in fresh.values() if f and f[e] is not None), None)
            if like is not None:
                self.arrays[e] = _rearranged(a, like, order, {i: f[e] if f else None for i, f in fresh.items()})

    def row(self, slot: int) -> list[Optional[mx.array]]:
        return [None if a is None else a[slot: slot + 1] for a in self.arrays]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


def _rearranged(a: Optional[mx.array], like: mx.array, order: list[int],
                fresh: dict[int, Optional[mx.array]]) -> Optional[mx.array]:
    """Rows in a new order: old rows only rearranged move in one scatter of the moved rows (a
    leave moves one), joining rows in one gather; a join or a leave adds the same few operations
    at every row count."""
    if not order:
        return None
    old = 0 if a is None else a.shape[0]
    if a is not None and all(0 <= s < old for s in order):
        moves = [(i, s) for i, s in enumerate(order) if i != s]
        if moves:
            a = mx.array(a)  # the scatter below must not change the caller's array
            a[mx.array([i for i, _ in moves])] = a[mx.array([s for _, s in moves])]
        return a[: len(order)]
    extra, index = [], []
    for i, src in enumerate(order):
        if src >= 0 and a is not None:
            index.append(src)
            continue
        f = fresh.get(i)
        index.append(old + len(extra))
        extra.append(f.astype(like.dtype) if f is not None else mx.zeros((1, *like.shape[1:]), like.dtype))
    rows = mx.concatenate(([a] if a is not None else []) + extra)
    return rows if index == list(range(len(rows))) else rows[mx.array(index)]


class StateView(ArraysCache):
    """mlx-lm's recurrent-cache protocol over one forward's rows: `lengths` are the rows' real
    widths (padded positions leave the state as it was); with `record`, the layer keeps its conv
    input and its recurrence's inputs (worker/state/checkpoint.py's recording layer)."""

    def __init__(self, arrays: list[Optional[mx.array]], widths: Optional[mx.array], record: bool):
        super().__init__(len(arrays))
        self.cache = list(arrays)
        self.lengths = widths
        self.record = record
        self.conv_input: Optional[mx.array] = None  # [B, n_keep + W, C], when recorded
        self.recurrence: Optional[tuple] = None  # (q, k, v, beta, g, the state before), when recorded
        self.n_keep = 0

    def advance(self, n: int) -> None:
        pass  # the batch keeps each row's length; `lengths` stay the forward's widths

    def kept(self, keep: mx.array) -> list[mx.array]:
        """The arrays after each row's first keep[r] positions (keep[r] >= 1): the conv window
        from the record, the state by the recurrence over those positions only."""
        from worker.kernels import gdn

        conv = mx.take_along_axis(self.conv_input, (keep[:, None] + mx.arange(self.n_keep)[None])[..., None], axis=1)
        q, k, v, beta, g, state = self.recurrence
        mask = mx.arange(q.shape[1])[None] < keep[:, None]
        return [conv, gdn.final_state(q, k, v, beta, g, state, mask)[1]]
