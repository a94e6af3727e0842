"""Baseline generation: every baseline request decoded in one batched forward a round.

mlx-lm's BatchGenerator runs the batch: a request joins after its prompt is prefilled (in chunks of
`prefill_step` tokens between decode steps, so running streams keep flowing), leaves between
rounds, and samples with its own sampler (its own random key). Each request is a `BaselineRow`,
the round's Decoder (worker/round.py): the shared step, run once a round, hands it its token.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from worker.round import Paid, RowState, SetApart
from worker.sampling import Chosen, RowSampling, SamplingParams, chosen
from worker.state.reuse import Held

class Guest(Protocol):
    """A forward that runs the batch's decode step with other rows in it (worker/joint/guests.py)."""

    def fits(self, cache: list) -> bool: ...

    def __call__(self, x: mx.array, cache: list) -> mx.array: ...


NO_LIMIT = 1 << 40  # the batch never ends a row itself: the engine ends it (stop, length, cancel)


class BaselineBatch:
    """The batch every BaselineRow belongs to; `step` runs once a round."""

    def __init__(self, model, prefill_step: int, max_rows: int):
        self.gen = BatchGenerator(model, max_tokens=NO_LIMIT, completion_batch_size=max_rows,
                                  prefill_batch_size=max_rows, prefill_step_size=prefill_step)
        self.prefill_step = prefill_step
        self.rows: dict[int, BaselineRow] = {}  # by the batch's uid
        self._to_prefill: dict[int, int] = {}  # prompt tokens each joining row has yet to feed, its last aside
        self._leaving: list[int] = []  # rows gone since the last step, taken out of the batch together

    def prefill_next(self) -> int:
        """Prompt tokens the next step prefills (one chunk of each joining row's)."""
        return sum(min(self.prefill_step, n) for n in self._to_prefill.values())

    def join(self, row: "BaselineRow", prompt: list[int], cache: Optional[list], cached: int) -> int:
        """Queues a request for prefill (of its prompt past the `cached` tokens its cache holds),
        in segments that end at its boundaries."""
        cuts = [cached] + row.boundaries + [len(prompt)]
        segments = [prompt[a:b] for a, b in zip(cuts, cuts[1:])]
        uid = self.gen.insert_segments([segments], caches=[cache] if cache is not None else None,
                                       all_tokens=[prompt[:cached]], samplers=[row.sampling.sampler],
                                       logits_processors=[row.sampling.processors])[0]
        self.rows[uid] = row
        self._to_prefill[uid] = max(0, len(prompt) - cached - 1)
        return uid

    def step(self, guest: Optional[Guest] = None) -> bool:
        """One decode step of the rows in generation and one prefill chunk of those joining.
        `guest`: a forward standing in for the model in the decode step (worker/joint/guests.py);
        True if the step ran it (it does when some row is decoding and the caches fit it)."""
        if self._leaving:  # one filter of the batch's caches for all of them
            self.gen.remove(self._leaving)
            self._leaving = []
        if not self.rows:
            return False
        decoding = self.gen._generation_batch  # mlx-lm 0.32's: its decode step calls its model
        hosted = guest is not None and len(decoding) > 0 and guest.fits(decoding.prompt_cache)
        if hosted:
            decoding.model = guest
        try:
            self._to_prefill = {u: n - self.prefill_step for u, n in self._to_prefill.items() if n > self.prefill_step}
            prefilled, generated = self.gen.next()
        finally:
            decoding.model = self.gen.model
        for p in prefilled:
            if p.end_of_segment and not p.end_of_prompt and p.uid in self.rows:
                self.rows[p.uid].boundary_reached(lambda uid=p.uid: self.cache_of(uid))
        for r in generated:
            self.rows[r.uid].deliver(r.token, r.logprobs)
        return hosted

    def join_at(self, row, tokens: list[int], cache: list) -> int:
        """A joint request that stops drafting: its cache holds tokens[:-1] and its last token is
        emitted already, so the batch feeds that token next step and delivers from the one after."""
        sampling = row.sampling
        uid = self.gen.insert_segments([[tokens[-1:]]], caches=[cache], all_tokens=[tokens[:-1]],
                                       samplers=[sampling.sampler], logits_processors=[sampling.processors])[0]
        self.rows[uid] = row
        return uid

    def leave_at(self, uid: int) -> tuple[list, mx.array, mx.array]:
        """Takes a row out: its cache (every token delivered) and the token the batch computed
        ahead for it, with its log-probabilities. BatchGenerator.remove drops that token and the
        cache holds the one before it, so it is read from mlx-lm 0.32's GenerationBatch."""
        stage, idx = self.gen._find_uids([uid])[uid]
        if stage != 2:
            raise RuntimeError(f"row {uid} left the batch before its first step")
        ahead = self.gen._generation_batch
        token, logprobs = ahead._next_tokens[idx], ahead._next_logprobs[idx]
        self.rows.pop(uid)
        cache = self.gen.remove([uid], return_prompt_caches=True)[uid][0]
        return cache, token, logprobs

    def cycles(self, rows: list, budgets: list[int]) -> list[list[int]]:
        """The round's step for its rows (a Group's run): a token for each in generation, a prefill
        chunk of each joining."""
        self.step()
        return [row.advance(0, False) for row in rows]

    def cache_of(self, uid: int) -> list:
        return self.gen.extract_cache([uid])[uid][0]

    def leave(self, uid: int) -> None:
        """The row is gone: nothing is delivered to it again; it leaves the batch before the next step."""
        self._to_prefill.pop(uid, None)
        if self.rows.pop(uid, None) is not None:
            self._leaving.append(uid)


