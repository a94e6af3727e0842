"""Where a run's tokens leave a reference, and how close the target was to a tie there.

Kept free of the engine's imports so the GPU benches load it on a machine with only MLX and mlx-lm.
"""

from __future__ import annotations

from typing import Optional


def top2_gap(model, tokens: list[int]) -> float:
    """The target's top-two logit gap for the token after `tokens` (one forward)."""
    import mlx.core as mx

    top = mx.sort(model(mx.array(tokens)[None])[0, -1])[-2:].tolist()
    return top[1] - top[0]


def first_divergence(out: list[int], ref: list[int]) -> Optional[int]:
    """The first position where out and ref differ (one ending first: its length); None if equal."""
    if out == ref:
        return None
    return next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
