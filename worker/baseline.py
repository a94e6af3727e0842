"""Baseline generation: mlx-lm's generate_step, pipelined one-token steps, as a round's Decoder."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.generate import generate_step

from worker.round import Paid, RowState, SetApart
from worker.sampling import make_request_sampler
from worker.state.reuse import Held


class BaselineDecoder:
    """One token a cycle; the scheduler only counts it. After each token its cache holds the
    prompt and every token emitted (generate_step runs one ahead)."""

    def __init__(self, model, prompt: list[int], temperature: float, top_p: float, seed: Optional[int],
                 prefill_step: int, cache: list, cached: int = 0):
        self.cache = cache
        self.tokens = list(prompt)  # the prompt and every token emitted
        self.started = False
        self.last_cycle = (0, 0)
        self.draft_s = 0.0
        self.stats = None  # no joint cycles
        self._gen = generate_step(
            mx.array(prompt[cached:]), model, max_tokens=-1,
            sampler=make_request_sampler(temperature, top_p, seed),
            prefill_step_size=prefill_step, prompt_cache=cache,
        )

    def state(self, request_id: str, tokens_left: int) -> Optional[RowState]:
        return None

    def advance(self, k: int = 0, last: bool = False) -> list[int]:
        token = next(self._gen)[0]  # the first call prefills
        self.started = True
        self.tokens.append(token)
        return [token]

    def commit(self, kept: int) -> None:
        pass

    def take_apart(self) -> dict[SetApart, Paid]:
        return {}

    def held(self) -> Held:
        return Held(self.tokens, self.cache)

    def close(self) -> None:
        self._gen.close()