class BaselineRow:
    """One baseline request in the batch. After each token its cache holds the prompt and every
    token emitted (the batch runs one step ahead, as mlx-lm's generate_step does)."""

    def __init__(self, batch: BaselineBatch, prompt: list[int], temperature: float, top_p: float,
                 seed: Optional[int], cache: Optional[list] = None, cached: int = 0,
                 boundaries: Sequence[int] = (), on_boundary: Optional[Callable[[int, list], None]] = None,
                 sampling: Optional[RowSampling] = None):
        """`boundaries`: prompt lengths past `cached` where `on_boundary(length, cache)` is told
        the prefill reached them (prefix reuse keeps a snapshot there). `sampling` (its sampler,
        processors and log-probabilities) replaces the plain one of temperature, top_p and seed."""
        self.batch, self.tokens = batch, list(prompt)  # the prompt and every token emitted
        self.boundaries, self.on_boundary = list(boundaries), on_boundary
        self._reached = 0
        self.sampling = sampling or RowSampling(SamplingParams(temperature, top_p), seed)
        self.chosen: list[Chosen] = []  # the log-probabilities of the last advance's tokens, when asked
        self.started, self.stats, self.last_cycle, self.draft_s = False, None, (0, 0), 0.0
        self._delivered: list[tuple[int, object]] = []
        self.uid = batch.join(self, prompt, cache, cached)

    def boundary_reached(self, cache: Callable[[], list]) -> None:
        if self._reached < len(self.boundaries) and self.on_boundary is not None:
            self.on_boundary(self.boundaries[self._reached], cache())
        self._reached += 1

    def deliver(self, token: int, logprobs) -> None:
        self._delivered.append((token, logprobs))

    def state(self, request_id: str, tokens_left: int) -> Optional[RowState]:
        return None  # the scheduler only counts it

    def advance(self, k: int = 0, last: bool = False) -> list[int]:
        """The tokens the round's shared step gave it (none while its prompt is prefilled)."""
        got, self._delivered = self._delivered, []
        out = [t for t, _ in got]
        top = self.sampling.logprobs
        self.chosen = [] if top is None else [chosen(lp, t, top) for t, lp in got]
        self.started = self.started or bool(out)
        self.tokens += out
        return out

    def commit(self, kept: int) -> None:
        pass

    def take_apart(self) -> dict[SetApart, Paid]:
        return {}

    def held(self) -> Held:
        return Held(self.tokens, self.batch.cache_of(self.uid))

    def close(self) -> None:
        self.batch.leave(self.uid)
