"""What a draft of the embedded model can pay: measured forward costs and the acceptance needed.

Speed-up of a cycle drafting k tokens, with acceptance a per position (survival a^j), draft step
cost c and verify cost v(k+1), both relative to one plain target step:

    S(k, a) = (1 + a + … + a^k) / (k·c + v(k+1))

`needed_acceptance` solves S(k, a) = goal for a.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import mlx.core as mx


def timed(fn: Callable[[], mx.array], repeats: int) -> float:
    """Median seconds of fn() evaluated, after one warm-up call."""
    mx.eval(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def forward_cost(model, context: int, tokens: int, repeats: int) -> float:
    """Median cost of one forward of `tokens` tokens on a cache that holds `context` tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache=cache))
    x = mx.ones((1, tokens), dtype=mx.int32)

    def step():
        out = model(x, cache=cache)
        for c in cache:
            c.trim(tokens)  # the next call sees the same context
        return out
    return timed(step, repeats)


def speedup(k: int, a: float, c: float, v: dict[int, float]) -> float:
    return sum(a ** j for j in range(k + 1)) / (k * c + v[k + 1])


def needed_acceptance(k: int, c: float, v: dict[int, float], goal: float) -> Optional[float]:
    """Smallest per-position acceptance a with S(k, a) ≥ goal (None: not even a = 1 reaches it)."""
    if speedup(k, 1.0, c, v) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(k, mid, c, v) < goal else (lo, mid)
    return hi
