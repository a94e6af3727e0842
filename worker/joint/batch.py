"""Joint cycles of several requests together: one batched draft forward per draft step, one
batched target forward for all the verifies, then per-request acceptance and recovery.

The requests' caches are merged into batch caches for the round (attention KV left-padded by
mlx-lm's BatchKVCache; recurrent state stacked) and split back afterwards. Merging copies, so a
request's cache from before the round is untouched: it is the replay path's checkpoint. Inputs of
different lengths are right-padded; padded positions never change a request's recurrent state
(the ArraysCache length mask) and their KV lands after its real tokens, where it is trimmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.state import checkpoint as st
from worker.joint.draft import Drafter
from worker.joint.decoder import JointDecoder
from worker.round import CATCH_UP_LAG


def joint_round(decoders: list[JointDecoder], budgets: list[int]) -> list[list[int]]:
    """Runs one cycle for each decoder (k from `budgets`); returns each one's emitted tokens.
    Each decoder must then be committed as after JointDecoder.cycle."""
    proposal = propose(decoders, budgets)
    return proposal.accept(verify_batch(proposal.verify))


@dataclass
class Verify:
    """The joint rows' verify forward: each row's [y, d1..dk], right-padded to the widest."""

    decoders: list[JointDecoder]
    rows: list[list[int]]

    @property
    def lens(self) -> list[int]:
        return [len(r) for r in self.rows]

    @property
    def width(self) -> int:
        return max(self.lens)

    def inputs(self, width: int) -> mx.array:
        return mx.array([r + [0] * (width - len(r)) for r in self.rows])

    def caches(self) -> list:
        """The rows' caches merged (copies: each decoder's own stays its replay checkpoint),
        recording, with the rows' lengths."""
        batch = merge([d.cache for d in self.decoders])
        _set_lengths(batch, self.lens)
        st.set_record(batch, True)
        return batch

    def adopt(self, batch: list, first: int, width: int) -> None:
        """Leaves each decoder with its row (from `first` on) of the batch cache after the
        forward: the recorded per-position states of its real tokens."""
        for i, (d, n) in enumerate(zip(self.decoders, self.lens), start=first):
            d.adopt_cache([_split_kv(c, i, width - n) if isinstance(c, BatchKVCache) else _split_recorded(c, i, n)
                           for c in batch])


@dataclass
class Proposal:
    """The round's drafts, proposed and ready to verify."""

    verify: Verify
    drafts: list[tuple[list[int], list]]  # per row: the drafted tokens and their draft probabilities
    checkpoints: list[Optional[st.Checkpoint]]
    draft_share: float  # each row's share of the drafting time
    verify_start: float

    def accept(self, logits: mx.array) -> list[list[int]]:
        """Each row's emitted tokens from the verify logits [N, L, V]."""
        return [d.accept(dr, qs, d.process_verify(logits[i, : len(dr) + 1], dr), ck, self.draft_share, self.verify_start)
                for i, (d, (dr, qs), ck) in enumerate(zip(self.verify.decoders, self.drafts, self.checkpoints))]


def propose(decoders: list[JointDecoder], budgets: list[int]) -> Proposal:
    """Settles each row, drafts its budget in batched draft forwards, prepares its verify."""
    for d, k in zip(decoders, budgets):
        d.settle()
        if k:
            d.catch_up_draft()
    t0 = time.perf_counter()
    drafts = draft_batch([d.drafter for d in decoders], [d.tokens for d in decoders], budgets,
                         [d.position for d in decoders], decoders)
    t1 = time.perf_counter()
    cks = [d.prepare_verify(k) for d, k in zip(decoders, budgets)]
    verify = Verify(decoders, [[d.tokens[-1]] + dr for d, (dr, _) in zip(decoders, drafts)])
    return Proposal(verify, drafts, cks, (t1 - t0) / len(decoders), t1)


# ---- merging and splitting caches ----


def merge(caches: list[list]) -> list:
    """Per-request caches (each a list over layers) -> one batch cache per layer."""
    out = []
    for layer in zip(*caches):
        if isinstance(layer[0], KVCache):
            out.append(BatchKVCache.merge(list(layer)))
        else:
            b = st.RecordingArraysCache(len(layer[0].cache))
            b.cache = [mx.concatenate([c.cache[e] for c in layer]) for e in range(len(b.cache))]
            out.append(b)
    return out


def _split_kv(c: BatchKVCache, i: int, extra: int) -> KVCache:
    kv = c.extract(i)
    kv.trim(extra)
    return kv


def _set_lengths(batch: list, lengths: Optional[list[int]]) -> None:
    for c in batch:
        if isinstance(c, st.RecordingArraysCache):
            c.lengths = None if lengths is None else mx.array(lengths)


# ---- the target ----


