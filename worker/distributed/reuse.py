"""Prefix reuse in a distributed group: every rank keeps its own shard's snapshots, in memory.
Rank 0 asks the cache service which snapshot to restore and what to evict, and passes each
answer to the other ranks, so every rank restores, keeps and drops the same snapshots in the same
step. Snapshots are not spilled to files in a group (a restarted rank would hold none)."""

from __future__ import annotations

from typing import Optional

from protocol import messages as m
from worker.cache_client import CacheClient
from worker.distributed.link import Diverged, Link, ReuseAnswer


class LeaderClient:
    """Rank 0's cache-service client: each lookup's and store's answer also goes to the others."""

    def __init__(self, inner: CacheClient, link: Link):
        self.inner, self.link = inner, link

    def lookup(self, identity: str, tokens: list[int], trimmable: bool, draft: bool = False) -> Optional[m.CacheHit]:
        hit = None
        try:
            hit = self.inner.lookup(identity, tokens, trimmable, draft)
        finally:
            self.link.send(ReuseAnswer(hit=hit))
        return hit

    def store(self, entry: m.SnapshotMeta, trimmable: bool) -> Optional[list[str]]:
        evict = None
        try:
            evict = self.inner.store(entry, trimmable)
        finally:
            self.link.send(ReuseAnswer(evict=evict))
        return evict

    def __getattr__(self, name):  # drop, heartbeat, stats, close: rank 0's own
        return getattr(self.inner, name)


class FollowerClient:
    """The other ranks' client: rank 0's answers, received."""

    stats = None

    def __init__(self, link: Link):
        self.link = link

    def lookup(self, identity: str, tokens: list[int], trimmable: bool, draft: bool = False) -> Optional[m.CacheHit]:
        return self._answer().hit

    def store(self, entry: m.SnapshotMeta, trimmable: bool) -> Optional[list[str]]:
        return self._answer().evict

    def drop(self, ids: list[str]) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _answer(self) -> ReuseAnswer:
        msg = self.link.receive()
        if not isinstance(msg, ReuseAnswer):
            raise Diverged(f"rank {self.link.rank}: a {type(msg).__name__} came where rank 0's cache answer was due")
        return msg
