"""The round: prompt chunks of the rows that prefill, then one target forward of every decoding
row, a plain row feeding its pending token and a drafting row [y, d1..dk], right-padded to the
widest (docs/design.md, "The batch engine").

Each row's caches hold every token it has read but its pending one, the target's own next
token. A plain round is pipelined: its forward is queued on the pending tokens while they are
still computing, and the tokens it reads are those of the round before (as mlx-lm's
generate_step does). A drafting round reads its verify at once: acceptance decides what each
row keeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from worker.batch import drafts as dr
from worker.batch import select
from worker.batch.rows import CycleStats, Pending, Phase, Row, RowOutcome, advance
from worker.batch.slotbatch import SlotBatch
from worker.kernels import kv_write
from worker.kvformat import NATIVE, KVFormat
from worker.prefill_cost import PrefillCost, default_bound_s
from worker.joint.sampling import make_key_fn
from worker.round import CycleReport, Paid, RoundInput, RoundReport, RowState, SetApart
from worker.sampling import RowSampling
from worker.sampling import chosen as chosen_of
from worker.state.checkpoint import install_recording

WARM = "\x00warm"  # the warm-up's row
DRAFT_TIMED_EVERY = 8  # off the CPU, one drafting round in this many waits for its draft, so its step is timed
ROWS_PADDED = mx.default_device() != mx.cpu  # off the CPU a decoding row that leaves keeps its slot in the
# target's forwards (fed a token nobody reads) until the rows left fill a power of two: a forward's row count
# recurs (a GPU builds graphs for each new one; docs/design.md, "Padding slots")


@dataclass
class Decoded:
    """A round's decode: each row's outcome, the joint rows' cycles, what was paid apart."""

    outcomes: list[RowOutcome] = field(default_factory=list)
    cycles: list[CycleReport] = field(default_factory=list)
    apart: dict[SetApart, Paid] = field(default_factory=dict)
    draft_s: float = 0.0


@dataclass
class Round:
    """A round begun: the rows decoding in it, their plan, when its decode began."""

    decoding: list[str]
    started: float
    prefilled: bool
    decoded: Decoded = field(default_factory=Decoded)

    def report(self) -> RoundReport:
        """The round as the scheduler reads it: its time since its decode began (the caller's
        handling of its tokens included), less what was paid apart."""
        d = self.decoded
        seconds = time.perf_counter() - self.started - sum(p.seconds for p in d.apart.values())
        reason = SetApart.PREFILL_OR_ERROR if self.prefilled and not self.decoding else None
        return RoundReport(seconds, reason, dict(d.apart), d.draft_s, d.cycles)


def play(runner: "BatchRunner", planner, tokens_left: Callable[[str], int]) -> Round:
    """One round: prompt chunks, then the plan of the decoding rows' drafts and their forward.
    `tokens_left(row id)`: what each row may still emit. The engine and the benches run it."""
    prefilled = bool(runner.prefill())
    rnd = Round(runner.decoding(), time.perf_counter(), prefilled)
    states = runner.states({rid: tokens_left(rid) for rid in rnd.decoding})
    plan = planner.plan_round(RoundInput(states, len(rnd.decoding), pipelined=False))
    rnd.decoded = runner.decode(plan.budgets)
    return rnd