def verify_batch(verify: Verify) -> mx.array:
    """One forward of every row's [y, d1..dk], alone; returns logits [N, L, V]."""
    batch = verify.caches()
    logits = verify.decoders[0].target(verify.inputs(verify.width), cache=batch)
    verify.adopt(batch, 0, verify.width)
    return logits


def _split_recorded(c: st.RecordingArraysCache, i: int, n: int) -> st.RecordingArraysCache:
    r = st.RecordingArraysCache(len(c.cache))
    r.conv_input, r.n_keep = c.conv_input[i : i + 1], c.n_keep
    r.states = [s[i : i + 1] for s in c.states[:n]]
    r.cache = [mx.contiguous(r.conv_input[:, n : n + r.n_keep, :]), r.states[n - 1]]
    r.record = True
    return r


# ---- the drafts ----


MAX_BATCHED_FEED = CATCH_UP_LAG  # a draft lagging more catches up alone first (the batch pads every row to the longest feed)


def draft_batch(drafters: list[Drafter], contexts: list[list[int]], budgets: list[int], positions: list[int],
                decoders: list[JointDecoder]) -> list[tuple[list[int], list]]:
    """Proposes budgets[i] tokens for each drafter with batched draft forwards (requests with a
    budget of 0 sit out). Leaves each drafter as Drafter.propose would."""
    out: list[tuple[list[int], list]] = [([], []) for _ in drafters]
    rows = [i for i, k in enumerate(budgets) if k > 0]
    if not rows:
        return out
    if len(rows) == 1:
        i = rows[0]
        out[i] = drafters[i].propose(contexts[i], budgets[i], positions[i], decoders[i].params, decoders[i].key_fn)
        return out
    ds = [drafters[i] for i in rows]
    ks = [budgets[i] for i in rows]
    for i, d in zip(rows, ds):
        if len(contexts[i]) - len(d.consumed) > MAX_BATCHED_FEED:  # e.g. a draft not yet prefilled
            d.catch_up(contexts[i])
    feeds = [contexts[i][len(d.consumed):] for i, d in zip(rows, ds)]
    bases = [len(d.consumed) for d in ds]
    before = [st.checkpoint(d.cache) for d in ds]  # merge copies: these stay valid
    batch = merge([d.cache for d in ds])
    width = max(len(f) for f in feeds)
    for c in batch:
        if isinstance(c, BatchKVCache):
            c.prepare(right_padding=[width - len(f) for f in feeds])
    _set_lengths(batch, [len(f) for f in feeds])
    x = mx.array([f + [0] * (width - len(f)) for f in feeds])
    logits = ds[0].model(x, cache=batch)
    for c in batch:
        if isinstance(c, BatchKVCache):
            c.finalize()  # the right padding becomes left padding
    last = mx.array([len(f) - 1 for f in feeds])
    logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    steps, chosen = [], [[] for _ in rows]
    probs = [[] for _ in rows]
    for j in range(max(ks)):
        if j:
            _set_lengths(batch, [int(j < k) for k in ks])
            logits = ds[0].model(x, cache=batch)[:, -1]
        steps.append([tuple(c.cache) if isinstance(c, st.RecordingArraysCache) else None for c in batch])
        toks = []
        for r, (i, d) in enumerate(zip(rows, ds)):
            if j < ks[r]:  # under the request's processors (its grammar), as the target's verify
                dec, guided = decoders[i], d.guided(contexts[i], chosen[r], logits[r])
                tok, q = d.choose(guided, positions[i] + j, dec.params, dec.key_fn)
                chosen[r].append(tok)
                probs[r].append(q)
            toks.append(tok if j < ks[r] else mx.array([0]))
        x = mx.concatenate(toks)[:, None]
    _set_lengths(batch, None)
    for r, (i, d) in enumerate(zip(rows, ds)):
        drafted = mx.concatenate(chosen[r]).tolist()
        k, f = ks[r], len(feeds[r])
        cache = [_split_kv(c, r, len(steps) - k) if isinstance(c, BatchKVCache) else _row(c.cache, r)
                 for c in batch]
        d.adopt_batched(cache, bases[r], before[r],
                        [(bases[r] + f + j, _row_checkpoint(batch, steps[j], r, bases[r] + f + j)) for j in range(k)])
        d.consumed_through(contexts[i], drafted)
        out[i] = (drafted, probs[r])
    return out


def _row(arrays: list, r: int) -> st.RecordingArraysCache:
    c = st.RecordingArraysCache(len(arrays))
    c.cache = [a[r : r + 1] for a in arrays]
    return c


def _row_checkpoint(batch: list, step: list, r: int, length: int) -> st.Checkpoint:
    """Request r's state after a draft step: its KV length and its rows of the recurrent arrays."""
    return st.Checkpoint(
        tuple(length if isinstance(c, BatchKVCache) else None for c in batch),
        tuple(None if arrays is None else tuple(a[r : r + 1] for a in arrays) for arrays in step),
    )
