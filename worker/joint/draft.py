"""Drafters: a locked draft model with its own cache, proposing k tokens one forward at a time."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from worker.state import checkpoint as st
from worker.joint.sampling import SamplingParams, token_probs
from worker.sampling import process

# choose(logits [V], output position of the proposal) -> (token [1], q probabilities [V] or None)
Chooser = Callable[[mx.array, int], tuple[mx.array, Optional[mx.array]]]


class Drafter:
    """Keeps the draft's consumed tokens a prefix of the target's, recovering after each cycle.

    fast: a checkpoint (offsets and array references) after every proposal step; recovery picks
    one. replay: one checkpoint before the cycle; recovery restores it and re-feeds the tokens.
    """

    def __init__(self, model, recovery: str = "fast", prefill_step: int = 512,
                 cache: Optional[list] = None, consumed: Optional[list[int]] = None):
        """`cache` (with the tokens it holds, `consumed`): start from a restored state."""
        self.model, self.recovery, self.prefill_step = model, recovery, prefill_step
        self.cache = st.make_cache(model) if cache is None else cache
        self.consumed: list[int] = list(consumed or [])  # tokens the draft cache holds
        self._steps: list[tuple[int, st.Checkpoint]] = []
        self._base: Optional[tuple[int, st.Checkpoint]] = None
        self._agreed = 0  # consumed[:_agreed] is known to be a prefix of the target's tokens
        self.processors: list = []  # the request's logits processors (its grammar): proposals follow them too

    def prefill(self, tokens: list[int]) -> None:
        st.prefill(self.model, self.cache, tokens, self.prefill_step)
        self.consumed += tokens

    def catch_up(self, context: list[int], keep: int = 1) -> None:
        """Feeds what the draft lacks of `context` but its last `keep` tokens (before a batched
        draft forward, so one lagging draft does not pad every row to its lag)."""
        lag = context[len(self.consumed): len(context) - keep]
        done = 0
        for n in pow2_pieces(len(lag), self.prefill_step):  # few distinct shapes: each new one compiles on a GPU
            self.prefill(lag[done: done + n])  # (one piece of each lag's length compiled 1.5-2 s a catch-up there)
            done += n
        if lag:
            self._agreed = len(self.consumed)

    def propose(self, context: list[int], k: int, position: int, params: SamplingParams,
                key_fn: Callable[[], mx.array]) -> tuple[list[int], list[Optional[mx.array]]]:
        """Proposes k tokens after `context` (the target's tokens; the draft feeds what it lacks).

        `position` is the output index of the first proposal. Returns the proposals and their
        draft probabilities (None when greedy).
        """
        if k == 0:
            return [], []
        tokens, probs = self.propose_lazily(context, k, position, params, key_fn)
        drafted = tokens.tolist()
        self.consumed_through(context, drafted)
        return drafted, probs

    def propose_lazily(self, context: list[int], k: int, position: int, params: SamplingParams,
                       key_fn: Callable[[], mx.array]) -> tuple[mx.array, list[Optional[mx.array]]]:
        """`propose` without waiting for the proposals: an array of k tokens, still being computed,
        so a verify forward can be queued behind them (on a GPU the host builds it while the draft
        runs). The caller then reads them and calls `consumed_through(context, drafted)`."""
        feed = context[len(self.consumed):]
        base = len(self.consumed)
        self._base = (base, st.checkpoint(self.cache)) if self.recovery == "replay" else None
        self._steps = []
        tokens, probs = [], []
        done = 0
        for n in pow2_pieces(len(feed))[:-1]:  # catch-up in few distinct shapes (each new one compiles on a GPU)
            self.model(mx.array(feed[done: done + n])[None], cache=self.cache)
            done += n
        x = mx.array(feed[done:])
        for j in range(k):
            logits = self.guided(context, tokens, self.model(x[None], cache=self.cache)[0, -1])
            if self.recovery == "fast":
                self._steps.append((base + len(feed) + j, st.checkpoint(self.cache)))
            x, q = self.choose(logits, position + j, params, key_fn)
            mx.async_eval(x)  # the device runs this step while the host builds the next
            tokens.append(x)
            probs.append(q)
        return mx.concatenate(tokens), probs

    def adopt_batched(self, cache: list, base: int, before: st.Checkpoint,
                      steps: list[tuple[int, st.Checkpoint]]) -> None:
        """After a batched proposal (worker/joint/batch.py): this request's row of the batch cache,
        what it held before (`base` tokens: `before`) and its state after each draft step."""
        self.cache = cache
        self._base = (base, before) if self.recovery == "replay" else None
        self._steps = [] if self.recovery == "replay" else steps

    def consumed_through(self, context: list[int], drafted: list[int]) -> None:
        """After a proposal: the draft holds `context` and all but the last proposal. In place:
        a copy of the whole context each cycle cost 47 us of a 1.4 ms round (tiny pair, 1.5 k tokens)."""
        self.consumed += context[len(self.consumed):]
        self.consumed += drafted[:-1]

    def guided(self, context: list[int], drafted: list[mx.array], logits: mx.array) -> mx.array:
        """The draft's logits [V] after the request's processors, their context the target's
        tokens and the proposals so far: under a grammar the draft proposes only what it allows
        (docs/design.md, "Structured output and tools")."""
        if not self.processors:
            return logits
        ctx = mx.concatenate([mx.array(context, dtype=mx.int32), *(d.reshape(-1).astype(mx.int32) for d in drafted)])
        return process(self.processors, ctx, logits[None])[0]

    def choose(self, logits: mx.array, position: int, params: SamplingParams,
               key_fn: Callable[[], mx.array]) -> tuple[mx.array, Optional[mx.array]]:
        if params.greedy:
            return mx.argmax(logits, keepdims=True), None
        q = token_probs(logits, params)
        return mx.random.categorical(mx.log(q), key=key_fn())[None], q

    def snapshot(self) -> tuple[int, st.Checkpoint]:
        """What the draft holds now, for `rewind`."""
        return len(self.consumed), st.checkpoint(self.cache)

    def rewind(self, snap: tuple[int, st.Checkpoint]) -> None:
        """Back to a `snapshot` taken before this cycle's proposal (the draft may lag: it feeds
        what it lacks at its next proposal)."""
        n, ck = snap
        st.rollback(self.cache, ck)
        del self.consumed[n:]
        self._agreed = min(self._agreed, n)
        self._steps, self._base = [], None

    def recover(self, target_tokens: list[int], n: int) -> None:
        """Keeps the longest prefix of what the draft consumed that the target consumed too
        (`target_tokens[:n]`; passed with its length, as a copy per cycle costs what the round
        does on a small model)."""
        keep = _common_prefix(self.consumed, target_tokens, self._agreed, n)
        self._agreed = keep
        if keep == len(self.consumed):
            return
        if self.recovery == "fast":
            ck = next(ck for n, ck in self._steps if n == keep)
            st.rollback(self.cache, ck)
        else:
            base, ck = self._base
            st.rollback(self.cache, ck)
            if keep > base:
                self.model(mx.array(target_tokens[base:keep])[None], cache=self.cache)
        st.eval_recovered(self.cache)
        del self.consumed[keep:]


def pow2_pieces(n: int, most: int = 512) -> list[int]:
    """n as powers of two, largest first (at most `most` each): 13 -> [8, 4, 1]."""
    out = []
    while n > 0:
        p = min(most, 1 << (n.bit_length() - 1))
        out.append(p)
        n -= p
    return out


def _common_prefix(a: list[int], b: list[int], start: int = 0, b_len: Optional[int] = None) -> int:
    """Length of the common prefix of a and b[:b_len], known to be at least `start`."""
    n = min(len(a), len(b) if b_len is None else b_len)
    for i in range(min(start, n), n):
        if a[i] != b[i]:
            return i
    return n
