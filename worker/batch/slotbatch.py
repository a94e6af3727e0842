"""One model's slot caches and its forwards over contiguous rows of them (worker/batch/slots.py).

Rows are identified by the caller's ids; `arrange` says in which order they should sit, and the
next forward moves what changed (a joining row's restored caches written into its slot, a
leaving row's slot taken by another row): membership changes cost copies of the rows that move,
never of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from worker.batch.slots import Rolling, SlotArrays, SlotKV, Span, StateView
from worker.kvformat import NATIVE, KVFormat

Forward = Callable[[mx.array, list], mx.array]  # (tokens [B, W], caches) -> logits [B, W, V]


class UnsupportedCache(ValueError):
    """The model keeps a kind of cache the slots cannot hold."""


def slot_layers(model, kv: KVFormat = NATIVE) -> list:
    """A slot cache for each of the model's cache layers, by mlx-lm's own `make_prompt_cache`;
    attention layers keep their keys and values in format `kv`."""
    out = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            out.append(SlotKV(fmt=kv))
        elif isinstance(c, RotatingKVCache) and c.keep == 0:
            out.append(SlotKV(window=c.max_size, fmt=kv))
        elif isinstance(c, ArraysCache):
            out.append(SlotArrays(len(c.cache)))
        else:
            raise UnsupportedCache(f"the batch cannot hold a {type(c).__name__} (a model with such caches is not served)")
    return out


@dataclass
class Forwarded:
    """A forward as it ran: its rows, their inputs and each layer's view (what it recorded)."""

    ids: list[str]
    span: Span
    tokens: mx.array
    views: list
    before: list  # the recurrent layers' arrays of these rows before it (a replay starts there)
    logits: mx.array
    recorded: bool


