"""Per-request samplers on mlx-lm's sampling functions, reproducible under concurrency.

mlx-lm's samplers draw from MLX's global random state, which interleaved requests would
share; here each request owns a key and splits it once per token.
"""

from __future__ import annotations

import secrets
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, greedy_sampler

Sampler = Callable[[mx.array], mx.array]


def make_request_sampler(temperature: float, top_p: float, seed: Optional[int]) -> Sampler:
    if temperature == 0:
        return greedy_sampler
    key = mx.random.key(seed if seed is not None else secrets.randbits(63))
    state = [key]
    inv_temp = 1.0 / temperature

    def sampler(logprobs: mx.array) -> mx.array:
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        state[0], sub = mx.random.split(state[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sampler
