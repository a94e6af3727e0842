"""The BLAS's thread count by phase, where MLX runs on the CPU (docs/design.md, "The BLAS on Linux").

A prefill's matrix products are large and use every core: 512 prompt tokens of the embedded
model took 2.1 s with MKL's 2 threads, 2.9 s with one. A decode round's are small (1-9 rows),
and on every core they compete with the host thread, which builds the next round while MLX's
stream thread computes this one, and MKL's threads spin for 200 ms after each parallel region
(KMP_BLOCKTIME): on one thread a 2-token verify of the embedded model took 40 ms, not 45, a
k = 1 drafting round 39 where it took 45, and the three plain rounds after drafting no longer
cost 20% more than steady ones. So decode rounds run on every core but one, and a round that
prefills runs on all where its prefill is large: switching costs the 200 ms spin after it, which
a small model's 2 ms rounds paid for nothing (the tiny pair's rounds read 10-20% slower with
every prefill widened), where the embedded model's 128-token prefill gains 0.2 s (726 -> 507 ms)
and its 16-token one 30 ms, with no cost seen in the rounds after.

Which count decodes faster depends on the CPU and its BLAS: where every core but one won on one
machine, every core decoded 1.2-1.6x faster on another (docs/design.md, "The BLAS on Linux"). So
`calibrate` times pipelined plain rounds at both counts before serving, at one row and at several,
and decode rounds of each size take the count that won there (every core only by CALIBRATE_MARGIN).

Where the user set a thread count (MKL_NUM_THREADS, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS), or
no BLAS with a setter is loaded (macOS's Accelerate; MLX on a GPU does not use it), this does nothing.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

USER_SETTINGS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
SETTERS = ("MKL_Set_Num_Threads", "openblas_set_num_threads")  # libmkl_rt, OpenBLAS


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _setter() -> Optional[Callable[[int], None]]:
    if any(os.environ.get(v) for v in USER_SETTINGS):
        return None
    try:
        process = ctypes.CDLL(None)  # a preloaded BLAS's symbols are global
    except OSError:
        return None
    for name in SETTERS:
        f = getattr(process, name, None)
        if f is not None:
            return f
    return None


PREFILL_THREADS = _cores()
DECODE_THREADS = max(1, PREFILL_THREADS - 1)  # one core left to the host thread
WIDE_WORK = 16 * 135e6  # parameter-tokens a round's prefill needs to run on every core: the embedded
                        # model's 16-token prefill (128 ms on 2 threads, 158 on one); a tiny model's never
CALIBRATE_MARGIN = 0.05  # every core must decode this much faster to replace the default count
CALIBRATE_REPEATS = 2  # alternated timings of each (rows, threads); the least is kept
_set = _setter()
_now: Optional[int] = None


@dataclass
class Calibration:
    """Seconds a plain round took by (rows, threads), and the threads decode rounds of each size take."""

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    chosen: dict[int, int] = field(default_factory=dict)  # rows -> threads (a round takes its largest size ≤ its rows)

    def threads(self, rows: int) -> int:
        if not self.chosen:
            return DECODE_THREADS
        sizes = sorted(self.chosen)
        return self.chosen[max([r for r in sizes if r <= rows], default=sizes[0])]


calibration = Calibration()


def calibrate(round_seconds: Callable[[int], float], sizes: Sequence[int]) -> Optional[Calibration]:
    """Times plain rounds of each row count in `sizes` at every core but one and at every core
    (`round_seconds(rows)`: a round's seconds at the threads set now) and keeps the faster for decode
    rounds of that size. None where no count can be set or both are the same."""
    global calibration
    counts = (DECODE_THREADS, PREFILL_THREADS)
    if _set is None or DECODE_THREADS == PREFILL_THREADS:
        return None
    out = Calibration()
    for rows in sizes:
        for rep in range(CALIBRATE_REPEATS):
            for n in counts if rep % 2 == 0 else counts[::-1]:
                _apply(n)
                t = round_seconds(rows)
                out.seconds[(rows, n)] = min(t, out.seconds.get((rows, n), t))
        wide = out.seconds[(rows, PREFILL_THREADS)] < (1 - CALIBRATE_MARGIN) * out.seconds[(rows, DECODE_THREADS)]
        out.chosen[rows] = PREFILL_THREADS if wide else DECODE_THREADS
    calibration = out
    return out


def _apply(n: int) -> None:
    global _now
    if _set is not None and n != _now:
        _set(n)
        _now = n


def use(prefill_work: float = 0.0, rows: int = 1) -> None:
    """Sets the BLAS's threads for a round: every core where it prefills at least WIDE_WORK
    parameter-tokens (prompt tokens × the model's parameters, summed over what it prefills), else
    the decode count for its `rows` (every core but one unless calibrated otherwise)."""
    _apply(PREFILL_THREADS if prefill_work >= WIDE_WORK else calibration.threads(rows))
