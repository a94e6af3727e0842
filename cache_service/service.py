"""run_cache_service: the ROUTER the worker's CacheClient talks to, READY to launch-stack, stop on
SIGTERM or when the parent dies. It holds metadata only; losing it loses no arrays (the worker
re-registers what it holds when it meets a new service)."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
import time

import zmq

from cache_service.index import SnapshotIndex
from protocol import codec, messages as m, runtime

log = logging.getLogger("verity.cache")
POLL_MS = 200


class CacheService:
    def __init__(self, budget: int):
        self.index = SnapshotIndex(budget)
        self.id = f"{os.getpid()}-{secrets.token_hex(4)}"

    def handle(self, msg) -> m.CacheReply:
        now, index = time.time(), self.index
        reply = m.CacheReply(msg.seq, self.id, index.stats)
        if isinstance(msg, m.CacheSync):
            reply.evict = index.sync(msg.entries, now)
            log.info("synced with the worker: %d entries, %d bytes (%d over the budget dropped)",
                     index.stats.entries, index.stats.bytes, len(reply.evict))
        elif msg.service_id != self.id:
            reply.resync = True
        elif isinstance(msg, m.CacheLookup):
            reply.hit = index.lookup(msg.identity, msg.tokens, msg.trimmable, now, msg.draft)
        elif isinstance(msg, m.CacheStore):
            reply.granted, reply.evict = index.store(msg.entry, msg.trimmable, now)
        elif isinstance(msg, m.CacheDrop):
            index.drop(msg.ids)
        return reply


def serve(runtime_dir: str, budget: int, stopping: threading.Event) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(runtime.endpoint(runtime_dir, runtime.CACHE))
    service, dec = CacheService(budget), codec.cache_request_decoder()
    sup = ctx.socket(zmq.PUSH)
    sup.setsockopt(zmq.LINGER, 2000)
    sup.connect(runtime.endpoint(runtime_dir, runtime.SUPERVISOR))
    sup.send(codec.encode(m.Ready(process="cache", pid=os.getpid())))
    sup.close()
    log.info("cache service %d ready: budget %d bytes", os.getpid(), budget)
    while not stopping.is_set():
        if not sock.poll(POLL_MS):
            continue
        peer, data = sock.recv_multipart()
        try:
            msg = dec.decode(data)
        except codec.DecodeError as e:
            log.error("dropped an undecodable request: %s", e)
            continue
        sock.send_multipart([peer, codec.encode(service.handle(msg))])
    ctx.destroy(linger=0)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verity-cache")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--cache-bytes", type=int, required=True, help="the byte budget of all snapshots")
    return p.parse_args(argv)


def run_cache_service(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cache %(levelname)s %(message)s")
    stopping = threading.Event()
    runtime.watch_parent(stopping.set)
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    return serve(args.runtime_dir, args.cache_bytes, stopping)