class SlotBatch:
    def __init__(self, model, forward: Optional[Forward] = None, kv: KVFormat = NATIVE, one_token_rows: bool = False):
        """`one_token_rows`: `forward` runs many rows cheaply only one token a row (a draft's rows
        kernels), so wider steps of many rows are best fed a token at a time."""
        self.model, self.kv, self.one_token_rows = model, kv, one_token_rows
        self.run = forward or (lambda tokens, cache: model(tokens, cache=cache))
        self.layers = slot_layers(model, kv)
        self.lengths: dict[str, int] = {}  # tokens each row's caches hold
        self.order: list[str] = []  # rows by slot, as wanted
        self._held: list[str] = []  # rows by slot, as the arrays hold them
        self._fresh: dict[str, Optional[list]] = {}  # joining rows' starting caches (None: empty)
        self.rolling: dict[str, Rolling] = {}  # rows that decode past the context over a window

    # ---- membership ----

    def add(self, rid: str, cache: Optional[list] = None, length: int = 0, rolling: Optional[Rolling] = None) -> None:
        """A row joins at the end, from mlx-lm caches holding `length` tokens (None: empty)."""
        if rid in self.lengths:
            raise ValueError(f"row {rid} is in the batch already")
        if rolling is not None:
            self.rolling[rid] = rolling
        self.lengths[rid] = length if cache is not None else 0
        self.order.append(rid)
        self._fresh[rid] = cache

    def remove(self, rid: str) -> None:
        if self.lengths.pop(rid, None) is None:
            return
        self.rolling.pop(rid, None)
        self.order.remove(rid)
        self._fresh.pop(rid, None)

    def arrange(self, first: set[str]) -> list[str]:
        """Puts the rows in `first` in the leading slots and the others after them, moving only
        rows outside their part (into the slots of rows that left or moved); returns the rows of
        `first` in slot order."""
        n_first = len([r for r in self.order if r in first])
        held = self._held + [None] * max(0, len(self.order) - len(self._held))
        slots: list[Optional[str]] = [None] * len(self.order)
        for i, rid in enumerate(held[: len(self.order)]):
            if rid in self.lengths and rid not in self._fresh and (rid in first) == (i < n_first):
                slots[i] = rid
        placed = set(slots)
        for part, lo, hi in ((True, 0, n_first), (False, n_first, len(self.order))):
            rest = iter([r for r in self.order if (r in first) == part and r not in placed])
            for i in range(lo, hi):
                if slots[i] is None:
                    slots[i] = next(rest)
        self.order = slots
        return slots[:n_first]

    def __contains__(self, rid: str) -> bool:
        return rid in self.lengths

    def __len__(self) -> int:
        return len(self.order)

    def settle(self) -> None:
        """Moves rows to the slots `order` gives them."""
        if self.order == self._held and not self._fresh:
            return
        where = {rid: i for i, rid in enumerate(self._held)}
        order = [where.get(rid, -1) if rid not in self._fresh else -1 for rid in self.order]
        moves = [(i, src) for i, src in enumerate(order) if src >= 0 and src != i]
        fresh = {i: self._fresh[rid] for i, rid in enumerate(self.order) if rid in self._fresh}
        for e, layer in enumerate(self.layers):
            if isinstance(layer, SlotKV):
                layer.move_rows(moves, len(self.order))
                for i, cache in fresh.items():
                    if cache is not None:
                        layer.put(i, cache[e], self.lengths[self.order[i]])
            else:
                layer.apply(order, {i: _arrays(c, e) for i, c in fresh.items()})
        self._held, self._fresh = list(self.order), {}

    # ---- forwards ----

    def forward(self, ids: list[str], tokens: mx.array, widths: list[int], record: bool = False,
                offsets: Optional[list[int]] = None) -> Forwarded:
        """One forward of these rows (contiguous slots, in order): tokens [B, W] right-padded,
        widths[i] real; `offsets`: where each row writes (default: its length)."""
        rows = self.span(ids)
        lengths = tuple(offsets) if offsets is not None else rows.lengths
        span = Span(rows.start, rows.stop, lengths, tuple(widths))
        pos = mx.array(span.lengths)
        masks = None if min(widths) == tokens.shape[1] else mx.array(widths)  # padded rows keep their state
        views, before = [], []
        rolling = [self.rolling.get(r) for r in ids] if self.rolling else None
        for layer in self.layers:
            if isinstance(layer, SlotKV):
                views.append(layer.view(span, pos, rolling if layer.window is None else None, tokens.shape[1]))
            else:
                rows = layer.rows(span)
                before.append(rows)
                views.append(StateView(rows, masks, record))
        logits = self.run(tokens, views)
        return Forwarded(list(ids), span, tokens, views, before, logits, record)

    def commit(self, f: Forwarded, keep: list[int]) -> None:
        """Each row keeps its first keep[i] positions of the forward (at most its width): lengths
        move on, recurrent layers take the state after them (recorded, or replayed)."""
        partial = [k < w for k, w in zip(keep, f.span.widths)]
        if any(partial) and not f.recorded:
            self._take_arrays(f, None)
            self._replay(f, keep, partial)
        else:
            self._take_arrays(f, mx.array([max(1, k) for k in keep]) if f.recorded else None)
        for rid, k, n in zip(f.ids, keep, f.span.lengths):
            self.lengths[rid] = n + k

    def _take_arrays(self, f: Forwarded, keep: Optional[mx.array]) -> None:
        views = [v for v in f.views if isinstance(v, StateView)]
        layers = [layer for layer in self.layers if isinstance(layer, SlotArrays)]
        for layer, view in zip(layers, views):
            arrays = view.kept(keep) if keep is not None else list(view.cache)
            layer.set_rows(f.span, arrays, len(self.order))

    def _replay(self, f: Forwarded, keep: list[int], partial: list[bool]) -> None:
        """Rows that kept fewer positions than they fed go back to their state before the
        forward and feed the kept ones again (the others write past their new lengths, unseen)."""
        layers = [layer for layer in self.layers if isinstance(layer, SlotArrays)]
        if layers:
            rows = mx.array(partial)
            for layer, old in zip(layers, f.before):
                now = layer.rows(f.span)
                mixed = [n if n is None else mx.where(_expand(rows, n), mx.zeros_like(n) if o is None else o, n)
                         for o, n in zip(old, now)]  # None before: the state before any token
                layer.set_rows(f.span, mixed, len(self.order))
        widths = [k if p else 0 for k, p in zip(keep, partial)]
        offsets = [n if p else n + w for n, p, w in zip(f.span.lengths, partial, f.span.widths)]
        again = self.forward(f.ids, f.tokens[:, : max(1, max(widths))], widths, offsets=offsets)
        self._take_arrays(again, None)

    def span(self, ids: list[str]) -> Span:
        """The slots of these rows (contiguous, in order), with their lengths."""
        self.settle()
        start = self.order.index(ids[0])
        if self.order[start: start + len(ids)] != ids:
            raise ValueError("rows must sit in contiguous slots, in order")
        return Span(start, start + len(ids), tuple(self.lengths[r] for r in ids), ())

    def recurrent_rows(self, span: Span) -> list[list]:
        """Each recurrent layer's arrays of the span's rows (references)."""
        return [layer.rows(span) for layer in self.layers if isinstance(layer, SlotArrays)]

    def put_recurrent(self, ids: list[str], arrays: list[list]) -> None:
        """Sets the recurrent layers' arrays of these rows (contiguous slots, in order)."""
        span = self.span(ids)
        layers = [layer for layer in self.layers if isinstance(layer, SlotArrays)]
        for layer, a in zip(layers, arrays):
            layer.set_rows(span, a, len(self.order))

    # ---- rows as mlx-lm caches (snapshots) ----

    def row_cache(self, rid: str) -> list:
        """A copy of a row's state as mlx-lm caches (KVCache or QuantizedKVCache, ArraysCache)
        holding its length, read where the row sits: no row moves for a copy."""
        slot, n = self._slot_now(rid), self.lengths[rid]
        out = []
        for layer in self.layers:
            if isinstance(layer, SlotKV):
                out.append(layer.row(slot, n))
            else:
                c = ArraysCache(len(layer.arrays))
                c.cache = [None if a is None else mx.array(a) for a in layer.row(slot)]
                out.append(c)
        return out

    def _slot_now(self, rid: str) -> int:
        """The slot a row's state is in now; a joining row's is placed first. Rows leaving one by
        one move the rows after them only at the next forward, once (16 rows snapshotted and
        leaving in turn took 2.2 s, each copy moving the slab, against 0.05 s)."""
        if rid in self._fresh or rid not in self._held:
            self.settle()
            return self.order.index(rid)
        return self._held.index(rid)

    def arrays(self) -> list[mx.array]:
        """Every array of the batch's state (to evaluate it)."""
        out = []
        for layer in self.layers:
            if isinstance(layer, SlotKV):
                out += layer.parts()
            else:
                out += [a for a in layer.arrays if a is not None]
        return out

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def _arrays(cache: Optional[list], i: int) -> Optional[list]:
    if cache is None:
        return None
    c = cache[i]
    return list(c.cache) if isinstance(c, ArraysCache) else None


def _expand(rows: mx.array, like: mx.array) -> mx.array:
    return rows.reshape((-1,) + (1,) * (like.ndim - 1))
