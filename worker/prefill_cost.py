"""How many prompt tokens a round may prefill, from what prefills have cost: a running stream
waits one round for its next token, and a round first feeds each joining row a chunk of its
prompt, so that chunk's forward is part of the stream's gap. A chunk's cost grows with the context it attends to (each of its tokens attends
to every token before it), so a fixed token count costs far more deep in a long prompt: on the
2-core CPU a 128-token chunk of SmolLM2 took 0.2 s at the prompt's start and seconds past
4,000 tokens (MLX's CPU attention over 16 or more queries).

The model, fitted by least squares to the prefill forwards the batch measures (worker/batch/
runner.py: every prefilling row's chunk in one forward, `rows` of them, padded to the widest), is

    seconds = base + rows * tokens * (per_token + per_key * (depth + tokens / 2))

`base`: a forward's fixed cost (observations of nothing prefilled, where a caller reports them,
anchor it while the chunks seen are all one size); `per_token`: a prompt token's own work (its
weights); `per_key`: what attending one cached token costs it.
`chunk_tokens(depth)` is the largest chunk, at most `max_tokens` (--prefill-step), whose
predicted forward stays within AIM of the bound: BOUND_S, about what a full chunk costs at a
prompt's start on the 2-core CPU (where 128 tokens took 0.25 s alone, 0.9 s beside other test
runs), so deep in a long prompt a running stream waits no longer than near its start. On a
GPU a chunk of 512 tokens is far below its bound, which only binds deep in very long prompts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

BOUND_S = {"cpu": 1.0, "gpu": 0.25}  # the most a round that prefills may cost, by device
KEPT = 64  # observations the fit uses, newest first
BASE_WEIGHT = 0.2  # the moving average of rounds without prefill: each moves it this much
ANCHOR = 0.5  # how much that average weighs in the fit's intercept, against one round's residual
AIM = 0.8  # chunks are sized to this share of the bound: a prediction is a fit to noisy rounds


@dataclass(frozen=True)
class Round:
    """One measured round that prefilled: `rows` joining rows, each `tokens` prompt tokens on top
    of the `depth` it already had cached, in `seconds` (the round's wall time)."""

    depth: int
    tokens: int
    rows: int
    seconds: float


def default_bound_s() -> float:
    import mlx.core as mx

    return BOUND_S["gpu" if mx.default_device() == mx.gpu else "cpu"]


class PrefillCost:
    def __init__(self, max_tokens: int, bound_s: Optional[float], min_tokens: int = 1):
        """`max_tokens`: the largest chunk (--prefill-step); `bound_s`: the most a round may cost
        (None: every chunk `max_tokens`, as where ranks must feed the same chunks)."""
        self.max_tokens, self.min_tokens, self.bound = max_tokens, min(min_tokens, max_tokens), bound_s
        self.rounds: deque[Round] = deque(maxlen=KEPT)
        self.idle: Optional[float] = None  # the moving average of rounds that prefilled nothing
        self.base = 0.0
        self.per_token: Optional[float] = None
        self.per_key = 0.0

    def observe(self, depth: int, tokens: int, rows: int, seconds: float) -> None:
        """A round's cost: with `tokens` 0 (nothing prefilled) it anchors the base."""
        if tokens <= 0 or rows <= 0:
            self.idle = seconds if self.idle is None else self.idle + BASE_WEIGHT * (seconds - self.idle)
            return
        self.rounds.append(Round(depth, tokens, rows, seconds))
        self._fit()

    def _fit(self) -> None:
        """base, per_token and per_key by least squares over the rounds kept, with one more row
        that holds the base near the rounds that prefilled nothing (chunks all of one size
        cannot tell a round's fixed part from its tokens' part)."""
        rows = [(1.0, r.rows * r.tokens, r.rows * r.tokens * (r.depth + r.tokens / 2)) for r in self.rounds]
        seconds = [r.seconds for r in self.rounds]
        rows.append((ANCHOR, 0.0, 0.0))
        seconds.append(ANCHOR * (self.idle or 0.0))
        base, per_token, per_key = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)[0]
        self.base, self.per_key = max(0.0, float(base)), max(0.0, float(per_key))
        self.per_token = max(0.0, float(per_token))

    def seconds(self, depth: int, tokens: int, rows: int = 1) -> Optional[float]:
        """A round's predicted cost (None before any round that prefilled was measured)."""
        if self.per_token is None:
            return None
        return self.base + rows * tokens * (self.per_token + self.per_key * (depth + tokens / 2))

    def chunk_tokens(self, depth: int, rows: int = 1, bound_s: Optional[float] = None) -> int:
        """The largest chunk (min_tokens..max_tokens) whose round stays within AIM of the bound at
        this depth: the positive root of rows * (q/2 L^2 + (p + q d) L) = AIM * bound - base."""
        bound = bound_s if bound_s is not None else self.bound
        if bound is None or self.per_token is None:
            return self.max_tokens  # nothing measured yet: the configured chunk
        room = (AIM * bound - self.base) / max(1, rows)
        p, q = self.per_token, self.per_key
        linear = p + q * depth
        if q > 0:
            tokens = (-linear + math.sqrt(linear * linear + 2 * q * max(0.0, room))) / q
        else:
            tokens = room / linear if linear > 0 else self.max_tokens
        return max(self.min_tokens, min(self.max_tokens, int(tokens)))
