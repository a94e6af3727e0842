"""CacheClient: the worker's side of the cache socket (DEALER -> the cache service's ROUTER).

Used from the MLX thread only. Every call is short: when the service is not connected the call
returns at once (ZMQ_IMMEDIATE: nothing is queued for a peer that is not there), and a connected
service that does not answer within the call's timeout is left alone for RETRY_AFTER_S. Either
way the worker serves without reuse meanwhile and keeps no new snapshot (it may keep one only
when the service says so).

Resync: on first contact with a service (at start, or after the service restarted, which it
learns from a `resync` answer) the worker re-registers everything it still holds with a
CacheSync; the service answers what to drop to fit its budget. Nothing held is thrown away just
because the service restarted.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Optional, Protocol

import zmq

from protocol import codec, messages as m
from worker.state.snapshots import SnapshotStore

log = logging.getLogger("verity.worker")
LOOKUP_TIMEOUT_S = 0.5
STORE_TIMEOUT_S = 0.5
SYNC_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0  # at start, how long to wait for the connection to the service
RETRY_AFTER_S = 2.0  # after a timeout; a service that is merely absent costs nothing to ask
HEARTBEAT_S = 1.0  # when idle, ask for stats this often (keeps them fresh, notices a new service)


class ReuseClient(Protocol):
    """What prefix reuse asks of its cache client: this worker's CacheClient, or a distributed
    group's rank-0 and follower clients (worker/distributed/reuse.py), which must answer alike."""

    stats: Optional[m.CacheStats]

    def lookup(self, identity: str, tokens: list[int], trimmable: bool, draft: bool = False) -> Optional[m.CacheHit]: ...

    def store(self, entry: m.SnapshotMeta, trimmable: bool) -> Optional[list[str]]: ...

    def drop(self, ids: list[str]) -> None: ...

    def heartbeat(self) -> None: ...

    def close(self) -> None: ...


class CacheClient:
    def __init__(self, endpoint: str, store: SnapshotStore):
        self.snapshots = store  # what this worker holds (re-registered on resync)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        for opt, value in ((zmq.IMMEDIATE, 1), (zmq.LINGER, 0), (zmq.RECONNECT_IVL, 50)):
            self.sock.setsockopt(opt, value)
        self.sock.connect(endpoint)
        self.sock.poll(int(CONNECT_TIMEOUT_S * 1000), zmq.POLLOUT)  # ipc connects in the background
        self.dec = codec.cache_reply_decoder()
        self.service_id: Optional[str] = None  # the service this worker is synced with
        self.stats: Optional[m.CacheStats] = None  # as of the last answer; None: no service
        self._seq = itertools.count(1)
        self._quiet_until = 0.0
        self._last_contact = 0.0

    # ---- the calls ----

    def lookup(self, identity: str, tokens: list[int], trimmable: bool, draft: bool = False) -> Optional[m.CacheHit]:
        """`draft`: a joint request's (see `CacheLookup`)."""
        reply = self._call(lambda seq, sid: m.CacheLookup(seq, sid, identity, tokens, trimmable, draft), LOOKUP_TIMEOUT_S)
        return reply.hit if reply else None

    def store(self, entry: m.SnapshotMeta, trimmable: bool) -> Optional[list[str]]:
        """The ids to drop before keeping `entry`; None: do not keep it."""
        reply = self._call(lambda seq, sid: m.CacheStore(seq, sid, entry, trimmable), STORE_TIMEOUT_S)
        return reply.evict if reply and reply.granted else None

    def drop(self, ids: list[str]) -> None:
        self._call(lambda seq, sid: m.CacheDrop(seq, sid, ids), STORE_TIMEOUT_S)

    def heartbeat(self) -> None:
        """Called when idle: stats, and a prompt resync with a restarted service."""
        if time.monotonic() - self._last_contact >= HEARTBEAT_S:
            self._call(lambda seq, sid: m.CacheStatsRequest(seq, sid), STORE_TIMEOUT_S)

    def close(self) -> None:
        self.sock.close(linger=0)

    # ---- plumbing ----

    def _call(self, make, timeout: float) -> Optional[m.CacheReply]:
        for _ in range(2):  # a `resync` answer: sync, then ask once more
            if self.service_id is None and not self._sync():
                return None
            reply = self._request(make(next(self._seq), self.service_id), timeout)
            if reply is None or not reply.resync:
                return reply
            log.info("the cache service restarted (%s): resyncing", reply.service_id)
            self.service_id = None
        return None

    def _sync(self) -> bool:
        metas = self.snapshots.metas()
        reply = self._request(m.CacheSync(next(self._seq), metas), SYNC_TIMEOUT_S)
        if reply is None:
            return False
        self.snapshots.drop(reply.evict)
        self.service_id = reply.service_id
        log.info("synced with cache service %s: registered %d snapshots, dropped %d over its budget",
                 reply.service_id, len(metas) - len(reply.evict), len(reply.evict))
        return True

    def _request(self, msg, timeout: float) -> Optional[m.CacheReply]:
        now = time.monotonic()
        if now < self._quiet_until or not self.sock.poll(0, zmq.POLLOUT):
            return self._down()
        try:
            self.sock.send(codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the connection went between the poll and the send
            return self._down()
        deadline = now + timeout
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
            try:
                reply = self.dec.decode(self.sock.recv())
            except codec.DecodeError as e:
                log.error("dropped an undecodable cache reply: %s", e)
                continue
            if reply.seq == msg.seq:  # anything else is a late answer to a request that timed out
                self.stats, self._last_contact = reply.stats, time.monotonic()
                return reply
        log.warning("the cache service did not answer within %.1fs; serving without reuse for %.0fs",
                    timeout, RETRY_AFTER_S)
        self._quiet_until = time.monotonic() + RETRY_AFTER_S
        return self._down()

    def _down(self) -> None:
        if self.service_id is not None:
            log.warning("the cache service is gone; serving without reuse until it is back")
        self.service_id, self.stats = None, None
        return None
