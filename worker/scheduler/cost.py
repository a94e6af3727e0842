"""The cost model: measured round times by cell (N requests, B drafted, D deepest), at the
machine's pace; docs/scheduler.md, "The cost table"."""

from __future__ import annotations

from collections import deque
from typing import Sequence

from worker.round import CATCH_UP, FREE_SIT_OUT, PIPELINE, PIPELINE_WARM_ROUNDS, Cell, SetApart  # noqa: F401 (re-exported)

WINDOW = 32  # measurements per cell
MAX_AGE = 256  # rounds after which a measurement expires (the machine's load changes; a cell
               # that is never chosen again would otherwise keep its old figure for good)
STALE_GAP = 32  # rounds without a measurement of a cell after which its measurements are discarded
                # when a cheaper one comes (a cell left early in a batch, probed again much later)
STALL_FACTOR = 10.0  # a round this many times its cell's median is a stall: logged apart
CATCH_UP_REASONS = CATCH_UP  # set-apart costs a probe pays besides its round
DISCARD_REASONS = (SetApart.LOOK_AHEAD_DISCARDED,)  # ... and, batched after pipelined plain rounds, the forward it discards
PIPELINE_REASONS = PIPELINE  # what stopping costs where plain rounds are pipelined
TAKEN_REASONS = (SetApart.LOOK_AHEAD_TAKEN,)  # ... where a drafting cycle takes that forward's token instead: the wait for it
MIN_SAMPLES = 3  # rounds a cell needs before its median is trusted over its neighbours
PROBE_EVERY = 16  # with speculation off and nothing measured, probe this often (acceptance drifts)
HOPELESS_EVERY = 16384  # plain rounds between probes where no depth would pay with every draft accepted
FEW_OBSERVED = 16.0  # position-1 observations over the long run under which ...
UNCERTAIN_SHARE = 0.10  # ... probes may cost this share of plain time (PROBE_SHARE's 5×)
PROBE_SHARE = 0.02  # probes come as often as keeps their expected loss under this share of plain time
MAX_FOLLOW_HIT = 0.9  # the chance of a probe's hit that prices its follow-ups at most (9 rounds)
SWITCH_HORIZON = 16  # rounds a draft's catch-up is spread over when deciding to start drafting
PLAIN_GAP = 64  # drafting rounds after which plain rounds are measured again, at the least: a plain
                # figure from one early round kept one request drafting at acceptance 0.3 where it lost 8%. (On
                # one request an exploration is 5 plain rounds, and in simulation every 64 cost acceptance 0.6
                # 2%; at 128 a whole run's acceptance 0.6 ×1 priced k = 1 at 66 ms, measured 45, from a stale
                # plain figure for 120 rounds and drafted k = 2-4: 0.83 of k = 1. The simulator's costs
                # keep their ratios, which is what hid it.)
FEW_PLAIN_GAP = 8  # ... and while the plain cell has fewer than MIN_SAMPLES rounds: one engine's
                   # first plain round (38 ms against 31 steady) kept acceptance 0.3 drafting 100 rounds
EXPLORE_MARGIN = 1.25  # ... where drafting leads plain by less than this: a stale plain figure flips
                       # no wider lead (acceptance 0.9, 4 requests, 2.8×: exploring each batch's tail cost 3%)
