"""The cache service's table: snapshot metadata, longest-verified-prefix lookup, the byte budget.

Pure Python (no sockets, no MLX), so the policy is tested directly. `now` is time.time().

Eviction: the entry idle longest goes first, where a message-boundary snapshot's idle time counts
half (BOUNDARY_IDLE_WEIGHT): boundaries are kept about twice as long as end-of-generation
snapshots, and a fresh end-of-generation snapshot still outlives a stale boundary.
The budget holds at every moment: an entry is added only after the victims that make room for it
are out of the table, and the worker drops them before it keeps the new one.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterable, Optional

from protocol import messages as m

BOUNDARY_IDLE_WEIGHT = 0.5


def _packed(tokens: Iterable[int]) -> bytes:
    return array("I", tokens).tobytes()


def common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two packed sequences share at their start (binary search over memcmp)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Entry:
    meta: m.SnapshotMeta
    packed: bytes
    boundary: bool  # kept like a message boundary: it is one, or it replaced one (trimmable)

    @property
    def length(self) -> int:
        return len(self.packed) // 4


class SnapshotIndex:
    def __init__(self, budget: int):
        self.budget = budget
        self.entries: dict[str, _Entry] = {}
        self.bytes = 0
        self.stats = m.CacheStats(budget=budget)

    # ---- lookup ----

    def lookup(self, identity: str, tokens: list[int], trimmable: bool, now: float,
               draft: bool = False) -> Optional[m.CacheHit]:
        """The snapshot giving the most tokens of `tokens` (never all: one is left to prefill).

        An entry counts when its tokens are a prefix of the request's; under `trimmable` a longer
        entry counts too, cut back to the common prefix. Equal lengths go (under `draft`, a joint
        request's) to the entry whose draft state gives most, then to the untrimmed entry, then
        to the most recently used."""
        self.stats.lookups += 1
        want, limit = _packed(tokens), len(tokens) - 1
        best, best_key = None, None
        for e in self.entries.values():
            if e.meta.identity != identity:
                continue
            shared = common_prefix(e.packed, want)
            exact = shared == e.length
            usable = e.length if exact and e.length <= limit else min(shared, limit) if trimmable else 0
            key = (usable, _draft_gives(e, usable, trimmable) if draft else 0, exact and usable == e.length,
                   e.meta.last_use)
            if usable > 0 and (best_key is None or key > best_key):
                best, best_key = e, key
        if best is None:
            return None
        best.meta.last_use = now
        s = self.stats
        s.hits += 1
        s.generation_hits += best.meta.kind == "generation"
        s.reused_tokens += best_key[0]
        return m.CacheHit(best.meta.id, best_key[0])

    # ---- changes ----

    def store(self, meta: m.SnapshotMeta, trimmable: bool, now: float) -> tuple[bool, list[str]]:
        """(granted, ids to drop first). Refused: larger than the budget, already held with as much
        of the draft's state (held with less, the new one replaces it), or (under `trimmable`) a
        prefix of an entry that already gives it and its draft's state. Granted under `trimmable`, it
        replaces the entries that are its prefixes (and stands for their boundaries)."""
        if meta.nbytes > self.budget:
            return False, []
        held = self.entries.get(meta.id)
        if held is not None and held.meta.draft_tokens >= meta.draft_tokens:
            held.meta.last_use = now
            return False, []
        new = _Entry(meta, _packed(meta.tokens), meta.kind == "boundary")
        absorbed = [meta.id] if held is not None else []  # held with less of the draft's state: replaced
        for e in self.entries.values():
            if trimmable and e.meta.identity == meta.identity and e is not held:
                shared = common_prefix(e.packed, new.packed)
                covers = e.meta.draft_tokens >= meta.draft_tokens
                if shared == new.length and covers:  # an entry already covers it, its draft's state too
                    return False, []
                if shared == e.length and meta.draft_tokens >= e.meta.draft_tokens:
                    absorbed.append(e.meta.id)
        new.boundary = new.boundary or any(self.entries[i].boundary for i in absorbed)
        for i in absorbed:
            self._remove(i)
        meta.last_use = now
        evicted = self._fit(meta.nbytes, now)
        self.entries[meta.id] = new
        self.bytes += meta.nbytes
        self._count()
        return True, absorbed + evicted

    def drop(self, ids: Iterable[str]) -> None:
        for i in ids:
            if i in self.entries:
                self._remove(i)
        self._count()

    def sync(self, metas: Iterable[m.SnapshotMeta], now: float) -> list[str]:
        """Replaces the table with what the worker holds; returns the ids over the budget."""
        self.entries, self.bytes = {}, 0
        over = []
        for meta in sorted(metas, key=lambda x: x.last_use):
            if meta.id in self.entries:
                continue
            if meta.nbytes > self.budget:
                over.append(meta.id)
                continue
            self.entries[meta.id] = _Entry(meta, _packed(meta.tokens), meta.kind == "boundary")
            self.bytes += meta.nbytes
        over += self._fit(0, now)
        self._count()
        return over

    # ---- the budget ----

    def _fit(self, extra: int, now: float) -> list[str]:
        """Evicts until `extra` more bytes fit; returns the victims."""
        victims = []
        while self.bytes + extra > self.budget:
            v = max(self.entries.values(), key=lambda e: (self._idle(e, now), -e.meta.last_use, e.meta.id))
            self._remove(v.meta.id)
            victims.append(v.meta.id)
        self.stats.evictions += len(victims)
        return victims

    @staticmethod
    def _idle(e: _Entry, now: float) -> float:
        idle = now - e.meta.last_use
        return idle * BOUNDARY_IDLE_WEIGHT if e.boundary else idle

    def _remove(self, entry_id: str) -> None:
        self.bytes -= self.entries.pop(entry_id).meta.nbytes

    def _count(self) -> None:
        self.stats.bytes, self.stats.entries = self.bytes, len(self.entries)
        assert self.bytes <= self.budget, (self.bytes, self.budget)


def _draft_gives(e: _Entry, usable: int, trimmable: bool) -> int:
    """Tokens of a hit of `usable` tokens the entry's draft state gives: one that lags is used as
    it is; a longer one only cut back (`trimmable`)."""
    if e.meta.draft_tokens <= usable:
        return e.meta.draft_tokens
    return usable if trimmable else 0
