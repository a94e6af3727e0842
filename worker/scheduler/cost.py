"""The cost model: measured round times by cell (N requests, B drafted, D deepest), at the
machine's pace; docs/scheduler.md, "The cost table"."""

from __future__ import annotations

from collections import deque
from typing import Sequence

from worker.round import CATCH_UP, PIPELINE, Cell, SetApart

WINDOW = 32  # measurements kept per cell (and catch-ups, draft steps)
MAX_AGE = 256  # rounds after which a drafting cell's rounds expire, where it has fewer than MIN_SAMPLES
STALE_GAP = 32  # rounds without a measurement after which a cell of few rounds starts anew on a cheaper one
STALL_FACTOR = 10.0  # a round this many times its cell's median is a stall: set apart
FIRST_STALL_FACTOR = 10.0  # a cell's first round this many times the plain round per token it may emit: a stall
CATCH_UP_REASONS = CATCH_UP  # set-apart costs a probe pays besides its round
DISCARD_REASONS = (SetApart.LOOK_AHEAD_DISCARDED,)  # ... and, batched after pipelined plain rounds, the forward it discards
PIPELINE_REASONS = PIPELINE  # what stopping costs where plain rounds are pipelined
TAKEN_REASONS = (SetApart.LOOK_AHEAD_TAKEN,)  # ... where a drafting cycle takes that forward's token instead: the wait for it
MIN_SAMPLES = 3  # rounds a cell needs before its median is trusted over its neighbours
FEW_ROUNDS = 2 * MIN_SAMPLES  # a deeper drafting cell measured fewer times, then left STALE_GAP rounds, is measured again
PACE_BOUND = 1.5  # one round's reading moves the pace at most this factor
PACE_WINDOW = 8  # rounds whose pace (time / its cell's normalised median) the machine's pace is the median of
SET_APART_KEPT = 1024  # set-apart rounds remembered (catch-up costs are read from them)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class CostModel:
    """A table C(N, B, D) of median round times over a sliding window, at the machine's pace
    (docs/scheduler.md, "The cost table").

    Measured whole: costs are staircases. A round enters one round late: `observe` holds it until
    the next `commit`, so a round later found interrupted (`interrupt`) never enters the table;
    switching costs and rounds that are no sample of their cell are `set_aside`. Every figure is
    kept normalised by the machine's pace (`pace`: the median, over the last PACE_WINDOW rounds
    of cells of MIN_SAMPLES rounds or more, of each round's time / its cell's normalised median,
    each reading moving it at most PACE_BOUND); a cell is priced at its normalised median × the
    pace now. A cell measured fewer than FEW_ROUNDS times in all, measured again after STALE_GAP
    rounds without a measurement, cheaper than every round it holds, starts anew; no cheaper, its
    figure is confirmed (`_seldom_measured` leaves it). How the table is read
    (interpolated, bounded by cells that do more work): table.py.
    """

    PRIOR_SLOPE = 0.25  # a depth more, with one drafting depth measured: this share of a plain round (the table's interpolation)

    def __init__(self):
        self.cells: dict[Cell, list[tuple[int, float]]] = {}  # (round, seconds)
        self.measured: dict[Cell, int] = {}  # rounds each cell was measured in all (none forgotten)
        self.confirmed: set[Cell] = set()  # cells a fresh round after STALE_GAP rounds did not undercut
        self.rounds = 0
        self.pending: tuple[Cell, float, float] | None = None  # (cell, seconds, drafting seconds)
        self.set_apart: deque[tuple[Cell, float, SetApart | str]] = deque(maxlen=SET_APART_KEPT)  # interrupted, partial or stalled rounds
        self.fed: deque = deque(maxlen=SET_APART_KEPT)  # catch-ups timed with what they fed: (N, seconds, tokens, pieces)
        self.draft_steps: dict[int, deque] = {}  # by N: a drafting round's drafting seconds ÷ its depth
        self.pace = 1.0  # the machine's pace now, against the normalised figures' (see above)
        self.paces: deque = deque(maxlen=PACE_WINDOW)  # the last rounds' own paces

    def observe(self, key: Cell, seconds: float, draft_s: float = 0.0) -> None:
        self.commit()
        self.rounds += 1
        self.pending = (key, seconds, draft_s)

    def interrupt(self, reason: SetApart | str) -> None:
        if self.pending is not None:
            self.set_aside(*self.pending[:2], reason)
            self.pending = None

    def set_aside(self, key: Cell, seconds: float, reason: SetApart | str, fed: tuple[int, int] = (0, 0)) -> None:
        """Records a round's time (or a switching cost) apart from the table, normalised; `fed`:
        the tokens and pieces its drafts' catch-ups fed (see `feed_seconds`)."""
        self.set_apart.append((key, seconds / self.pace, reason))
        if fed[0] and reason in CATCH_UP_REASONS:
            self.fed.append((key.n, seconds / self.pace, *fed))

    def draft_step(self, n: int) -> float | None:
        """Median drafting seconds a depth of rounds with n requests (None: none measured)."""
        steps = self.draft_steps.get(n)
        return _median(steps) * self.pace if steps else None

    def draft_steps_now(self) -> dict[int, float]:
        """`draft_step` of every N measured."""
        return {n: self.draft_step(n) for n in sorted(self.draft_steps) if self.draft_steps[n]}

    def commit(self) -> None:
        if self.pending is None:
            return
        key, raw, draft_s = self.pending
        self.pending = None
        cell = self.cells.setdefault(key, [])
        seconds = raw / self.pace
        gap, least = (self.rounds - cell[-1][0], min(t for _, t in cell)) if cell else (0, 0.0)
        fresh = gap > STALE_GAP
        if fresh and seconds < least and self.measured.get(key, 0) < FEW_ROUNDS:
            cell.clear()  # a few early rounds priced it out: start anew (within their spread: one more round)
            self.confirmed.discard(key)
        if self.stalled(key, raw):
            self.set_apart.append((key, seconds, SetApart.STALL))
            return
        if fresh and cell:  # a fresh round no cheaper confirms the figure: not seldom measured (`_seldom_measured`)
            self.confirmed.add(key)
        if len(cell) >= MIN_SAMPLES:  # the pace this round shows, against its cell's figure, moving PACE_BOUND at most
            pace = raw / _median([t for _, t in cell])
            self.paces.append(min(max(pace, self.pace / PACE_BOUND), self.pace * PACE_BOUND))
            self.pace = _median(self.paces)
            seconds = raw / self.pace
        if key.d and draft_s > 0:
            self.draft_steps.setdefault(key.n, deque(maxlen=WINDOW)).append(draft_s / self.pace / key.d)
        cell.append((self.rounds, seconds))
        del cell[:-WINDOW]
        self.measured[key] = self.measured.get(key, 0) + 1

    def stalled(self, key: Cell, raw: float) -> bool:
        """A round no sample of its cell: many times the cell's median, or, as the cell's first
        round, many times a plain round's per token the round may emit (a GPU building kernels
        for a shape it meets the first time: docs/scheduler.md, "Stalls")."""
        cell = self.cells.get(key) or []
        if len(cell) >= 3:
            return raw / self.pace > STALL_FACTOR * _median([t for _, t in cell])
        plain = self.cells.get(Cell(key.n, 0, 0)) if key.b else None
        if cell or not plain or len(plain) < MIN_SAMPLES:
            return False
        return raw / self.pace > FIRST_STALL_FACTOR * _median([t for _, t in plain]) * (1 + key.d)

    def newest(self, key: Cell) -> int:
        """The round of the cell's newest measurement (0: none)."""
        cell = self.cells.get(key)
        return cell[-1][0] if cell else 0

    def catch_up_seconds(self, n: int, reasons: tuple[SetApart, ...] = CATCH_UP_REASONS) -> float | None:
        """Median of the last WINDOW costs of n requests set apart for one of `reasons` (by default
        a draft's catch-up, on the prompt or on the rounds it sat out: the catch-up alone where it
        was timed apart, else the whole round)."""
        xs = [t for key, t, why in self.set_apart if why in reasons and key.n == n][-WINDOW:]
        return _median(xs) * self.pace if xs else None

    def feed_seconds(self, n: int, tokens: int) -> float | None:
        """What a draft's catch-up of `tokens` costs with n requests, by the pieces and tokens it
        feeds, from the catch-ups timed with what they fed (`fit_feed`); fewer than MIN_SAMPLES of
        them: the median catch-up (docs/scheduler.md, "A catch-up is priced by what it will feed")."""
        if not tokens:
            return 0.0
        rows = [(t, k, p) for m, t, k, p in self.fed if m == n][-WINDOW:]
        if len(rows) < MIN_SAMPLES:
            return self.catch_up_seconds(n)
        per_piece, per_token = fit_feed(rows)
        return (per_piece * feed_pieces(tokens) + per_token * tokens) * self.pace

    def _live(self) -> dict[Cell, list[float]]:
        """Each cell's rounds, normalised: a drafting cell of fewer than MIN_SAMPLES rounds loses
        them after MAX_AGE rounds; one of more keeps them, priced at today's pace; a plain cell
        keeps its rounds however few (unmeasured, it would be priced as the cheapest drafting one)."""
        live = {key: [t for r, t in v if len(v) >= MIN_SAMPLES or not key.b or r > self.rounds - MAX_AGE]
                for key, v in sorted(self.cells.items())}
        self._cap_plain(live)
        return {key: v for key, v in live.items() if v}

    def _cap_plain(self, live: dict[Cell, list[float]]) -> None:
        """A plain round costs no more than a drafting round of its N less that round's drafting
        (the verify does the plain round's work and more): where a drafting cell has MIN_SAMPLES
        rounds newer than its plain cell's newest, the plain figure is capped at their median less
        D draft steps."""
        for n in {key.n for key in live}:
            plain, steps = live.get(Cell(n, 0, 0)), self.draft_steps.get(n)
            if not plain or not steps:
                continue
            step = _median(steps)  # normalised, as the cells are
            since = self.newest(Cell(n, 0, 0))
            bounds = []
            for key, cell in self.cells.items():
                fresh = [t for r, t in cell if r > since]
                if key.n == n and key.b and len(fresh) >= MIN_SAMPLES:
                    bounds.append(_median(fresh) - key.d * step)
            cap = min(bounds, default=None)
            if cap is not None and 0 < cap < _median(plain):
                live[Cell(n, 0, 0)] = [min(t, cap) for t in plain]

    def table_and_counts(self) -> tuple[dict[Cell, float], dict[Cell, int]]:
        live = self._live()
        table = {key: _median(v) * self.pace for key, v in live.items()}
        counts = {key: len(v) for key, v in live.items()}
        for key in self._contradicted(table, counts) + self._seldom_measured(table):
            counts[key] = 0
        return table, counts

    def _seldom_measured(self, table: dict[Cell, float]) -> list[Cell]:
        """Cells past the first drafting depth measured fewer than FEW_ROUNDS times in all (fresh
        starts included), none in the last STALE_GAP rounds, and no fresh round since confirmed their
        figure: their count reads 0, so `estimate` caps them by their neighbours and the next
        decision that prefers them measures them again."""
        return [key for key in self.cells
                if key.d >= 2 and self.measured.get(key, 0) < FEW_ROUNDS and self.rounds - self.newest(key) > STALE_GAP
                and key in table and key not in self.confirmed]

    def _contradicted(self, table: dict[Cell, float], counts: dict[Cell, int]) -> list[Cell]:
        """Drafting cells dearer than a measured one that does more work, unmeasured for STALE_GAP
        rounds: their count reads 0, so `estimate` prices them by their neighbours and the next
        decision that prefers them measures them again (a fresh round that confirms the figure
        keeps it for another STALE_GAP rounds)."""
        out = []
        for key, v in table.items():
            if key.b and self.rounds - self.newest(key) > STALE_GAP and any(
                    _dominates(k, *key) and counts[k] >= MIN_SAMPLES and w < v for k, w in table.items()):
                out.append(key)
        return out

    def table(self) -> dict[Cell, float]:
        """Medians of the cells' unexpired rounds (what decisions are logged with)."""
        return self.table_and_counts()[0]

    def counts(self) -> dict[Cell, int]:
        """Unexpired rounds in each cell of `table()` (0 where the ordering contradicts a stale cell)."""
        return self.table_and_counts()[1]