FEW_ROUNDS = 2 * MIN_SAMPLES  # a deeper drafting cell measured fewer times, then left STALE_GAP rounds, is tried again
PACE_BOUND = 1.5  # one round's reading moves the pace at most this factor (the host's spells: ±30% a run)
PACE_WINDOW = 8  # rounds whose pace (time ÷ its cell's normalised median) the machine's pace is the median of
SET_APART_KEPT = 1024  # set-apart rounds remembered (catch-up costs are read from them)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class CostModel:
    """A table C(N, B, D) of median round times over a sliding window, at the machine's pace.

    A table, not fitted parts: measured costs are staircases (kernel tiles, cache lines, BLAS
    paths, the first drafted token's padding of every verify row), and a round's cost is what
    the scheduler trades against, so it is measured whole. Rows of a batched verify are padded to
    the deepest draft, so D, not B, drives most of a round's cost: an unmeasured cell is
    interpolated along B among cells of its own (N, D), else along D from the cheapest cell of
    each measured depth; beyond the deepest measured depth it is taken from the nearest other N
    that measured it, scaled by the two plain rounds' ratio, else extrapolated optimistically: at
    the cheapest step per depth measured so far (costs are staircases: the depth after a dear one
    can be nearly free), or, with one drafting depth measured, at PRIOR_SLOPE × the plain round's
    cost per depth (the first depth's jump is mostly the fixed cost of drafting at all), and at no
    more than the measured draft step a depth (`draft_step`: a depth more costs at least its draft
    step, and its verify may cost no more), so that a deeper draft that might pay gets tried and
    is then priced by its own measurement. Noise is
    bounded where the work is known to be ordered (see `estimate`). A cell's figure follows a
    change of load through the pace (below); a cell of fewer than MIN_SAMPLES rounds loses them
    after MAX_AGE timed rounds (see `_live`). A stale cell dearer than one that does more work is
    priced by its neighbours (see `_contradicted`). A cell measured fewer than FEW_ROUNDS times in
    all, measured again after STALE_GAP rounds without a measurement, cheaper than its median, starts
    anew: a batch's first rounds cost more
    than its later ones, and a probe's one fresh round must be able to move a cell that a few
    early rounds priced out, which nothing else would re-measure (a cell of more rounds keeps
    them: its figure, normalised, is what the pace is read against). A dearer fresh round only joins the others:
    a probe's round is itself a little dearer than a steady one (the first of its shape after
    plain rounds), and an estimate too cheap corrects itself by the drafting it brings about.
    Fed one round late: `observe` holds a round until the next `commit`, so a round that is
    later found interrupted (`interrupt`) never enters the table.

    Every figure is kept normalised by the machine's pace (`pace`): the median, over the last
    PACE_WINDOW complete rounds of cells measured MIN_SAMPLES times, of each round's time ÷ its
    cell's normalised median. A round is stored as its time ÷ the pace then, and every cell is
    priced at its normalised median × the pace now, so cells measured in different spells of the
    host's pace compare as if measured together (on a GPU the host moved plain rounds 6 → 9.5
    ms within a run, and k = 5's figure from the fast spell drafted acceptance 0.6 5-8 deep in the slow
    one, where it lost: 0.86 of the best fixed k). While one cell alone is measured, the pace
    follows its rounds and the other cells' figures follow the pace: one cell cannot tell a change
    of pace from a change of its own cost, so the others keep their ratios to it.
    """

    PRIOR_SLOPE = 0.25  # guessed extra cost of one more draft depth, relative to a plain round (table._interpolate)

    def __init__(self):
        self.cells: dict[tuple[int, int, int], list[tuple[int, float]]] = {}  # (round, seconds)
        self.measured: dict[tuple[int, int, int], int] = {}  # rounds each cell was measured in all (none forgotten)
        self.rounds = 0
        self.pending: tuple | None = None
        self.set_apart: deque = deque(maxlen=SET_APART_KEPT)  # interrupted, partial or stalled rounds
        self.fed: deque = deque(maxlen=SET_APART_KEPT)  # catch-ups timed with what they fed: (N, seconds, tokens, pieces)
        self.draft_steps: dict[int, deque] = {}  # by N: a drafting round's drafting seconds ÷ its depth
        self.pace = 1.0  # the machine's pace now, against the normalised figures' (see above)
        self.paces: deque = deque(maxlen=PACE_WINDOW)  # the last rounds' own paces

    def observe(self, key: tuple[int, int, int], seconds: float, draft_s: float = 0.0) -> None:
        self.commit()
        self.rounds += 1
        self.pending = (key, seconds, draft_s)

    def interrupt(self, reason: str) -> None:
        if self.pending is not None:
            self.set_aside(*self.pending[:2], reason)
            self.pending = None

    def set_aside(self, key: tuple[int, int, int], seconds: float, reason: str,
                  fed: tuple[int, int] = (0, 0)) -> None:
        """Records a round's time (or a switching cost) apart from the table, normalised; `fed`:
        the tokens and pieces its drafts' catch-ups fed (see `feed_seconds`)."""
        self.set_apart.append((key, seconds / self.pace, reason))
        if fed[0] and reason in CATCH_UP_REASONS:
            self.fed.append((key[0], seconds / self.pace, *fed))

    def draft_step(self, n: int) -> float | None:
        """Median drafting seconds a depth of rounds with n requests (None: none measured)."""
        steps = self.draft_steps.get(n)
        return _median(steps) * self.pace if steps else None

    def commit(self) -> None:
        if self.pending is None:
            return
        key, raw, draft_s = self.pending
        self.pending = None
        cell = self.cells.setdefault(key, [])
        seconds = raw / self.pace
        gap, median = (self.rounds - cell[-1][0], _median([t for _, t in cell])) if cell else (0, 0.0)
        if gap > STALE_GAP and seconds < median and self.measured.get(key, 0) < FEW_ROUNDS:
            cell.clear()  # a few early rounds (the start of a batch) priced it out: start anew
        if len(cell) >= 3 and seconds > STALL_FACTOR * median:
            self.set_apart.append((key, seconds, SetApart.STALL))
            return
        if len(cell) >= MIN_SAMPLES:  # the pace this round shows, against its cell's figure, moving PACE_BOUND at most
            pace = raw / _median([t for _, t in cell])  # (a cell's first rounds 5× its steady ones read as 5× the pace)
            self.paces.append(min(max(pace, self.pace / PACE_BOUND), self.pace * PACE_BOUND))
            self.pace = _median(self.paces)
            seconds = raw / self.pace
        if key[2] and draft_s > 0:
            self.draft_steps.setdefault(key[0], deque(maxlen=WINDOW)).append(draft_s / self.pace / key[2])
        cell.append((self.rounds, seconds))
        del cell[:-WINDOW]
        self.measured[key] = self.measured.get(key, 0) + 1

    def newest(self, key: tuple[int, int, int]) -> int:
        """The round of the cell's newest measurement (0: none)."""
        cell = self.cells.get(key)
        return cell[-1][0] if cell else 0

    def catch_up_seconds(self, n: int, reasons: tuple = CATCH_UP_REASONS) -> float | None:
        """Median of the last WINDOW costs of n requests set apart for one of `reasons` (by default
        a draft's catch-up, on the prompt or on the rounds it sat out: the catch-up alone where it
        was timed apart, else the whole round)."""
        xs = [t for key, t, why in self.set_apart if why in reasons and key[0] == n][-WINDOW:]
        return _median(xs) * self.pace if xs else None

    def feed_seconds(self, n: int, tokens: int) -> float | None:
        """What a draft's catch-up of `tokens` costs with n requests, from the
        catch-ups timed with what they fed (`fit_feed`); too few of them: the median catch-up.
        A catch-up's cost is by its pieces on a GPU (5-7 ms each, one launch a piece, whatever
        its tokens) and by its tokens here; a median of every catch-up, most of them a few tokens
        after short sit-outs, priced a probe late in a request that never drafted at a fifth of
        its 81 ms there."""
        if not tokens:
            return 0.0
        rows = [(t, k, p) for m, t, k, p in self.fed if m == n][-WINDOW:]
        if len(rows) < MIN_SAMPLES:
            return self.catch_up_seconds(n)
        per_piece, per_token = fit_feed(rows)
        return (per_piece * feed_pieces(tokens) + per_token * tokens) * self.pace

    def _live(self) -> dict[tuple[int, int, int], list[float]]:
        """Each cell's rounds, normalised: a drafting cell of fewer than MIN_SAMPLES rounds loses
        them after MAX_AGE rounds (a figure never trusted, and never read against for the pace, is
        measured again rather than kept); one of more keeps them, priced at today's pace, so a
        drafting round 4× as dear as plain is not tried again each MAX_AGE rounds as if unmeasured.
        A plain cell keeps its rounds however few: unmeasured, the plain round is priced as the
        cheapest drafting one (at acceptance 0.6 on one request its two rounds expired, and k = 3 led 1.9×)."""
        live = {key: [t for r, t in v if len(v) >= MIN_SAMPLES or not key[1] or r > self.rounds - MAX_AGE]
                for key, v in sorted(self.cells.items())}
        self._cap_plain(live)
        return {key: v for key, v in live.items() if v}

    def _cap_plain(self, live: dict[tuple[int, int, int], list[float]]) -> None:
        """A plain round costs no more than a drafting round of its N less that round's drafting:
        the verify does the plain round's work and more. Where a drafting cell has MIN_SAMPLES
        rounds newer than its plain cell's newest, the plain figure is capped at their median less
        D draft steps. On the tiny pair a slow spell's 20 plain rounds (5.2 ms, steady 2.0) priced the
        plain round at 5.16 ms; the k = 1 rounds after it (5.8 ms, 2.1 of them drafting) then read
        as paying, and it drafted for 311 rounds until plain rounds were explored again. A cap set
        too low prices drafting out, and the plain rounds that follow measure the plain cell again."""
        for n in {key[0] for key in live}:
            plain, steps = live.get((n, 0, 0)), self.draft_steps.get(n)
            if not plain or not steps:
                continue
            step = _median(steps)  # normalised, as the cells are
            since = self.newest((n, 0, 0))
            bounds = []
            for (kn, b, d), cell in self.cells.items():
                fresh = [t for r, t in cell if r > since]
                if kn == n and b and len(fresh) >= MIN_SAMPLES:
                    bounds.append(_median(fresh) - d * step)
            cap = min(bounds, default=None)
            if cap is not None and 0 < cap < _median(plain):
                live[(n, 0, 0)] = [min(t, cap) for t in plain]

    def table_and_counts(self) -> tuple[dict[Cell, float], dict[Cell, int]]:
        live = self._live()
        table = {Cell(*key): _median(v) * self.pace for key, v in live.items()}
        counts = {Cell(*key): len(v) for key, v in live.items()}
        for key in self._contradicted(table, counts) + self._seldom_measured(table):
            counts[key] = 0
        return table, counts

    def _seldom_measured(self, table: dict[Cell, float]) -> list[Cell]:
        """Cells past the first drafting depth measured fewer than FEW_ROUNDS times in all, none in
        the last STALE_GAP rounds: their count reads 0, so `estimate` caps them by their neighbours
        and the next decision that prefers them measures them again. Three k = 2 rounds in a slow
        spell (95 ms, where steady ones cost 63-70) priced k = 2 out for a whole run at acceptance 0.9, and
        no depth past it was tried: k = 1 throughout, 0.90 of k = 4 (with this, 1.06-1.12 of k = 4 in
        two targeted runs). The first depth is left out: where drafting does not pay, k = 1 is what
        the probes measure already, and re-pricing it too would draft k = 1 rounds that lose. In all:
        each re-measurement, cheaper than the cell's figure, started the cell anew, so at acceptance 0.6 on
        one request k = 2 (64 ms, priced 46-55 by its neighbours) and k = 8 were tried again every
        ~40 rounds for a whole run, 21 rounds of 524 (0.93 of k = 1)."""
        return [Cell(*key) for key in self.cells
                if key[2] >= 2 and self.measured.get(key, 0) < FEW_ROUNDS and self.rounds - self.newest(key) > STALE_GAP
                and key in table]

    def _contradicted(self, table: dict[Cell, float], counts: dict[Cell, int]) -> list[Cell]:
        """Cells dearer than a measured one that does more work, unmeasured for STALE_GAP rounds:
        their count reads 0, so `estimate` prices them by their neighbours and the next decision
        that prefers them measures them again (a batch's first k = 1 rounds priced it above k = 2,
        which then bounded it, and it was never tried again where it was 5% the better). A fresh
        round that confirms the figure keeps it for another STALE_GAP rounds."""
        out = []
        for key, v in table.items():
            n, b, d = key
            if b and self.rounds - self.newest((n, b, d)) > STALE_GAP and any(
                    _dominates(k, n, b, d) and counts[k] >= MIN_SAMPLES and w < v for k, w in table.items()):
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
    kn, kb, kd = key
    return kn == n and kb >= b and kd >= d and (kb, kd) != (b, d)


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
    """Pieces a catch-up of `tokens` is fed in (powers of two, at most `most` each:
    worker/joint/draft.py's pow2_pieces)."""
    return tokens // most + bin(tokens % most).count("1")
