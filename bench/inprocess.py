"""In-process generation with mlx-lm itself, the reference the benches compare against."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import greedy_sampler


def stream_greedy(lm, prompt_ids: list[int], n: int) -> tuple[list[int], list[float], float]:
    """mlx-lm's stream_generate, greedy, exactly n tokens (EOS does not stop it):
    (token ids, arrival time of each, start time), times from time.perf_counter()."""
    tok = lm.tokenizer
    saved = tok.eos_token_ids
    tok.eos_token_ids = set()
    try:
        ids, times = [], []
        t0 = time.perf_counter()
        for resp in stream_generate(lm.model, tok, mx.array(prompt_ids), max_tokens=n, sampler=greedy_sampler):
            times.append(time.perf_counter())
            ids.append(resp.token)
    finally:
        tok.eos_token_ids = saved
    return ids, times, t0