def _dominates(key: Cell, n: int, b: int, d: int) -> bool:
    """The cell does at least the work of (n, b, d), and more."""
    return key.n == n and key.b >= b and key.d >= d and (key.b, key.d) != (b, d)


def fit_feed(rows: Sequence[tuple[float, int, int]]) -> tuple[float, float]:
    """Seconds a piece and a token of a draft's catch-up: least squares over (seconds, tokens,
    pieces), both parts at least 0, refitted once without the rows 3× the median residual off (a
    shape's first time, a host spell). Rows of one tokens-to-pieces ratio cannot tell the parts
    apart: the cost is then put on the pieces, which grow slowest with the lag."""
    def fit(rows):
        spp = sum(p * p for _, _, p in rows)
        stt = sum(t * t for _, t, _ in rows)
        spt = sum(p * t for _, t, p in rows)
        sps = sum(p * s for s, _, p in rows)
        sts = sum(t * s for s, t, _ in rows)
        det = spp * stt - spt * spt
        if det > 1e-6 * spp * stt:
            a, b = (sps * stt - sts * spt) / det, (sts * spp - sps * spt) / det
            if a >= 0 and b >= 0:
                return a, b
            if b < 0 <= a or det <= 0:
                return sps / spp, 0.0
            return 0.0, sts / stt
        return sps / spp, 0.0

    a, b = fit(rows)
    res = [abs(s - a * p - b * t) for s, t, p in rows]
    bound = 3 * _median(res)
    kept = [r for r, e in zip(rows, res) if e <= bound]
    return fit(kept) if bound > 0 and len(kept) >= MIN_SAMPLES else (a, b)


def feed_pieces(tokens: int, most: int = 512) -> int:
    """Pieces a catch-up of `tokens` was fed in by the engine before the batch (powers of two, at
    most `most` each), as logged decisions price it; the batch feeds a catch-up in one piece."""
    return tokens // most + bin(tokens % most).count("1")
