"""What rank 0 tells the other ranks each step, carried by MLX collectives, and the watchdog
that takes a rank down when its group stops making progress."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from typing import Optional

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.generate import generation_stream

from protocol import messages as m

log = logging.getLogger("verity.worker")
HEAD_BYTES = 1024  # one all_sum carries a message up to this size; a longer one takes a second
EXIT_STALLED = 4


class Submitted(msgspec.Struct, array_like=True):
    """A request rank 0 queued since the last step, with the seed every rank samples it with."""

    request_id: str
    request: m.GenerateRequest
    prompt: list[int]


class StepInput(msgspec.Struct, tag="step", array_like=True):
    """Everything of a step that depends on time, decided once on rank 0."""

    submitted: list[Submitted] = []
    cancels: list[str] = []
    drafting: bool = False  # the scheduler's state that admission reads (a lone plain request goes first)
    digest: int = 0  # rank 0's tokens and ends of the previous step (a follower checks its own)
    idle: bool = False  # a heartbeat: no step follows
    reuse: bool = False  # prefix reuse is on (it is turned on after the warm-up)
    stop: bool = False


class RoundBudgets(msgspec.Struct, tag="plan", array_like=True):
    """The scheduler's draft length for each joint request of a round."""

    budgets: dict[str, int]


class ReuseAnswer(msgspec.Struct, tag="reuse", array_like=True):
    """The cache service's answer to rank 0, for the other ranks' snapshot stores."""

    hit: Optional[m.CacheHit] = None
    evict: Optional[list[str]] = None


Message = StepInput | RoundBudgets | ReuseAnswer
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class GroupBroken(RuntimeError):
    """A collective failed (a rank is gone): the group cannot go on."""


class Diverged(GroupBroken):
    """A rank computed something else than rank 0: the group cannot go on."""


BACKEND_ERRORS = ("[ring]", "[jaccl]", "[nccl]", "[mpi]", "[distributed]")


def broken_group(exc: BaseException) -> bool:
    """An error of the distributed backend (a deterministic one fails the request on every rank alike)."""
    return isinstance(exc, GroupBroken) or str(exc).startswith(BACKEND_ERRORS)


class LinkStats(msgspec.Struct):
    messages: int = 0
    collectives: int = 0
    bytes: int = 0  # buffer bytes all-summed (each crosses every link of the ring about twice)
    seconds: float = 0.0


class Link:
    """Rank 0's messages on every rank: an all_sum of a byte buffer that only rank 0 fills."""

    def __init__(self, group: mx.distributed.Group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.progress = time.monotonic()  # the last time the group moved (the watchdog reads it)
        self.stats = LinkStats()

    def send(self, msg: Message) -> None:
        assert self.rank == 0
        self._share(_encoder.encode(msg))

    def receive(self) -> Message:
        assert self.rank != 0
        return _decoder.decode(self._share(b""))

    def moved(self) -> None:
        self.progress = time.monotonic()

    def _share(self, payload: bytes) -> bytes:
        t0 = time.perf_counter()
        head = bytearray(HEAD_BYTES)
        struct.pack_into("<I", head, 0, len(payload))
        head[4 : 4 + min(len(payload), HEAD_BYTES - 4)] = payload[: HEAD_BYTES - 4]
        got = self._sum(head)
        n = struct.unpack_from("<I", got)[0]
        body = got[4 : 4 + min(n, HEAD_BYTES - 4)]
        if n > HEAD_BYTES - 4:
            rest = payload[HEAD_BYTES - 4 :] if self.rank == 0 else bytes(n - (HEAD_BYTES - 4))
            body += self._sum(rest)
        self.stats.messages += 1
        self.stats.seconds += time.perf_counter() - t0
        self.moved()
        return body

    def _sum(self, buf: bytes | bytearray) -> bytes:
        # the model's stream: collectives of one stream run in the order every rank issues them
        x = mx.distributed.all_sum(mx.array(np.frombuffer(bytes(buf), np.uint8)), group=self.group,
                                   stream=generation_stream)
        out = bytes(np.array(x, copy=False))
        self.stats.collectives += 1
        self.stats.bytes += len(buf)
        return out


def digest(events: list) -> int:
    """A checksum of a step's tokens and request ends, as every rank emits them."""
    parts = []
    for ev in events:
        if isinstance(ev, m.TextDelta):
            parts.append(f"{ev.request_id}:{','.join(map(str, ev.token_ids))}")
        elif isinstance(ev, (m.Finished, m.Error)):
            parts.append(f"{ev.request_id}!{type(ev).__name__}")
    return zlib.crc32(";".join(parts).encode()) if parts else 0


class Watchdog:
    """Exits the process when the group has not moved for `bound_s` (a stalled or lost rank)."""

    def __init__(self, link: Link, bound_s: float):
        self.link, self.bound_s = link, bound_s
        self.thread: Optional[threading.Thread] = None

    def start(self) -> "Watchdog":
        if self.bound_s > 0:
            self.thread = threading.Thread(target=self._run, name="rank-watchdog", daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.bound_s / 4))
            quiet = time.monotonic() - self.link.progress
            if quiet > self.bound_s:
                log.error("rank %d: the group made no progress for %.0fs (a rank stalled or is gone); exiting",
                          self.link.rank, quiet)
                os._exit(EXIT_STALLED)
