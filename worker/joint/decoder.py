"""The joint cycle for one request: the draft proposes k, the target verifies [y, d1..dk] in one
forward and stays in control, and both caches are recovered to exactly the consumed prefix.

Invariant after every commit: the target cache holds every token but the last one (y); the
draft cache holds a prefix of that (it may lag by the tokens it never consumed).

Cycles of k = 0 (the scheduler drafts nothing) are pipelined as mlx-lm's generate_step is: each
one also starts the target's forward of the token it returns, so the next one is already being
computed while the host handles this one. The target cache then holds y too, until a drafting
cycle takes the token computed ahead as its first (`take_ahead`) or `settle()` undoes it (before
a batched round or a snapshot).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import mlx.core as mx

from worker.round import CATCH_UP_LAG, PIPELINE_WARM_ROUNDS, Paid, RowState, SetApart
from worker.state import checkpoint as st
from worker.state.reuse import Held
from worker.joint import parked
from worker.joint.draft import Drafter, pow2_pieces
from worker.joint.sampling import SamplingParams, accept_greedy, accept_sampled, make_key_fn, token_probs
from worker.sampling import Chosen, RowSampling, chosen, log_softmax, process

RECOVERY_PATHS = ("fast", "replay")
DRAFT_TIMED_EVERY = 8  # on a GPU, one drafting cycle in this many waits for its draft before queuing the
                       # verify, so the draft's step is timed (docs/scheduler.md, "The draft step is timed")


@dataclass
class CycleStats:
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    recovery_s: float = 0.0
    accepted_at: list = field(default_factory=list)  # per draft position: [accepted, proposed]

    def add(self, s: "CycleStats") -> None:
        """Adds another request's cycles (the worker's totals; recovery time, not draft or verify)."""
        self.cycles, self.drafted, self.accepted = self.cycles + s.cycles, self.drafted + s.drafted, self.accepted + s.accepted
        self.rollbacks, self.recovery_s = self.rollbacks + s.rollbacks, self.recovery_s + s.recovery_s
        while len(self.accepted_at) < len(s.accepted_at):
            self.accepted_at.append([0, 0])
        for mine, (a, t) in zip(self.accepted_at, s.accepted_at):
            mine[0] += a
            mine[1] += t

    def record_acceptance(self, k: int, n: int) -> None:
        while len(self.accepted_at) < k:
            self.accepted_at.append([0, 0])
        for j in range(min(n + 1, k)):  # positions up to the first rejection were tried
            self.accepted_at[j][1] += 1
            self.accepted_at[j][0] += j < n


class JointDecoder:
    def __init__(self, target, drafter: Drafter, prompt: list[int], params: SamplingParams,
                 seed: Optional[int] = None, recovery: str = "fast", prefill_step: int = 512,
                 cache: Optional[list] = None, cached: int = 0, pipelined_start: bool = False,
                 sampling: Optional[RowSampling] = None, boundaries: Sequence[int] = (),
                 on_boundary: Optional[Callable[[int, list, Drafter], None]] = None):
        """`cache`, holding the prompt's first `cached` tokens: start from a restored state (the
        drafter likewise holds a prefix of the prompt; start() feeds each what it lacks).
        `pipelined_start`: plain cycles are likely first (see `start`). `sampling`: the request's
        logits processors (applied to every target position) and log-probabilities wanted.
        `boundaries`: prompt lengths past `cached` where `on_boundary(length, cache, drafter)` is
        told the prefill reached them (prefix reuse keeps a snapshot there)."""
        if recovery not in RECOVERY_PATHS:
            raise ValueError(f"recovery must be one of {RECOVERY_PATHS}")
        self.target, self.drafter, self.params = target, drafter, params
        self.processors = sampling.processors if sampling else []
        drafter.processors = self.processors
        self.top_logprobs = sampling.logprobs if sampling else None
        self.sampling = sampling or RowSampling(params, seed)
        self._seat: Optional[parked.Seat] = None  # parked in the baseline batch
        self._switched: Optional[tuple] = None  # a park's or unpark's token and its log-probs, for the next advance
        self.chosen: list[Chosen] = []  # log-probabilities of the last advance's tokens, when asked
        self.drafted: list[bool] = []  # of the last cycle's tokens, those the draft proposed (accepted)
        self.recovery, self.prefill_step = recovery, prefill_step
        self.cache = st.make_cache(target) if cache is None else cache
        self.cached = cached
        self.fed = cached  # prompt tokens the target cache holds while the prompt is prefilled
        self.boundaries, self.on_boundary = [b for b in boundaries if cached < b < len(prompt)], on_boundary
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)  # the target cache holds tokens[:-1] once started
        self.key_fn = make_key_fn(seed)
        self.stats = CycleStats()
        self._pending: Optional[tuple] = None
        self._ahead: Optional[tuple] = None  # (the next token, in flight; its log-probs; checkpoint without y)
        self._plain_run = 0  # plain cycles since the pipeline (re)started
        self._apart: dict[SetApart, Paid] = {}  # switching costs paid on their own
        self._taken: Optional[tuple] = None  # this cycle began with the look-ahead's token: states before it
        self._taken_chosen: list[Chosen] = []  # that token's log-probabilities, when asked
        self.draft_s = 0.0  # what the last drafting cycle's proposal took (its share, batched; 0: not timed)
        self.last_cycle = (0, 0)  # (drafted, accepted) of the last cycle
        self._drafting_cycles = 0
        self.pipelined_start = pipelined_start
        self.started = False
        self._nothing_held = False  # the last advance left nothing to recover (the start, or the batch's tokens)

    # ---- the round's Decoder (worker/round.py) ----

    def state(self, request_id: str, tokens_left: int) -> Optional[RowState]:
        if not self.started:
            return None
        ahead = self._ahead is not None or self._seat is not None  # the batch computes ahead too
        plain_run = PIPELINE_WARM_ROUNDS if self._seat is not None else self._plain_run
        return RowState(request_id, room=max(0, tokens_left - 1 - ahead), lag=self.draft_lag,
                        lacks_prompt=self.draft_lacks_prompt, ahead=ahead, plain_run=plain_run,
                        has_drafted=self._drafting_cycles > 0, last=tokens_left <= 1)

    def advance(self, k: int, last: bool = False) -> list[int]:
        """The first calls prefill (a chunk a round) and the last of them returns the first
        token; each later one is a cycle drafting k."""
        self._nothing_held = not self.started or self._switched is not None or self._seat is not None
        self.drafted = []
        if not self.started:
            self.prefill_chunk()
            return [] if self.prefill_next else [self.start(self.pipelined_start)]
        if self._nothing_held:
            return self._batch_tokens()
        return self.cycle(k, last)

    # ---- parked in the baseline batch (worker/joint/parked.py) ----

    @property
    def parked(self) -> bool:
        return self._seat is not None

    @property
    def in_batch(self) -> bool:
        """This round's tokens come from the batch or a switch, not from a cycle of its own."""
        return self._seat is not None or self._switched is not None

    def park(self, batch) -> None:
        """Moves this row into the baseline batch, which feeds its last token and delivers the
        rest: a look-ahead's token is taken for the next advance; else that advance has none
        (the batch's first step for the row is the forward of its last token)."""
        self._switched = ([], [])
        if self._ahead is not None:
            self._switched = (self.take_ahead(), self._taken_chosen)
            self._taken_chosen = []
        self._stop_recording()
        self._seat = parked.Seat(batch, parked.batch_sampling(self.sampling, self.key_fn))
        self._seat.uid = batch.join_at(self._seat, self.tokens, self.cache)
        self.cache = None

    def unpark(self) -> None:
        """Takes this row out of the batch: the batch's cache holds every token delivered, and the
        token it computed ahead (the target's own next) goes to the next advance; drafting starts
        the round after."""
        cache, token, lp = self._seat.batch.leave_at(self._seat.uid)
        self._seat = None
        self.cache = parked.recording(cache)
        tok = token.item()
        self._switched = ([tok], self._chosen([(lp, tok)]))
        self.tokens.append(tok)
        self._plain_run = 0

    def _batch_tokens(self) -> list[int]:
        """A parked row's tokens this round: a switch's, or what the batch delivered."""
        if self._switched is not None:
            (out, self.chosen), self._switched = self._switched, None
        else:
            got = self._seat.take()
            out = [t for t, _ in got]
            self.chosen = self._chosen([(lp, t) for t, lp in got])
            self.tokens += out
        self.stats.cycles += len(out)
        self.last_cycle, self.draft_s = (0, 0), 0.0
        return out

    # ---- start ----

    @property
    def prefill_next(self) -> int:
        """Prompt tokens the next prefill chunk feeds (0: only the last one, with the start)."""
        return max(0, min(self.prefill_step, len(self.tokens) - 1 - self.fed))

    def prefill_chunk(self) -> None:
        """Feeds the next `prefill_step` tokens of the prompt (fewer to stop at a boundary), so a
        long prompt holds each round of the others for one chunk only."""
        if not self.prefill_next:
            return
        stop = min([self.fed + self.prefill_next] + [b for b in self.boundaries if b > self.fed])
        st.prefill(self.target, self.cache, self.tokens[self.fed : stop], self.prefill_step)
        self.fed = stop
        if self.on_boundary is not None and self.boundaries and stop <= self.boundaries[-1]:
            self.drafter.catch_up(self.tokens[:stop], keep=0)  # the snapshots hold the draft's state too
        if stop in self.boundaries and self.on_boundary is not None:
            self.on_boundary(stop, self.cache, self.drafter)

    def start(self, pipelined: bool = False) -> int:
        """Prefills the target with the prompt; returns the first token (the target's). The draft
        catches up at its first drafting cycle: a request the scheduler never drafts for never
        pays the draft's prefill. `pipelined`: the next forward is started before the first token
        is read, as mlx-lm's generate_step does, for plain cycles to follow (a drafting cycle takes
        its token; docs/design.md, "Pipelined plain cycles")."""
        self.started = True
        prompt = self.tokens
        st.prefill(self.target, self.cache, prompt[self.fed : -1], self.prefill_step)
        self.fed = len(prompt) - 1
        y, lp = self._pick(self.target(mx.array(prompt[-1:])[None], cache=self.cache)[0, -1], self._context())
        if pipelined:
            mx.async_eval(y)
            ahead_ck = st.checkpoint(self.cache)  # the prompt, without y
            self._ahead = (*self._next_token(y, self._context(y)), ahead_ck)
            mx.async_eval(self._ahead[0])
            self._plain_run = 1
        self.tokens.append(y.item())
        self.chosen = self._chosen([(lp, self.tokens[-1])])
        return self.tokens[-1]

    # ---- one cycle ----

    def cycle(self, k: int, last: bool = False) -> list[int]:
        """Drafts k, verifies, returns the tokens to emit (the accepted drafts and the target's own).

        The caller must then `commit(m)` with how many of them it kept (fewer after a stop).
        `last`: no token can follow this cycle's (the request's last), so a plain cycle computes
        nothing ahead. worker/joint/batch.py drives the same phases for several requests at once."""
        if k == 0:
            return self._plain(last)
        taken = self.take_ahead()
        self.catch_up_draft()
        if taken:  # a stop on the taken token keeps neither the drafts nor the verify
            self._taken = (st.checkpoint(self.cache), self.drafter.snapshot())
        timed = mx.default_device() == mx.cpu or self._drafting_cycles % DRAFT_TIMED_EVERY == 0
        self._drafting_cycles += 1
        t0 = time.perf_counter()
        proposed, qs = self.drafter.propose_lazily(self.tokens, k, self.position, self.params, self.key_fn)
        if timed:
            mx.eval(proposed)
        t1 = time.perf_counter()
        ck = self.prepare_verify(k)
        # the verify is queued behind the draft's steps before either is read: one wait a cycle, and
        # on a GPU the host builds the verify while the device drafts
        logits = self.target(mx.concatenate([mx.array([self.tokens[-1]]), proposed])[None], cache=self.cache)[0]
        logits = process(self.processors, self._context(proposed), logits)
        choices = mx.argmax(logits, axis=-1) if self.params.greedy else None
        mx.async_eval(logits if choices is None else choices)
        drafted = proposed.tolist()
        self.drafter.consumed_through(self.tokens, drafted)
        emitted = self.accept(drafted, qs, logits, ck, t1 - t0, t1, choices, timed)
        self.drafted = [False] * len(taken) + self.drafted
        return taken + emitted

    def close(self) -> None:
        if self._seat is not None:
            self._seat.batch.leave(self._seat.uid)
            self._seat = None

    def adopt_cache(self, cache: list) -> None:
        """After a batched verify (worker/joint/batch.py): this request's row of the batch cache."""
        self.cache = cache

    def take_ahead(self) -> list[int]:
        """Before a drafting cycle after pipelined plain ones: the token computed ahead is the
        target's own next token, so it becomes this cycle's first, and the cache, which holds the
        token before it, holds every token but the last as after a commit (thrown away, its forward
        is paid for nothing). The wait for it is timed apart ("look-ahead taken"): it is part of
        a plain round's work."""
        if self._ahead is None:
            return []
        t0 = time.perf_counter()
        tok = self._ahead[0].item()
        self._taken_chosen = self._chosen([(self._ahead[1], tok)])
        self._ahead = None
        self.tokens.append(tok)
        self._pay_apart(SetApart.LOOK_AHEAD_TAKEN, time.perf_counter() - t0)
        return [tok]

    def _plain(self, last: bool = False) -> list[int]:
        """A cycle without drafts, pipelined: returns the token in flight and starts the next,
        unless it is the `last` (mlx-lm's generate_step computes one more, never emitted)."""
        t0 = time.perf_counter()
        st.set_record(self.cache, False)
        if self._ahead is None:  # (re)start: this token's forward runs on its own, the next one queued after it
            token, lp = self._next_token(self.tokens[-1], self._context())
            mx.async_eval(token)
            self._plain_run = 0
        else:
            token, lp = self._ahead[:2]
        self._plain_run += 1
        self._ahead = None
        if not last:
            ahead_ck = st.checkpoint(self.cache)  # the cache now holds y: this one does not hold the token
            self._ahead = (*self._next_token(token, self._context(token)), ahead_ck)
            mx.async_eval(self._ahead[0])
        tok = token.item()
        self.chosen = self._chosen([(lp, tok)])
        self._pending = ([], [tok], None)
        self.stats.cycles += 1
        self.stats.verify_s += time.perf_counter() - t0
        self.last_cycle = (0, 0)
        return [tok]

    def _next_token(self, y, context: Optional[mx.array]) -> tuple[mx.array, Optional[mx.array]]:
        """The target's next token after y (lazy), feeding y to the cache; `context`: the tokens
        through y, for the processors."""
        x = mx.array([[y]]) if isinstance(y, int) else y.reshape(1, 1)
        return self._pick(self.target(x, cache=self.cache)[0, -1], context)

    def _pick(self, logits: mx.array, context: Optional[mx.array]) -> tuple[mx.array, Optional[mx.array]]:
        """The target's token from its logits after the processors (lazy), and its position's
        log-probabilities when they are asked for."""
        logits = process(self.processors, context, logits[None])[0] if context is not None else logits
        lp = log_softmax(logits) if self.top_logprobs is not None else None
        if self.params.greedy:
            return mx.argmax(logits), lp
        return mx.random.categorical(mx.log(token_probs(logits, self.params)), key=self.key_fn()), lp

    def _context(self, *ahead: mx.array) -> Optional[mx.array]:
        """The tokens through the next input (the processors' context): self.tokens, then the
        lazy tokens in `ahead`; None without processors."""
        if not self.processors:
            return None
        return mx.concatenate([mx.array(self.tokens), *(a.reshape(-1).astype(mx.int32) for a in ahead)])

    def process_verify(self, logits: mx.array, drafted: list[int]) -> mx.array:
        """Verify logits of [y, d1..dk] after the processors, position by position (batched verifies)."""
        return process(self.processors, self._context(mx.array(drafted, dtype=mx.int32)), logits)

    def _chosen(self, picked: list[tuple[Optional[mx.array], int]]) -> list[Chosen]:
        if self.top_logprobs is None:
            return []
        return [chosen(lp, tok, self.top_logprobs) for lp, tok in picked]

    def _stop_recording(self) -> None:
        st.set_record(self.cache, False)
        for c in self.cache:
            if isinstance(c, st.RecordingArraysCache):
                c.clear_record()

    def settle(self) -> None:
        """Undoes a pending look-ahead: the cache holds every token but the last one again. The
        forward computed ahead is waited for first, and that wait is timed apart."""
        if self._ahead is not None:
            t0 = time.perf_counter()
            mx.eval(self._ahead[0])
            st.rollback(self.cache, self._ahead[2])
            self._ahead = None
            self._pay_apart(SetApart.LOOK_AHEAD_DISCARDED, time.perf_counter() - t0)

    def held(self) -> Held:
        """What the caches hold once a pending look-ahead is undone (for a snapshot)."""
        if self._seat is not None:  # the batch's cache holds every token delivered
            return Held(list(self.tokens), self._seat.batch.cache_of(self._seat.uid), self.drafter)
        self.settle()
        return Held(self.tokens[:-1], self.cache, self.drafter)

    def catch_up_draft(self) -> None:
        """Before drafting: a draft more than CATCH_UP_LAG tokens behind (the prompt, or the cycles
        it sat out) first feeds them, evaluated and timed apart."""
        if self.draft_lag > CATCH_UP_LAG:
            why = SetApart.DRAFT_PREFILL if self.draft_lacks_prompt else SetApart.DRAFT_CATCH_UP
            t0, fed = time.perf_counter(), len(self.drafter.consumed)
            self.drafter.catch_up(self.tokens)
            fed = len(self.drafter.consumed) - fed
            self._pay_apart(why, time.perf_counter() - t0, fed, len(pow2_pieces(fed, self.drafter.prefill_step)))

    def _pay_apart(self, why: SetApart, seconds: float, tokens: int = 0, pieces: int = 0) -> None:
        self._apart[why] = self._apart.get(why, Paid()).add(Paid(seconds, tokens, pieces))

    def take_apart(self) -> dict[SetApart, Paid]:
        """The switching costs paid on their own since the last call (with the tokens and pieces
        a catch-up fed)."""
        out, self._apart = self._apart, {}
        return out

    @property
    def consumed(self) -> list[int]:
        """The tokens the target cache holds now (with a look-ahead pending, y too)."""
        return self.tokens if self._ahead is not None else self.tokens[:-1]

    @property
    def looking_ahead(self) -> bool:
        """Plain cycles have computed the next forward ahead (a drafting cycle throws it away)."""
        return self._ahead is not None

    @property
    def draft_lacks_prompt(self) -> bool:
        """The draft has not consumed the whole prompt yet (it has not drafted for this request)."""
        return len(self.drafter.consumed) < self.prompt_len

    @property
    def draft_lag(self) -> int:
        """Tokens the draft must feed before its first proposal: at most 2 while it drafts every
        cycle, one more for each cycle it sat out."""
        return len(self.tokens) - len(self.drafter.consumed)

    @property
    def position(self) -> int:
        """Output index of the next draft token (d1)."""
        return len(self.tokens) - self.prompt_len

    def prepare_verify(self, k: int) -> Optional[st.Checkpoint]:
        """Before the verify forward: the replay checkpoint, or per-position recording."""
        st.set_record(self.cache, self.recovery == "fast" and k > 0)
        return st.checkpoint(self.cache) if self.recovery == "replay" else None

    def accept(self, drafted: list[int], qs: list, logits: mx.array, ck: Optional[st.Checkpoint],
               draft_s: float, verify_start: float, choices: Optional[mx.array] = None,
               timed: bool = True) -> list[int]:
        """Accepts from the verify logits of [y, d1..dk] and holds the cycle for commit();
        `choices`: their argmax, already queued (greedy); `timed`: draft_s is the draft's whole
        time (else only the host's part of it)."""
        n, own = self.decide(drafted, qs, logits, choices)
        k = len(drafted)
        emitted = drafted[:n] + [own]
        self.drafted = [True] * n + [False]
        taken, self._taken_chosen = self._taken_chosen, []
        if self.top_logprobs is not None:
            lp = log_softmax(logits[: n + 1])
            self.chosen = taken + self._chosen([(lp[j], t) for j, t in enumerate(emitted)])
        self._pending = (drafted, emitted, ck)
        s = self.stats
        s.cycles += 1
        s.drafted += k
        s.accepted += n
        s.draft_s += draft_s
        self.draft_s = draft_s if timed else 0.0
        s.verify_s += time.perf_counter() - verify_start
        s.record_acceptance(k, n)
        self.last_cycle = (k, n)
        return emitted

    def decide(self, drafted: list[int], qs: list, logits: mx.array,
               choices: Optional[mx.array] = None) -> tuple[int, int]:
        """(drafts accepted, the target's own next token)."""
        if self.params.greedy:
            return accept_greedy(drafted, logits, choices)
        return accept_sampled(drafted, qs, logits, self.params, self.key_fn)

    def commit(self, m: int) -> None:
        """Keeps the first m emitted tokens and recovers both caches to exactly that prefix."""
        if self._nothing_held:  # the start's token, or the batch's: nothing to recover
            self._nothing_held = False
            return
        drafted, emitted, ck = self._pending
        self._pending = None
        taken, self._taken = self._taken, None
        first = int(taken is not None)  # the cycle's first token was the look-ahead's, already in self.tokens
        if not 1 <= m <= first + len(emitted):
            raise ValueError(f"commit({m}) of {first + len(emitted)} emitted tokens")
        m -= first
        if m == 0:  # the look-ahead's token kept alone: both caches as before the drafts
            st.rollback(self.cache, taken[0])
            self._stop_recording()
            self.drafter.rewind(taken[1])
            return
        t0 = time.perf_counter()
        verified = len(drafted) + 1  # the target consumed [y, d1..dk]; it keeps [y, e1..e_{m-1}]
        if m < verified:
            self.stats.rollbacks += 1
            if self.recovery == "fast":
                st.keep_recorded(self.cache, verified, m)
            else:
                st.rollback(self.cache, ck)
                self.target(mx.array(([self.tokens[-1]] + drafted)[:m])[None], cache=self.cache)
        self._stop_recording()
        self.tokens += emitted[:m]
        self.drafter.recover(self.tokens, len(self.tokens) - 1)
        if m < verified:
            st.eval_recovered(self.cache)
        self.stats.recovery_s += time.perf_counter() - t0
