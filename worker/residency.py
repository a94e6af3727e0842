"""Idle unload (--idle-unload-s): the model leaves memory when nothing has run for a while and
comes back when a request arrives.

Unloading empties every weight array of the target (and the draft) in place, drops the batch's
slot caches and the in-memory prefix-reuse snapshots (spilled ones stay on disk), then returns
MLX's buffer cache and the C heap's free pages to the system. The modules themselves stay, so
every reference to them (the engine, reuse, an embedded draft on the target's embedding) stays
valid; reloading reads the weights again and sets them into the same modules. Requests that
arrive meanwhile are tokenized and queued as usual (the tokenizer stays): the MLX thread reloads
before it steps them, and their time to first token counts the load (docs/memory.md).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_map

from worker.loader import LoadedModel

log = logging.getLogger("verity.worker")

Loader = Callable[[], tuple[LoadedModel, Optional[LoadedModel]]]  # () -> (target, draft), read again


def empty_weights(model) -> None:
    """Replaces each of the module's arrays by an empty one of its dtype (the old ones are freed)."""
    model.update(tree_map(lambda a: mx.zeros((0,), a.dtype), model.parameters()))


def return_free_memory() -> None:
    """MLX's buffer cache, then the C heap's free pages (glibc keeps freed blocks under its
    adaptive mmap threshold, 32 MiB, in the heap until trimmed)."""
    gc.collect()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # a libc without malloc_trim (musl)
            pass


class Residency:
    """Whether the engine's weights are in memory, and the loads and unloads since the start."""

    def __init__(self, engine, load: Loader, idle_s: Optional[float], clock: Callable[[], float] = time.monotonic):
        self.engine, self.load, self.idle_s, self.clock = engine, load, idle_s, clock
        self.state = "loaded"
        self.busy_at = clock()  # the last time the engine had work
        self.loads = self.unloads = 0
        self.load_s_total = 0.0

    def busy(self) -> None:
        self.busy_at = self.clock()

    def tick(self) -> None:
        """On the MLX thread while idle: unloads once idle for idle_s."""
        if self.idle_s and self.state == "loaded" and self.clock() - self.busy_at >= self.idle_s:
            self.unload()

    def unload(self) -> None:
        t0 = time.perf_counter()
        self.engine.release_memory()
        return_free_memory()
        self.state = "unloaded"
        self.unloads += 1
        log.info("model unloaded after %.1fs idle (took %.2fs; MLX active %d MiB)",
                 self.clock() - self.busy_at, time.perf_counter() - t0, mx.get_active_memory() >> 20)

    def ensure_loaded(self) -> None:
        """On the MLX thread before a step: reloads an unloaded model."""
        self.busy()
        if self.state != "unloaded":
            return
        self.state = "loading"
        t0 = time.perf_counter()
        try:
            target, draft = self.load()
            self.engine.adopt_weights(target, draft)
        except BaseException:
            self.state = "unloaded"
            raise
        took = time.perf_counter() - t0
        self.state, self.loads, self.load_s_total = "loaded", self.loads + 1, self.load_s_total + took
        log.info("model reloaded in %.2fs", took)

    def fields(self) -> dict:
        """The residency fields of the worker's StatsSnapshot."""
        return dict(model_state=self.state, model_loads_total=self.loads, model_unloads_total=self.unloads,
                    model_load_s_total=round(self.load_s_total, 3))
