"""Acceptance rules of the joint cycle: greedy prefix match, and speculative rejection sampling
(Leviathan et al. 2023; Chen et al. 2023), which keeps the target's output distribution."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from worker.sampling import SamplingParams, log_softmax, truncate

__all__ = ["SamplingParams", "token_probs", "accept_greedy", "accept_sampled", "make_key_fn"]


def token_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution baseline sampling draws from: mlx-lm's truncation chain on the
    log-probs (worker/sampling.py), then temperature."""
    logprobs = truncate(log_softmax(logits), params)
    return mx.softmax(logprobs.astype(mx.float32) / params.temperature, axis=-1)


def accept_greedy(drafted: list[int], target_logits: mx.array, choices: Optional[mx.array] = None) -> tuple[int, int]:
    """(n accepted, the target's own next token) for verify logits of [y, d1..dk]; `choices`:
    their argmax, where the caller computed it already."""
    choices = (mx.argmax(target_logits, axis=-1) if choices is None else choices).tolist()
    n = 0
    while n < len(drafted) and drafted[n] == choices[n]:
        n += 1
    return n, choices[n]


def accept_sampled(drafted: list[int], draft_probs: list[mx.array], target_logits: mx.array,
                   params: SamplingParams, key_fn: Callable[[], mx.array]) -> tuple[int, int]:
    """Accepts d_i with probability min(1, p(d_i)/q(d_i)); on the first rejection samples the
    residual max(p - q, 0), and after k acceptances samples p at the bonus position."""
    p = token_probs(target_logits, params)  # [k+1, V]
    k = len(drafted)
    n = k
    if k:
        idx = mx.array(drafted)
        p_sel = p[mx.arange(k), idx]
        q_sel = mx.stack([q[d] for q, d in zip(draft_probs, drafted)])
        u = mx.random.uniform(shape=(k,), key=key_fn())
        ok = (u * q_sel < p_sel).tolist()
        n = ok.index(False) if False in ok else k
    if n < k:
        residual = mx.maximum(p[n] - draft_probs[n], 0.0)
        return n, _sample(residual, key_fn())
    return n, _sample(p[n], key_fn())


def _sample(weights: mx.array, key: mx.array) -> int:
    return mx.random.categorical(mx.log(weights), key=key).item()


def make_key_fn(seed: Optional[int]) -> Callable[[], mx.array]:
    """A per-request stream of keys (reproducible for a given seed)."""
    import secrets

    state = [mx.random.key(seed if seed is not None else secrets.randbits(63))]

    def next_key() -> mx.array:
        state[0], sub = mx.random.split(state[0])
        return sub

    return next_key