class BatchRunner:
    """The batch of rows over a target (and a draft): `join`, `leave`, `prefill`, `states`,
    `decode`. No sockets and no scheduler: the engine plans each round's drafts."""

    def __init__(self, target, draft=None, prefill_step: int = 512, recovery: str = "fast", draft_forward=None,
                 kv: KVFormat = NATIVE):
        """`kv`: the target's attention KV format; the draft's stays native (docs/memory.md, "Quantized KV")."""
        if recovery not in ("fast", "replay"):
            raise ValueError("recovery must be fast or replay")
        for model in (target, draft):  # fast recovery's recording (on a CUDA GPU, its kernel too)
            if model is not None:
                install_recording(model)
        self.target = SlotBatch(target, kv=kv)
        self.draft = SlotBatch(draft, draft_forward, one_token_rows=draft_forward is not None) if draft is not None else None
        self.prefill_step, self.recovery = prefill_step, recovery
        self.cost = PrefillCost(prefill_step, default_bound_s())  # each round's chunk by its cost (worker/prefill_cost.py)
        self.rows: dict[str, Row] = {}
        self._last: Optional[tuple[list[str], mx.array]] = None  # the last plain round's rows and tokens
        self._drafting_rounds = 0

    def warm(self, tokens: list[int], widest: int, every_shape: Optional[bool] = None) -> None:
        """Runs every forward width serving uses once (verifies up to `widest`, recorded; the
        draft's first steps), on a row of its own that then leaves: a GPU compiles a kernel the
        first time it meets a shape, which would stall a round. Only on an empty batch.
        `every_shape`: also the rounds whose shapes only a GPU builds for (default: off the CPU)."""
        for batch, widths, record in ((self.target, range(1, widest + 1), self.draft is not None),
                                      (self.draft, range(1, dr.CATCH_UP_LAG + 1), False)):
            if batch is None or len(batch):
                continue
            batch.add(WARM, None, 0)
            for w in widths:
                f = batch.forward([WARM], mx.array([tokens[:w]], dtype=mx.uint32), [w], record=record)
                batch.commit(f, [1] if record else [w])
                mx.eval(batch.arrays())
            if batch is self.draft and dr.CATCH_UP_PADDED and tokens:
                self._warm_catch_ups(tokens)
            batch.remove(WARM)
        self._warm_rounds(tokens, widest, mx.default_device() != mx.cpu if every_shape is None else every_shape)

    def _warm_catch_ups(self, tokens: list[int]) -> None:
        """The draft's catch-up forwards on one row at their padded widths up to CATCH_UP_WARMED
        (a real width one short: the masked path a catch-up takes)."""
        width = dr.catch_up_width(dr.CATCH_UP_LAG + 1)
        while width <= dr.CATCH_UP_WARMED:
            fed = (tokens * (width // len(tokens) + 1))[: width - 1]
            f = self.draft.forward([WARM], mx.array([fed + [0]], dtype=mx.uint32), [width - 1])
            self.draft.commit(f, [width - 1])
            mx.eval(self.draft.arrays())
            width = dr.catch_up_width(width + 1)

    def _warm_rounds(self, tokens: list[int], widest: int, gpu: bool) -> None:
        """A plain round, then drafting rounds at the narrowest and widest depth, of two joint rows
        of unequal lengths, and off the CPU of one joint row at every depth (its draft takes the
        one-launch step) and of 3 and 5 rows (the draft's launch of many rows pads to 4 and 8):
        what a round compiles (gathers, scatters, recovery) the first time it runs at a shape
        (seconds on a GPU: docs/benchmarks.md, "Shapes on a GPU")."""
        if self.draft is None or self.rows or len(tokens) < 16:
            return
        one_row, many = (range(1, widest), [1]) if gpu else ((), ())
        for rows, depths in ((2, sorted({0, 1, widest - 1})), (1, one_row), (3, many), (5, many)):
            if depths:
                self._warm_joint(tokens, rows, [{i: k for i in range(rows)} for k in depths])
        if gpu:  # rows left behind past CATCH_UP_LAG catch up while others ride at width 0
            self._warm_joint(tokens, 4, [{}] * (dr.CATCH_UP_LAG + 1) + [{0: 2}, {0: 1, 1: 2}])

    def _warm_joint(self, tokens: list[int], rows: int, plans: list[dict[int, int]]) -> None:
        """Rounds of `rows` joint rows of unequal lengths, each plan drafting k for row i."""
        ids = [f"{WARM}{i}" for i in range(rows)]
        for i, rid in enumerate(ids):
            self.join(Row(rid, tokens[: len(tokens) - 3 * i], RowSampling(), make_key_fn(0), joint=True))
        while any(self.rows[rid].phase == Phase.PREFILL for rid in ids):
            self.prefill()
        for plan in plans:
            self.decode({ids[i]: k for i, k in plan.items()})
            mx.eval(self.target.arrays(), self.draft.arrays())
        for rid in ids:
            self.leave(rid)
        self._fit_padding(0)

    # ---- membership ----

    def join(self, row: Row, cache: Optional[list] = None, cached: int = 0,
             draft_cache: Optional[list] = None, draft_cached: int = 0) -> None:
        """A row joins to prefill its prompt past the `cached` tokens its caches hold."""
        if row.joint and self.draft is None:
            raise ValueError("a joint row needs a draft")
        if row.id in self.target and row.id not in self.rows:  # its old slot is padding still
            self.target.remove(row.id)
        cached = min(cached, len(row.prompt) - 1) if cache is not None else 0
        row.fed, row.seq = cached, list(row.prompt[:-1])
        self.rows[row.id] = row
        self.target.add(row.id, cache, cached, row.rolling)
        if row.joint:
            row.draft_fed = min(draft_cached, cached) if draft_cache is not None else 0
            self.draft.add(row.id, draft_cache, row.draft_fed, row.rolling)
            row.stats = row.stats or CycleStats()

    def leave(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is None:
            return
        decoding = row.phase == Phase.DECODE
        row.phase = advance(row.phase, Phase.DONE) if row.phase != Phase.DONE else row.phase
        if not (decoding and ROWS_PADDED):  # else its slot stays, padding
            self.target.remove(rid)
        if self.draft is not None:
            self.draft.remove(rid)
        self._fit_padding(len(self.decoding()))

    @property
    def padding(self) -> list[str]:
        """The target's slots of rows that left: they ride in its forwards (ROWS_PADDED)."""
        return [r for r in self.target.order if r not in self.rows]

    def _fit_padding(self, live: int) -> None:
        """Padding slots stay while they and the `live` decoding rows fill the power of two those
        rows need (none once no row decodes)."""
        fill = 1 << max(live - 1, 0).bit_length() if live else 0
        for rid in self.padding[max(0, fill - live):]:
            self.target.remove(rid)

    def decoding(self) -> list[str]:
        return [r for r in self.target.order if r in self.rows and self.rows[r].phase == Phase.DECODE]

    def prefill_next(self) -> int:
        """Prompt tokens the next round prefills."""
        return sum(len(self._chunk(r)) for r in self.rows.values() if r.phase == Phase.PREFILL)

    def held(self, rid: str) -> tuple[list[int], list, Optional[list], int]:
        """What a row's caches hold: its tokens, the target's caches, the draft's and their length."""
        row = self.rows[rid]
        tokens = row.seq[: self.target.lengths[rid]]
        if not row.joint:
            return tokens, self.target.row_cache(rid), None, 0
        return tokens, self.target.row_cache(rid), self.draft.row_cache(rid), self.draft.lengths[rid]

    # ---- prefill ----

    def _chunk(self, row: Row) -> list[int]:
        stop = min([row.fed + self.prefill_step, len(row.prompt) - 1] + [b for b in row.boundaries if b > row.fed])
        return row.prompt[row.fed: stop]

    def prefill(self) -> float:
        """One chunk of each prefilling row's prompt (its draft fed in step); rows whose prompt is
        in move to decoding. Returns the seconds it took (evaluated: it is paid apart)."""
        rows = [r for r in self.rows.values() if r.phase == Phase.PREFILL]
        if not rows:
            return 0.0
        depth = max(r.fed for r in rows)
        self.prefill_step = self.cost.chunk_tokens(depth, len(rows))  # at most the configured chunk, by its cost
        t0 = time.perf_counter()
        chunks = {r.id: self._chunk(r) for r in rows}
        self._feed(self.target, chunks, {r.id: r.fed for r in rows})
        for r in rows:
            r.fed += len(chunks[r.id])
        if self.draft is not None:
            joint = {r.id: r.prompt[r.draft_fed: r.fed] for r in rows if r.joint}
            self._feed(self.draft, joint, {r.id: r.draft_fed for r in rows if r.joint})
            for r in rows:
                r.draft_fed = r.fed if r.joint else 0
        mx.eval([a for b in (self.target, self.draft) if b is not None for a in b.arrays()])
        for r in rows:
            if r.fed in r.boundaries and r.on_boundary is not None:
                joint = r.joint and self.draft is not None
                r.on_boundary(r.fed, self.target.row_cache(r.id), self.draft.row_cache(r.id) if joint else None,
                              r.draft_fed if joint else 0)
            if r.fed == len(r.prompt) - 1:
                r.phase = advance(r.phase, Phase.DECODE)
                r.pending = Pending(r.prompt[-1], emit=False)
        seconds = time.perf_counter() - t0
        self.cost.observe(depth, max(len(c) for c in chunks.values()), len(rows), seconds)
        return seconds

    def _feed(self, batch: SlotBatch, chunks: dict[str, list[int]], fed: dict[str, int]) -> None:
        """One forward of the rows' chunks (rows of none sit it out) in the batch's rows after
        its decoding ones."""
        decoding = {r for r in batch.order if r not in self.rows or self.rows[r].phase == Phase.DECODE}  # padding too
        batch.arrange(decoding)
        ids = [r for r in batch.order if r not in decoding]
        if not ids or not any(chunks.get(r) for r in ids):
            return
        widths = [len(chunks.get(r, [])) for r in ids]
        width = max(widths)
        x = mx.array([chunks.get(r, []) + [0] * (width - w) for r, w in zip(ids, widths)], dtype=mx.uint32)
        batch.commit(batch.forward(ids, x, widths), widths)

    # ---- decode ----

    def states(self, tokens_left: dict[str, int]) -> list[RowState]:
        """The decoding joint rows as the scheduler reads them (`tokens_left`: what each may
        still emit). A round emits a row's pending token and its accepted drafts, and leaves it
        the target's own next, which the verify computes anyway: a row can use as many drafts
        as it may emit tokens after its pending one."""
        out = []
        for rid in self.decoding():
            row = self.rows[rid]
            if not row.joint:
                continue
            left = tokens_left[rid] - int(row.pending.emit)
            out.append(RowState(rid, room=max(0, left), lag=dr.lag(self.draft, row),
                                has_drafted=row.drafted_once, last=left <= 0))
        return out

    def decode(self, plan: dict[str, int]) -> Decoded:
        """The round's forward of every decoding row; `plan`: drafts per joint row."""
        self._fit_padding(len(self.decoding()))
        self.target.arrange({r for r in self.target.order if r not in self.rows or self.rows[r].phase == Phase.DECODE})
        ids = self.decoding()
        if not ids:
            return Decoded()
        ks = [plan.get(r, 0) if self.rows[r].joint else 0 for r in ids]
        ys = self._pending_tokens(ids)
        if not any(ks):
            return self._plain(ids, ys)
        return self._drafting(ids, ks, ys)

    def _plain(self, ids: list[str], ys: mx.array) -> Decoded:
        """Pipelined: the next tokens are queued before the pending ones are read."""
        rows = [self.rows[r] for r in ids]
        f = self._forward(ids, ys[:, None], [1] * len(ids))
        tokens, lps = select.plain(rows, f.logits[:, 0], ys)
        if kv_write.settles():
            mx.synchronize()
        mx.async_eval(tokens, *[lp for lp in lps if lp is not None])
        self._commit(f, ids, [1] * len(ids))
        values = ys.tolist()
        out = Decoded()
        for i, (row, y) in enumerate(zip(rows, values)):
            out.outcomes.append(self._read(row, y))
            row.pending = Pending((tokens, i), logprobs=lps[i])
            if row.joint:
                row.stats.cycles += 1
        self._last = (list(ids), tokens)
        return out

    def _drafting(self, ids: list[str], ks: list[int], ys: mx.array) -> Decoded:
        out = Decoded()
        self._drafting_rounds += 1
        jids = self.draft.arrange({r for r in ids if self.rows[r].joint})
        where = {r: i for i, r in enumerate(ids)}
        jks = [ks[where[r]] for r in jids]
        if kv_write.settles():
            mx.synchronize()
        t0 = time.perf_counter()
        fed = dr.catch_up(self.draft, jids, self.rows, jks)
        if fed:
            mx.eval(self.draft.arrays())
            out.apart[SetApart.DRAFT_CATCH_UP] = Paid(time.perf_counter() - t0, fed, 1)
        t1 = time.perf_counter()
        drafts = dr.propose(self.draft, jids, self.rows, jks, ys[mx.array([where[r] for r in jids])])
        if mx.default_device() == mx.cpu or self._drafting_rounds % DRAFT_TIMED_EVERY == 1:
            mx.eval(drafts.tokens)
            out.draft_s = time.perf_counter() - t1
        else:  # the device runs the draft while the verify's graph is built
            mx.async_eval(drafts.tokens)
        width = 1 + max(ks)
        x = self._verify_inputs(ids, jids, drafts.tokens, ys, width)
        f = self._forward(ids, x, [1 + k for k in ks], record=self.recovery == "fast")
        keep, accepted = self._accept(ids, ks, ys, drafts, f, out)
        t2 = time.perf_counter()
        self._commit(f, ids, keep)
        dr.recover(self.draft, drafts, self.rows, accepted)
        if mx.default_device() == mx.cpu:
            mx.eval(self.target.arrays(), self.draft.arrays())
        else:  # the device takes what each row kept while the host plans the next round
            mx.async_eval(self.target.arrays(), self.draft.arrays())
        for rid in accepted:
            if accepted[rid] < drafts.k(rid):
                self.rows[rid].stats.recovery_s += time.perf_counter() - t2
        self._last = None
        return out

    def _forward(self, ids: list[str], x: mx.array, widths: list[int], record: bool = False):
        """The target's forward of the decoding rows `ids` (x [B, W], in slot order) with the
        padding slots among them, each fed token 0 at width 1; its logits are the rows' of `ids`."""
        slots = self.target.order[: len(ids) + len(self.padding)]
        if slots == ids:
            return self.target.forward(ids, x, widths, record=record)
        at = {r: i for i, r in enumerate(ids)}
        picks = mx.array([at.get(r, len(ids)) for r in slots])
        xs = mx.concatenate([x, mx.zeros((1, x.shape[1]), x.dtype)])[picks]
        f = self.target.forward(slots, xs, [widths[at[r]] if r in at else 1 for r in slots], record=record)
        f.logits = f.logits[mx.array([i for i, r in enumerate(slots) if r in at])]
        return f

    def _commit(self, f, ids: list[str], keep: list[int]) -> None:
        """Each row of `ids` keeps keep[i] positions of the forward; a padding slot its one."""
        if f.ids != ids:
            at = {r: k for r, k in zip(ids, keep)}
            keep = [at.get(r, 1) for r in f.ids]
        self.target.commit(f, keep)

    def _verify_inputs(self, ids: list[str], jids: list[str], proposed: mx.array, ys: mx.array, width: int) -> mx.array:
        """[B, width]: each row's pending token, then its proposals (padding past them)."""
        where = {r: i for i, r in enumerate(jids)}
        rows = mx.array([where.get(r, len(jids)) for r in ids])
        pad = mx.zeros((1, proposed.shape[1]), proposed.dtype)
        drafts = mx.concatenate([proposed, pad])[rows][:, : width - 1]
        return mx.concatenate([ys[:, None].astype(mx.uint32), drafts.astype(mx.uint32)], axis=1)

    def _accept(self, ids: list[str], ks: list[int], ys: mx.array, drafts: dr.Drafts, f, out: Decoded
                ) -> tuple[list[int], dict[str, int]]:
        """Reads the round and decides what each row keeps."""
        rows = [self.rows[r] for r in ids]
        plain_at = [i for i, k in enumerate(ks) if not k]
        nxt, lps = select.plain([rows[i] for i in plain_at], f.logits[mx.array(plain_at), 0], ys[mx.array(plain_at)]) \
            if plain_at else (None, [])
        choices = mx.argmax(f.logits, axis=-1)
        mx.eval(drafts.tokens, ys, choices)  # the round's one wait
        draft_rows = {r: i for i, r in enumerate(drafts.ids)}
        proposed = drafts.tokens.tolist()
        values, choice_rows = ys.tolist(), choices.tolist()
        keep, accepted = [], {}
        for i, (row, k, y) in enumerate(zip(rows, ks, values)):
            outcome = self._read(row, y)
            if not k:
                keep.append(1)
                out.outcomes.append(outcome)
                continue
            drafted = proposed[draft_rows[row.id]][:k]
            n = self._verify(row, i, k, drafted, drafts, f, choice_rows[i], outcome)
            keep.append(1 + n)
            accepted[row.id] = n
            out.outcomes.append(outcome)
            out.cycles.append(CycleReport(row.id, k, n))
        for j, i in enumerate(plain_at):
            rows[i].pending = Pending((nxt, j), logprobs=lps[j])
            if rows[i].joint:
                rows[i].stats.cycles += 1
        return keep, accepted

    def _verify(self, row: Row, i: int, k: int, drafted: list[int], drafts: dr.Drafts, f, choices: list[int],
                outcome: RowOutcome) -> int:
        """A drafting row's acceptance: its outcome gets the accepted drafts, its pending the
        target's own next token; returns how many drafts it accepted."""
        simple = select.simple(row)  # its verify's argmax is the batch's: its logits are not read
        logits = None if simple else select.processed(row, f.logits[i, : k + 1], mx.array(drafted))
        n, own = select.accept(row, drafted, drafts.probs.get(row.id, []), logits, choices if simple else None,
                               row.output_position)
        lp = select.log_softmax(logits[: n + 1]) if row.sampling.logprobs is not None else None
        for j, d in enumerate(drafted[:n]):
            outcome.tokens.append(d)
            outcome.drafted.append(True)
            if lp is not None:
                outcome.chosen.append(chosen_of(lp[j], d, row.sampling.logprobs))
        row.seq += drafted[:n]
        row.pending = Pending(own, logprobs=None if lp is None else lp[n])
        row.stats.record(k, n)
        row.drafted_once = True
        return n

    def _read(self, row: Row, y: int) -> RowOutcome:
        """A row's pending token, now read: into its tokens (and its outcome when it is emitted)."""
        out = RowOutcome(row.id)
        p = row.pending
        if p.emit:
            out.tokens.append(y)
            out.drafted.append(False)
            if p.logprobs is not None and row.sampling.logprobs is not None:
                out.chosen.append(chosen_of(p.logprobs, y, row.sampling.logprobs))
        row.seq.append(y)
        return out

    def _pending_tokens(self, ids: list[str]) -> mx.array:
        """The rows' pending tokens [B]: the last plain round's array where the rows are the
        same, else gathered from their arrays and the known ones."""
        if self._last is not None and self._last[0] == ids and all(
                _points_at(self.rows[r].pending.token, self._last[1], i) for i, r in enumerate(ids)):
            return self._last[1]  # the same rows, each pending on its place in the last plain round's tokens
        known, sources = [], {}
        for i, rid in enumerate(ids):
            t = self.rows[rid].pending.token
            if isinstance(t, int):
                known.append((i, t))
            else:
                sources.setdefault(id(t[0]), (t[0], []))[1].append((i, t[1]))
        parts, at = [], []
        for array, items in sources.values():
            parts.append(array[mx.array([j for _, j in items])].astype(mx.uint32))
            at += [i for i, _ in items]
        if known:
            parts.append(mx.array([t for _, t in known], dtype=mx.uint32))
            at += [i for i, _ in known]
        flat = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        if at == list(range(len(ids))):
            return flat
        inverse = [0] * len(ids)
        for j, i in enumerate(at):
            inverse[i] = j
        return flat[mx.array(inverse)]


def _points_at(token, array: mx.array, i: int) -> bool:
    return isinstance(token, tuple) and token[0] is array and token[1] == i
