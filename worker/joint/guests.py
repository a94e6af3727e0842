"""A round with rows in the baseline batch and joint rows cycling on their own: the joint rows'
verifies join the batch's decode step as guests, so the round is one target forward for every row
(docs/design.md, "One forward a round").

mlx-lm's GenerationBatch runs the step; for it the guest forward stands in for the model. The
batch's rows feed their one token, right-padded to the guests' widest [y, d1..dk]; the forward
runs on the batch's caches joined with the guests' merged ones (joining copies, so the batch's
own arrays are untouched until the forward is done). After it, the batch takes back its rows:
attention KV trimmed of the padded positions (the same for every batch row), recurrent state the
recorded one after its real token. The guests take their rows as after a verify of their own.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from worker.baseline import BaselineBatch, BaselineRow
from worker.joint.batch import Verify, propose, verify_batch
from worker.joint.decoder import JointDecoder
from worker.round import BatchFn, Group, ScheduledRound
from worker.state.checkpoint import RecordingArraysCache


class GuestForward:
    """The batch's decode forward of one round with the guests' verify in it."""

    def __init__(self, model, verify: Verify):
        self.model, self.verify = model, verify
        self.logits: Optional[mx.array] = None  # the guests' [J, W, V], once it ran

    @staticmethod
    def fits(cache: list) -> bool:
        """The batch's caches can take guests (attention KV and recurrent state; not a rotating
        window, whose positions a joined forward would evict)."""
        return all(isinstance(c, (BatchKVCache, ArraysCache)) for c in cache)

    def __call__(self, x: mx.array, cache: list) -> mx.array:
        """x: the batch's next tokens [B, 1]; returns the batch's logits [B, 1, V]."""
        b, width = x.shape[0], self.verify.width
        joined = [_join(c, g, b, self.verify.lens) for c, g in zip(cache, self.verify.caches())]
        x = mx.concatenate([mx.pad(x.astype(mx.int32), [(0, 0), (0, width - 1)]),
                            self.verify.inputs(width).astype(mx.int32)])
        logits = self.model(x, cache=joined)
        for c, j in zip(cache, joined):
            _take_back(c, j, b, width)
        self.verify.adopt(joined, b, width)
        self.logits = logits[b:]
        return logits[:b, :1]


def _join(c, guests, b: int, lens: list[int]):
    """One layer's batch cache (b rows) and the guests' after it, as a new cache."""
    if isinstance(c, BatchKVCache):
        out = copy.copy(c)
        out.extend(guests)
        return out
    out = RecordingArraysCache(len(c.cache))
    out.cache = list(c.cache)
    out.extend(guests)
    out.lengths = mx.array([1] * b + lens)
    out.record = True
    return out


def _take_back(c, joined, b: int, width: int) -> None:
    """The batch's rows of a joined layer after the forward, as if each had fed its one token."""
    if isinstance(c, BatchKVCache):
        keys, values, offset, left_padding, end = joined.state
        c.state = keys[:b], values[:b], offset[:b], left_padding[:b], end
        c.trim(width - 1)
    else:
        c.cache = [mx.contiguous(joined.conv_input[:b, 1 : 1 + joined.n_keep, :]), joined.states[0][:b]]
        c.advance(1)  # what is left of a prompt's padding, as its own step moves it


def mixed_round(batch: BaselineBatch, in_batch: list, guests: list[JointDecoder], budgets: list[int]) -> list[list[int]]:
    """The round of the batch's rows and the joint rows cycling on their own (k from `budgets`):
    one target forward when the batch has rows decoding, else the guests' verify alone."""
    proposal = propose(guests, budgets)
    forward = GuestForward(guests[0].target, proposal.verify)
    if batch.step(forward):
        logits = forward.logits
    else:
        proposal.verify_start = time.perf_counter()
        logits = verify_batch(proposal.verify)
    tokens = [row.advance(0, False) for row in in_batch]
    return tokens + proposal.accept(logits)


def round_groups(sr: ScheduledRound, batch: BaselineBatch, joint_run: BatchFn) -> list[Group]:
    """The round's groups: the batch's rows (baseline and parked joint) in its one step, with the
    joint rows that cycle on their own as its guests (one target forward), where the round
    batches them; without batch rows, those joint rows in batched forwards of their own."""
    joint = {s.request_id for s in sr.states}
    in_batch = [r.request_id for r in sr.rows
                if isinstance(r.decoder, BaselineRow) or (r.request_id in joint and r.decoder.parked)]
    own = [r.request_id for r in sr.rows if r.request_id in joint and not r.decoder.in_batch]
    if not (sr.batched and own):
        return [Group(in_batch, batch.cycles)]
    if not in_batch:
        return [Group(own, joint_run)]

    def run(decoders: list, budgets: list[int]) -> list[list[int]]:
        n = len(in_batch)
        return mixed_round(batch, decoders[:n], decoders[n:], budgets[n:])

    return [Group(in_batch + own, run)]
