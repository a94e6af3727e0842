"""A round's choices over its logits: the next token of each plain row (one argmax for the
greedy rows without processors), and each drafting row's acceptance (greedy prefix match, or
rejection sampling with the row's own keys). Processors (penalties, a grammar) run per row on
every position a row feeds, with the context through that position."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from worker.batch.rows import Row
from worker.joint.sampling import accept_greedy, accept_sampled, token_probs
from worker.sampling import log_softmax, process

__all__ = ["simple", "context", "pick", "plain", "processed", "accept", "log_softmax"]


def simple(row: Row) -> bool:
    """Greedy, no processors, no log-probabilities: its choice is one argmax among many."""
    s = row.sampling
    return s.params.greedy and not s.processors and s.logprobs is None


def context(row: Row, *tail: mx.array) -> Optional[mx.array]:
    """The row's tokens and then `tail` (lazy ones): its processors' context; None without
    processors."""
    if not row.sampling.processors:
        return None
    return mx.concatenate([mx.array(row.seq, dtype=mx.int32)] + [t.reshape(-1).astype(mx.int32) for t in tail])


def pick(row: Row, logits: mx.array, ctx: Optional[mx.array]) -> tuple[mx.array, Optional[mx.array]]:
    """The row's token [1] from one position's logits [V] (lazy), with its log-probabilities
    (after the processors, before temperature) when asked."""
    if ctx is not None:
        logits = process(row.sampling.processors, ctx, logits[None])[0]
    lp = log_softmax(logits) if row.sampling.logprobs is not None else None
    params = row.sampling.params
    if params.greedy:
        return mx.argmax(logits, keepdims=True), lp
    return mx.random.categorical(mx.log(token_probs(logits, params)), key=row.key())[None], lp


def plain(rows: list[Row], logits: mx.array, ys: mx.array) -> tuple[mx.array, list[Optional[mx.array]]]:
    """Each row's next token [B] from its position's logits [B, V]; and log-probabilities."""
    if all(simple(r) for r in rows):
        return mx.argmax(logits, axis=-1), [None] * len(rows)
    tokens, lps = [], []
    for i, r in enumerate(rows):
        tok, lp = pick(r, logits[i], context(r, ys[i: i + 1]))
        tokens.append(tok.astype(mx.uint32))
        lps.append(lp)
    return mx.concatenate(tokens), lps


def processed(row: Row, logits: mx.array, drafts: mx.array) -> mx.array:
    """A drafting row's verify logits [k+1, V] after its processors (its pending token read
    into its tokens already)."""
    ctx = context(row, drafts)
    return logits if ctx is None else process(row.sampling.processors, ctx, logits)


def accept(row: Row, drafted: list[int], qs: list, logits: Optional[mx.array], choices: Optional[list[int]],
           position: int) -> tuple[int, int]:
    """(drafts accepted, the target's own next token) from the verify logits [k+1, V] (None where
    `choices`, their argmax computed for the batch, decide); `position`: output index of d1."""
    if row.acceptor is not None:
        return row.acceptor(drafted, logits, position, choices)
    params = row.sampling.params
    if params.greedy:
        if choices is not None:
            n = 0
            while n < len(drafted) and drafted[n] == choices[n]:
                n += 1
            return n, choices[n]
        return accept_greedy(drafted, logits)
    return accept_sampled(drafted, qs, logits, params, row.key)
