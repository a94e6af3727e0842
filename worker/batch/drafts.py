"""The draft's proposals for a round, in batched forwards of the draft's slot batch, and its
recovery to what the target accepted.

The draft holds a prefix of the target's tokens; a joint row drafting k first feeds what it
lacks (at least the pending token y) in one forward, then proposes one token a forward. Rows not
drafting this round ride along with width 0 (their state is left as it was). After each forward
the recurrent arrays are kept by reference, so each row's state after its accepted length is
picked, not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import mlx.core as mx

from worker.batch.rows import Row
from worker.batch.select import context, simple
from worker.batch.slotbatch import SlotBatch
from worker.joint.sampling import token_probs
from worker.sampling import process

CATCH_UP_LAG = 4  # a draft lagging more tokens than this first feeds them in a forward of their own
CATCH_UP_WIDTH = 8  # off the CPU that forward's width is a power of two from this: its shapes recur (a GPU
CATCH_UP_PADDED = mx.default_device() != mx.cpu  # builds a graph for each new one; the CPU builds none)
CATCH_UP_WARMED = 256  # the warm-up plays each padded catch-up width up to this one
STEPS_BYTES = max(1 << 30, mx.device_info().get("memory_size", 0) // 32)  # a round keeps its draft's
# states after each forward while they take at most this (1 GiB, or 1/32 of the device's memory)


@dataclass
class Drafts:
    """A round's proposals: `tokens` [B, K] in the draft batch's decode order (past a row's k:
    padding), each row's k, its draft probabilities (sampled rows) and how to recover."""

    ids: list[str]
    ks: list[int]
    tokens: mx.array
    probs: dict[str, list] = field(default_factory=dict)
    lags: list[int] = field(default_factory=list)  # tokens each row fed before proposing (y among them)
    bases: list[int] = field(default_factory=list)  # each row's draft length before the round
    before: list = field(default_factory=list)  # the recurrent arrays before the round (a replay starts there)
    steps: list = field(default_factory=list)  # the recurrent arrays after each forward (when they fit STEPS_BYTES)

    def k(self, rid: str) -> int:
        return self.ks[self.ids.index(rid)] if rid in self.ids else 0


def lag(batch: SlotBatch, row: Row) -> int:
    """Tokens the row's draft must feed before its first proposal (the pending one among them)."""
    return len(row.seq) + 1 - batch.lengths[row.id]


def catch_up(batch: SlotBatch, ids: list[str], rows: dict[str, Row], ks: list[int]) -> int:
    """Drafting rows more than CATCH_UP_LAG behind feed all they lack but the pending token, in
    one forward of the slots from the first such row to the last (`ids` in slot order: the rows
    outside them are not computed at all); the tokens fed (0: none was behind)."""
    feeds = [row.seq[batch.lengths[rid]:] if k and lag(batch, row) > CATCH_UP_LAG else []
             for rid, k, row in ((r, k, rows[r]) for r, k in zip(ids, ks))]
    behind = [i for i, f in enumerate(feeds) if f]
    if not behind:
        return 0
    span = slice(behind[0], behind[-1] + 1)
    feeds, width = feeds[span], catch_up_width(max(map(len, feeds)))
    x = mx.array([f + [0] * (width - len(f)) for f in feeds])
    f = batch.forward(ids[span], x, [len(f) for f in feeds])
    batch.commit(f, [len(f) for f in feeds])
    return sum(map(len, feeds))


def catch_up_width(n: int) -> int:
    """The padded width of a catch-up forward whose longest row feeds n tokens."""
    if not CATCH_UP_PADDED:
        return n
    width = CATCH_UP_WIDTH
    while width < n:
        width *= 2
    return width


def propose(batch: SlotBatch, ids: list[str], rows: dict[str, Row], ks: list[int], ys: mx.array) -> Drafts:
    """Proposes ks[i] tokens for each of the draft batch's decode rows `ids` (ys [B]: their
    pending tokens, still computing or known)."""
    bases = [batch.lengths[r] for r in ids]
    lags = [lag(batch, rows[r]) if k else 0 for r, k in zip(ids, ks)]
    width = max(lags)
    known = [rows[r].seq[b:] + [0] * (width - n + 1) for r, b, n in zip(ids, bases, lags)]
    x = mx.array([kn[:width] for kn in known], dtype=mx.uint32)
    at = [max(n - 1, 0) for n in lags]
    x[mx.arange(len(ids)), mx.array(at)] = ys.astype(mx.uint32)  # each row's pending token after what it lacks
    drafts = Drafts(ids, ks, mx.zeros((len(ids), 0), mx.uint32), lags=lags, bases=bases,
                    before=batch.recurrent_rows(batch.span(ids)))
    keep_steps = _nbytes(drafts.before) * (max(ks) - 1) <= STEPS_BYTES
    chosen, widths = [], lags
    if width > 1 and len(ids) > 1 and batch.one_token_rows:
        x, widths = _feed_lacking(batch, ids, x, lags, ys)
    for j in range(max(ks)):
        f = batch.forward(ids, x, widths)
        batch.commit(f, widths)
        if keep_steps:  # the states by reference: recovery picks each row's (a replay costs a forward)
            drafts.steps.append(batch.recurrent_rows(f.span))
        last = mx.array([max(w - 1, 0) for w in widths]) if j == 0 else mx.zeros(len(ids), mx.int32)
        logits = f.logits[mx.arange(len(ids)), last]
        toks = _choose(rows, ids, ks, j, logits, ys, chosen, drafts)
        chosen.append(toks)
        if mx.default_device() != mx.cpu:  # the device runs this step while the next one's graph is built
            mx.async_eval(toks)
        x = toks[:, None]
        widths = [int(j + 1 < k) for k in ks]
    drafts.tokens = mx.stack(chosen, axis=1) if chosen else drafts.tokens
    return drafts


