"""Drafts for benchmarks only, never served: acceptance by construction (the engine's `controls`)."""

from __future__ import annotations

import random
from typing import Callable, Optional

import mlx.core as mx


class Controlled:
    """Benchmark only, never served: the real draft forward runs (so drafting and its recovery
    cost what they cost) but proposes the target's known greedy continuation with probability
    alpha(position) and a wrong token otherwise. Whether a position is proposed right depends
    only on (seed, position): runs with one seed meet the same hard tokens whatever their budget
    (common random numbers), so comparisons between budgets are not blurred by the draws."""

    def __init__(self, reference: list[int], alpha: Callable[[int], float], vocab_size: int, seed: int = 0):
        self.reference, self.alpha, self.vocab_size, self.seed = reference, alpha, vocab_size, seed
        self._draws: dict[int, float] = {}  # each position's draw, made once (a Random costs ~6 µs to seed)

    def choose(self, logits: mx.array, position: int) -> tuple[int, Optional[mx.array]]:
        """A token known on the host (the batch makes the round's tokens depend on the logits,
        so the draft's forward runs whole, as a real draft's would)."""
        return self.pick(position), None

    def pick(self, position: int) -> int:
        ref = self.reference[position] if position < len(self.reference) else 0
        return ref if self.meant_right(position) else (ref + 1) % self.vocab_size

    def meant_right(self, position: int) -> bool:
        """Whether its proposal at this output position is the reference's token."""
        draw = self._draws.get(position)
        if draw is None:
            draw = self._draws[position] = random.Random(self.seed * 1_000_003 + position).random()
        return draw < self.alpha(position)

    def accept_by_intent(self, drafted: list[int], logits: mx.array, position: int,
                         choices: Optional[list[int]] = None) -> tuple[int, int]:
        """The verify forward runs as always, but acceptance follows the draft's intent (every
        proposal it meant to be right, up to the first it meant to be wrong), so a run has
        acceptance α by construction: random bf16 weights put near-ties everywhere, and a verify
        of several tokens flips some that one-token decoding does not, after which a draft of a
        fixed reference would be wrong ever after. The costs are those of real acceptance."""
        flags = [self.meant_right(position + i) for i in range(len(drafted))]
        n = next((i for i, right in enumerate(flags) if not right), len(flags))
        return n, choices[n] if choices is not None else int(mx.argmax(logits[n]).item())


def controls(references: dict[tuple, tuple[int, list[int]]], alpha: Callable[[int], float], vocab_size: int,
             forced: bool = False):
    """The engine's `controls`: each joint request's controlled draft, seeded and referenced by
    its prompt (`references`: prompt -> (seed, the target's greedy continuation)); `forced`:
    acceptance by the draft's intent too."""

    def make(request_id: str, prompt: list[int]):
        seed, ref = references[tuple(prompt)]
        c = Controlled(ref, alpha, vocab_size, seed)
        return c.choose, (c.accept_by_intent if forced else None)

    return make
