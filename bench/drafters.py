"""Drafters and decoders for benchmarks only, never served: acceptance by construction."""

from __future__ import annotations

import random
from typing import Callable

import mlx.core as mx

from worker.joint.decoder import JointDecoder
from worker.joint.draft import Drafter


class ControlledDrafter(Drafter):
    """Benchmark only, never served: runs the real draft forward (so drafting and draft recovery
    cost what they cost) but proposes the target's known greedy continuation with probability
    alpha(position) and a wrong token otherwise. Whether a position is proposed right depends
    only on (seed, position): runs with one seed meet the same hard tokens whatever their budget
    (common random numbers), so comparisons between budgets are not blurred by the draws."""

    def __init__(self, model, reference: list[int], alpha: Callable[[int], float], vocab_size: int,
                 seed: int = 0, **kw):
        super().__init__(model, **kw)
        self.reference, self.alpha, self.vocab_size, self.seed = reference, alpha, vocab_size, seed

    def choose(self, logits, position, params, key_fn):
        # the token depends on the logits, so the forward really runs, lazily, as a real draft's would
        return mx.depends(mx.array([self.pick(position)]), logits), None

    def pick(self, position: int) -> int:
        ref = self.reference[position] if position < len(self.reference) else 0
        return ref if self.meant_right(position) else (ref + 1) % self.vocab_size

    def meant_right(self, position: int) -> bool:
        """Whether its proposal at this output position is the reference's token."""
        return random.Random(self.seed * 1_000_003 + position).random() < self.alpha(position)


class ForcedDrafter(ControlledDrafter):
    """The controlled draft, whose proposals ForcedDecoder accepts by its intent."""


class ForcedDecoder(JointDecoder):
    """Bench only, never served: the verify forward runs as always, but acceptance follows the
    draft's intent (every proposal it meant to be right, up to the first it meant to be wrong),
    so a run has acceptance α by construction. Random bf16 weights put near-ties everywhere, and
    a verify of several tokens flips some that one-token decoding does not: a draft proposing a
    fixed reference would then be wrong ever after, and α would not be what is measured. The
    costs (draft steps, verify width, recovery of n accepted) are those of real acceptance."""

    def decide(self, drafted, qs, logits, choices=None):
        flags = [self.drafter.meant_right(self.position + i) for i in range(len(drafted))]
        n = next((i for i, right in enumerate(flags) if not right), len(flags))
        return n, (mx.argmax(logits[n]) if choices is None else choices[n]).item()