def _feed_lacking(batch: SlotBatch, ids: list[str], x: mx.array, lags: list[int], ys: mx.array):
    """Feeds what each row lacks before its pending token in a forward of its own (a draft lags
    two tokens after a round that kept every proposal), so the first proposing step is one token
    a row; returns that step's tokens and widths."""
    before = [max(n - 1, 0) for n in lags]
    f = batch.forward(ids, x[:, : max(before)], before)
    batch.commit(f, before)
    return ys.astype(mx.uint32)[:, None], [min(n, 1) for n in lags]


def _choose(rows: dict[str, Row], ids: list[str], ks: list[int], j: int, logits: mx.array, ys: mx.array,
            chosen: list[mx.array], drafts: Drafts) -> mx.array:
    """Step j's proposal of every row [B] (rows past their k: anything)."""
    live = [i for i, k in enumerate(ks) if j < k]
    if all(simple(rows[ids[i]]) and rows[ids[i]].chooser is None for i in live):
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    out: list = []
    for i, (rid, k) in enumerate(zip(ids, ks)):
        if j >= k:
            out.append(0)
            continue
        row = rows[rid]
        lg = logits[i]
        ctx = context(row, ys[i: i + 1], *[c[i] for c in chosen])
        if ctx is not None:
            lg = process(row.sampling.processors, ctx, lg[None])[0]
        if row.chooser is not None:
            tok, q = row.chooser(lg, row.output_position + 1 + j)
        elif row.sampling.params.greedy:
            tok, q = mx.argmax(lg, keepdims=True), None
        else:
            q = token_probs(lg, row.sampling.params)
            tok = mx.random.categorical(mx.log(q), key=row.key())[None]
        drafts.probs.setdefault(rid, []).append(q)
        out.append(tok)
    if all(isinstance(t, int) for t in out):  # choices made on the host: the logits are still computed
        return mx.depends(mx.array(out, dtype=mx.uint32), logits)
    return mx.concatenate([mx.array([t], dtype=mx.uint32) if isinstance(t, int) else t.reshape(1).astype(mx.uint32)
                           for t in out])


def recover(batch: SlotBatch, drafts: Drafts, rows: dict[str, Row], accepted: dict[str, int]) -> None:
    """Each drafting row's draft keeps what it fed that the target kept: what it lacked and its
    proposals up to the first rejected one (the last proposal it never fed). A row that fed a
    rejected proposal takes its state after the forward that fed its last kept token (kept by
    reference), or, where the round kept none, goes back to its state before the round and feeds
    the kept ones again, in one forward for all such rows."""
    ids = drafts.ids
    keep = [lag + min(accepted.get(r, 0), k - 1) if k else 0 for r, k, lag in zip(ids, drafts.ks, drafts.lags)]
    back = [bool(k) and n < lag + k - 1 for k, n, lag in zip(drafts.ks, keep, drafts.lags)]
    if not any(back):
        return
    if drafts.steps:
        last = len(drafts.steps) - 1
        at = [n - lag if b else last for n, lag, b in zip(keep, drafts.lags, back)]
        batch.put_recurrent(ids, _pick(drafts.steps, at))
        for r, base, n, b in zip(ids, drafts.bases, keep, back):
            if b:
                batch.lengths[r] = base + n
        return
    mask = mx.array(back)
    now = batch.recurrent_rows(batch.span(ids))
    batch.put_recurrent(ids, [[a if a is None else mx.where(_rows(mask, a), mx.zeros_like(a) if o is None else o, a)
                               for o, a in zip(old, cur)] for old, cur in zip(drafts.before, now)])
    widths = [n if b else 0 for n, b in zip(keep, back)]
    width = max(widths)
    feeds = [rows[r].seq[base: base + w] for r, base, w in zip(ids, drafts.bases, widths)]
    x = mx.array([f + [0] * (width - len(f)) for f in feeds], dtype=mx.uint32)
    offsets = [base if b else batch.lengths[r] for r, base, b in zip(ids, drafts.bases, back)]
    batch.commit(batch.forward(ids, x, widths, offsets=offsets), widths)


def _pick(steps: list, at: list[int]) -> list:
    """Each recurrent layer's arrays with row i taken from steps[at[i]]."""
    js = sorted(set(at))
    if len(js) == 1:
        return steps[js[0]]
    sel = mx.array(at)
    out = []
    for e, layer in enumerate(steps[js[-1]]):
        arrays = []
        for a_i, a in enumerate(layer):
            for j in js[:-1] if a is not None else []:
                a = mx.where(_rows(sel == j, a), steps[j][e][a_i], a)
            arrays.append(a)
        out.append(arrays)
    return out


def _nbytes(arrays: list) -> int:
    return sum(a.nbytes for layer in arrays for a in layer if a is not None)


def _rows(mask: mx.array, like: mx.array) -> mx.array:
    return mask.reshape((-1,) + (1,) * (like.ndim - 1))
