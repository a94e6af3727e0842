"""A rank of a distributed worker group: `python -m worker --shard tensor ...` with MLX's
environment (MLX_RANK, MLX_HOSTFILE, ...) as launch-stack sets it. Rank 0 is the worker the
stack knows (worker/proc.py's WorkerProc around a LeaderEngine); the other ranks follow it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from typing import Optional

import mlx.core as mx
import msgspec
import numpy as np

from protocol import messages as m, runtime
from worker.distributed.link import GroupBroken, Link, Watchdog
from worker.distributed.lockstep import FollowerEngine, LeaderEngine
from worker.distributed.shard import ShardError, shard_model
from worker.cache_client import CacheClient
from worker.distributed.reuse import FollowerClient, LeaderClient
from worker.engine import cache_identity
from worker.loader import PairingError, load_draft, load_model
from worker.state.reuse import PrefixCache
from worker.state.snapshots import SnapshotStore

log = logging.getLogger("verity.worker")
INFO_BYTES = 256
RANK_TIMEOUT_S = 60.0  # a step, or rank 0's idle heartbeat, must come within this


class RankInfo(msgspec.Struct, array_like=True):
    rank: int
    pid: int
    host: str
    kv_budget: int


def requested(argv: list[str]) -> bool:
    return any(a == "--shard" or a.startswith("--shard=") for a in argv)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    from worker.proc import parse_args as worker_args

    p = argparse.ArgumentParser(prog="verity-worker", add_help=False)
    p.add_argument("--shard", choices=("tensor", "pipeline"), required=True)
    p.add_argument("--backend", default="any", choices=("any", "ring", "jaccl", "nccl", "mpi"))
    p.add_argument("--rank-timeout-s", type=float, default=RANK_TIMEOUT_S)
    ours, rest = p.parse_known_args(argv)
    return ours, worker_args(rest)


def gather(group: mx.distributed.Group, mine: RankInfo) -> list[RankInfo]:
    """Every rank's RankInfo, in rank order, on every rank."""
    data = msgspec.msgpack.encode(mine)
    buf = np.zeros(INFO_BYTES, np.uint8)
    buf[0], buf[1 : 1 + len(data)] = len(data), np.frombuffer(data, np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(buf), group=group, stream=mx.cpu)).reshape(-1, INFO_BYTES)
    return [msgspec.msgpack.decode(bytes(r[1 : 1 + r[0]]), type=RankInfo) for r in rows]


def run_rank(argv: list[str]) -> int:
    from worker.proc import build_engine

    ours, args = parse_args(argv)
    group = mx.distributed.init(strict=True, backend=ours.backend)
    rank = group.rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker rank {rank} %(levelname)s %(message)s")
    runtime.watch_parent(lambda: os._exit(1))
    log.info("rank %d of %d (%s backend, %s sharding)", rank, group.size(), ours.backend, ours.shard)
    try:
        lm = load_model(args.model, shard=lambda model: shard_model(model, group, ours.shard))
        draft = load_draft(args.draft, lm) if args.draft else None  # whole on every rank (design.md)
    except (ShardError, PairingError) as e:
        log.error("cannot serve %s as a group: %s", args.model, e)
        return 3
    link = Link(group)
    kind = LeaderEngine if rank == 0 else FollowerEngine
    try:
        engine = build_engine(args, lm, draft, lambda lm, config, draft: kind(lm, config, draft, link),
                              log_decisions=rank == 0)
    except ValueError as e:  # a KV format the flags or the model refuse
        log.error("%s", e)
        return 3
    engine.runner.cost.bound = None  # ranks timing their own chunks would feed different ones: --prefill-step
    ranks = gather(group, RankInfo(rank, os.getpid(), socket.gethostname(), engine.kv_budget))
    engine.kv_budget = min(r.kv_budget for r in ranks)  # admission must be the same on every rank
    Watchdog(link, ours.rank_timeout_s).start()
    reuse = _prefix_cache(args, lm, draft, engine, link) if args.prefix_cache else None
    try:
        if rank == 0:
            return _lead(engine, lm, args, ranks, reuse)
        engine.prefix_cache = reuse
        engine.warm_forwards()  # as rank 0's warm-up starts
        return engine.run()
    except (GroupBroken, RuntimeError) as e:
        log.error("rank %d: the group broke: %s", rank, e)
        return 1


def _prefix_cache(args: argparse.Namespace, lm, draft, engine, link: Link) -> Optional[PrefixCache]:
    """This rank's snapshots (rank 0's answers from the cache service reach every rank)."""
    if not all(PrefixCache.supports(x.model) for x in (lm, draft) if x is not None):
        log.warning("this model's cache cannot be snapshotted: serving without prefix reuse")
        return None
    if args.cache_dir:
        log.warning("a group keeps its snapshots in memory: --cache-dir is not used")
    store = SnapshotStore(None)
    identity = cache_identity(lm, engine.draft_id, engine.config.kv)
    if link.rank:
        return PrefixCache(identity, lm, draft.model if draft else None, FollowerClient(link), store)
    client = LeaderClient(CacheClient(runtime.endpoint(args.runtime_dir, runtime.CACHE), store), link)
    reuse = PrefixCache(identity, lm, draft.model if draft else None, client, store)
    reuse.heartbeat()
    return reuse


def _lead(engine: LeaderEngine, lm, args: argparse.Namespace, ranks: list[RankInfo],
          reuse: Optional[PrefixCache]) -> int:
    from worker.proc import WorkerProc

    for r in ranks:
        log.info("rank %d: pid %d on %s", r.rank, r.pid, r.host)
    engine.ranks = [m.RankStatus(r.rank, r.pid, r.host) for r in ranks]
    engine.warmup()
    engine.reuse = reuse  # every rank's from the next step on (StepInput.reuse)
    proc = WorkerProc(engine, lm, args.runtime_dir)
    signal.signal(signal.SIGTERM, lambda *_: proc.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: proc.stopping.set())
    code = proc.run()
    engine.stop_followers()
    return code
