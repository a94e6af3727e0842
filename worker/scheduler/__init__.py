"""The draft-budget allocation rule (DESIGN.md, "Budget selection and allocation").

Pure Python, no MLX: the web UI's allocation view and the tests use the same functions.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from typing import Sequence

from worker.round import RoundInput, RoundPlan, RoundReport


def survivals(acceptance: Sequence[float]) -> list[float]:
    """s[j] = a[1]·…·a[j]: the chance that draft position j is reached and accepted."""
    out, s = [], 1.0
    for a in acceptance:
        s *= a
        out.append(s)
    return out


def rank(survival: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """All (request, position) candidates, positions 1-based, by survival descending;
    equal scores go by request order, then position."""
    cands = [(-s, r, j + 1) for r, row in enumerate(survival) for j, s in enumerate(row)]
    return [(r, j) for _, r, j in sorted(cands)]


def allocate(survival: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Draft length per request for a total budget: the top `budget` candidates, prefix-closed."""
    lengths = [0] * len(survival)
    for r, j in rank(survival)[:budget]:
        lengths[r] = max(lengths[r], j)
    return lengths


# ---- acceptance ----

PRIOR_WEIGHT = 2.0  # pseudo-observations of each position's prior
FIRST_PRIOR = 0.5  # position 1 starts as a coin flip: Beta(1, 1)
DECAY = 0.95  # per observation: acceptance follows the text as it changes
LONG_DECAY = 0.998  # per observation: what the draft shows over the long run
RECENT_DECAY = 0.7  # a short memory kept beside each estimate's, to see that the text changed
CHANGE_NATS = 1.5  # log-likelihood ratio (recent observations, short memory's rate against the
                   # estimate's) past which the estimate forgets what came before them
MIN_RECENT = 1.5  # decayed observations the short memory needs before it is tested
FADE_WEIGHT = 8.0  # observations of the long-run estimate a server-wide one's position 1 fades to over plain rounds
SHARED_WEIGHT = 24.0  # pseudo-observations of the server-wide estimate in each request's own: noise
                      # in each request's estimates makes survivals uneven, and uneven survivals draft
                      # deeper for the same budget (8: α = 0.9 ×4 chose depth 2 where 4 paid, 0.93 of k = 4)


class Acceptance:
    """Conditional acceptance per draft position from decayed counts with a Beta prior.

    Three levels. The long-run estimate (every cycle the server ran, decaying at LONG_DECAY)
    takes as prior mean the previous position's estimate (position 1: 0.5): an untried deeper
    position is taken to be like the one before it, so a draft that is good at shallow positions
    gets tried deeper, and a bad one does not. The server-wide estimate (DECAY a round, however
    many requests' cycles the round observed: it follows the text as it changes) takes the long-run
    one as prior, and a request's own estimate takes the
    server-wide one as prior (SHARED_WEIGHT observations): it starts from what the server has seen
    and goes its own way as its text shows, but a few unlucky cycles do not make it look worse
    than the draft is. For the same reason counts fade without being added to where nothing was
    tried: a position a cycle did not try (at DECAY, even in the long-run estimate), and every
    position in a round that drafted nothing (`fade`), so an estimate that an unlucky spell pushed below the point where drafting pays
    drifts back to what the draft has shown over the long run, and drafting is tried again,
    instead of stopping for good (no drafts, no observations).

    A change of text (code after prose) moves acceptance at once, and an estimate with ~20
    observations of memory takes 3-6 cycles to follow it. So each level but the long-run one keeps
    a short memory (RECENT_DECAY) beside its own; when the recent observations are more likely
    under the short memory's rate than under the estimate's by CHANGE_NATS, the estimate forgets
    the older ones (with 4 requests, α switching 0.9/0.2 every 10 cycles, the error of position
    1 fell from 0.26 to 0.20 in simulation, and at a steady α = 0.9 rose from 0.034 to 0.036).
    """

    def __init__(self, max_positions: int, decay: float = DECAY, detect_change: bool = True,
                 forget_deeper: bool = False, per_round: bool = False):
        self.accepted = [0.0] * max_positions
        self.tried = [0.0] * max_positions
        self.recent_accepted = [0.0] * max_positions
        self.recent_tried = [0.0] * max_positions
        self.decay = decay
        self.detect_change, self.forget_deeper = detect_change, forget_deeper
        self.per_round = per_round  # counts decay once a round (`fade`), however many cycles it observes

    def observe(self, k: int, n: int) -> None:
        """A cycle drafted k and accepted the first n: positions 1..min(n+1, k) were tried."""
        tried = min(n + 1, k)
        for j in range(len(self.tried)):
            decay = 1.0 if self.per_round else self.decay if j < tried else min(self.decay, DECAY)  # untried: fades as fast at every level
            self.accepted[j] = self.accepted[j] * decay + (j < n)
            self.tried[j] = self.tried[j] * decay + (j < tried)
            self.recent_accepted[j] = self.recent_accepted[j] * RECENT_DECAY + (j < n)
            self.recent_tried[j] = self.recent_tried[j] * RECENT_DECAY + (j < tried)
        if self.detect_change:
            self._forget_before_a_change()

    def _forget_before_a_change(self) -> None:
        """A change at position j forgets the older observations there; with `forget_deeper`, a fall
        forgets them at every deeper position too: once position j fails, the deeper ones are seldom
        tried and would keep the old text's rates (after α = 0.9 the engine drafted 6-8 deep into
        α = 0.2 text). After a rise they are tried often again and follow on their own."""
        for j, (ra, rt) in enumerate(zip(self.recent_accepted, self.recent_tried)):
            if rt < MIN_RECENT or self.tried[j] <= rt:
                continue
            p_old = min(0.97, max(0.03, self.accepted[j] / self.tried[j]))
            p_new = min(0.97, max(0.03, ra / rt))
            nats = ra * math.log(p_new / p_old) + (rt - ra) * math.log((1 - p_new) / (1 - p_old))
            if nats > CHANGE_NATS:
                deeper = self.forget_deeper and p_new < p_old
                end = len(self.tried) if deeper else j + 1
                self.accepted[j:end] = self.recent_accepted[j:end]
                self.tried[j:end] = self.recent_tried[j:end]
                if deeper:
                    return

    def fade(self, recent: bool = True, toward: Sequence[float] | None = None) -> None:
        """A round without drafts (or, `per_round`, any round): what was seen weighs less; `recent`:
        the short memory too; `toward`: what position 1 fades to, worth FADE_WEIGHT observations once
        faded (the deeper positions fade to nothing, their prior: held at the long-run rates, which
        carried the α = 0.9 thirds' rates into the α 0.9 → 0.2 → 0.9 rows, they kept drafts 2-8
        deep through failures, 0.91 of k = 1 in a whole run; 0.99 in a targeted run without)."""
        d = self.decay
        self.accepted = [a * d for a in self.accepted]
        self.tried = [t * d for t in self.tried]
        if toward is not None:
            self.accepted[0] += (1 - d) * FADE_WEIGHT * toward[0]
            self.tried[0] += (1 - d) * FADE_WEIGHT
        if recent:
            self.recent_accepted = [a * RECENT_DECAY for a in self.recent_accepted]
            self.recent_tried = [t * RECENT_DECAY for t in self.recent_tried]

    def rates(self, prior: Sequence[float] | None = None, weight: float = SHARED_WEIGHT) -> list[float]:
        """Estimates per position; `prior`: the level above's, worth `weight` observations (none:
        the previous position's estimate, worth PRIOR_WEIGHT)."""
        out, mean = [], FIRST_PRIOR
        for j, (a, t) in enumerate(zip(self.accepted, self.tried)):
            if prior is None:
                mean = (a + PRIOR_WEIGHT * mean) / (t + PRIOR_WEIGHT)
            else:
                mean = (a + weight * prior[j]) / (t + weight)
            out.append(mean)
        return out


# ---- cost of complete rounds ----

WINDOW = 32  # measurements per cell
MAX_AGE = 256  # rounds after which a measurement expires (the machine's load changes; a cell
               # that is never chosen again would otherwise keep its old figure for good)
STALE_GAP = 32  # rounds without a measurement of a cell after which its measurements are discarded
                # when a cheaper one comes (a cell left early in a batch, probed again much later)
STALL_FACTOR = 10.0  # a round this many times its cell's median is a stall: logged apart
CATCH_UP_REASONS = ("draft prefill", "draft catch-up")  # set-apart costs a probe pays besides its round
DISCARD_REASONS = ("look-ahead discarded",)  # ... and, batched after pipelined plain rounds, the forward it discards
PIPELINE_REASONS = ("plain pipeline start", "plain pipeline warm-up")  # what stopping costs where plain rounds are pipelined
TAKEN_REASONS = ("look-ahead taken",)  # ... where a drafting cycle takes that forward's token instead: the wait for it
PIPELINE_WARM_ROUNDS = 4  # pipelined plain rounds after drafting that cost more than steady ones (the start among them)
MIN_SAMPLES = 3  # rounds a cell needs before its median is trusted over its neighbours
PROBE_EVERY = 16  # with speculation off and nothing measured, probe this often (acceptance drifts)
HOPELESS_EVERY = 16384  # plain rounds between probes where no depth would pay with every draft accepted
FEW_OBSERVED = 16.0  # position-1 observations over the long run under which ...
UNCERTAIN_SHARE = 0.10  # ... probes may cost this share of plain time (PROBE_SHARE's 5×)
PROBE_SHARE = 0.02  # probes come as often as keeps their expected loss under this share of plain time
MAX_FOLLOW_HIT = 0.9  # the chance of a probe's hit that prices its follow-ups at most (9 rounds)
FREE_SIT_OUT = 2  # plain rounds a draft can sit out and draft without a catch-up round
                  # (worker/joint/decoder.py: CATCH_UP_LAG less the 2 tokens a drafting cycle leaves)
SWITCH_HORIZON = 16  # rounds a draft's catch-up is spread over when deciding to start drafting
PLAIN_GAP = 64  # drafting rounds after which plain rounds are measured again, at the least: a plain
                # figure from one early round kept one request drafting at α = 0.3 where it lost 8%. (On
                # one request an exploration is 5 plain rounds, and in simulation every 64 cost α = 0.6
                # 2%; at 128 a whole run's α = 0.6 ×1 priced k = 1 at 66 ms, measured 45, from a stale
                # plain figure for 120 rounds and drafted k = 2-4: 0.83 of k = 1. The simulator's costs
                # keep their ratios, which is what hid it.)
FEW_PLAIN_GAP = 8  # ... and while the plain cell has fewer than MIN_SAMPLES rounds: one engine's
                   # first plain round (38 ms against 31 steady) kept α = 0.3 drafting 100 rounds
EXPLORE_MARGIN = 1.25  # ... where drafting leads plain by less than this: a stale plain figure flips
                       # no wider lead (α = 0.9, 4 requests, 2.8×: exploring each batch's tail cost 3%)
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
    host's pace compare as if measured together (on the H200 the host moved plain rounds 6 → 9.5
    ms within a run, and k = 5's figure from the fast spell drafted α = 0.6 5-8 deep in the slow
    one, where it lost: 0.86 of the best fixed k). While one cell alone is measured, the pace
    follows its rounds and the other cells' figures follow the pace: one cell cannot tell a change
    of pace from a change of its own cost, so the others keep their ratios to it.
    """

    PRIOR_SLOPE = 0.25  # guessed extra cost of one more draft depth, relative to a plain round

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
            self.set_apart.append((key, seconds, "stall"))
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
        A catch-up's cost is by its pieces on the H200 (5-7 ms each, one launch a piece, whatever
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
        cheapest drafting one (at α = 0.6 on one request its two rounds expired, and k = 3 led 1.9×)."""
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

    def table_and_counts(self) -> tuple[dict[str, float], dict[str, int]]:
        live = self._live()
        table = {f"{n},{b},{d}": _median(v) * self.pace for (n, b, d), v in live.items()}
        counts = {f"{n},{b},{d}": len(v) for (n, b, d), v in live.items()}
        for key in self._contradicted(table, counts) + self._seldom_measured(table):
            counts[key] = 0
        return table, counts

    def _seldom_measured(self, table: dict[str, float]) -> list[str]:
        """Cells past the first drafting depth measured fewer than FEW_ROUNDS times in all, none in
        the last STALE_GAP rounds: their count reads 0, so `estimate` caps them by their neighbours
        and the next decision that prefers them measures them again. Three k = 2 rounds in a slow
        spell (95 ms, where steady ones cost 63-70) priced k = 2 out for a whole run at α = 0.9, and
        no depth past it was tried: k = 1 throughout, 0.90 of k = 4 (with this, 1.06-1.12 of k = 4 in
        two targeted runs). The first depth is left out: where drafting does not pay, k = 1 is what
        the probes measure already, and re-pricing it too would draft k = 1 rounds that lose. In all:
        each re-measurement, cheaper than the cell's figure, started the cell anew, so at α = 0.6 on
        one request k = 2 (64 ms, priced 46-55 by its neighbours) and k = 8 were tried again every
        ~40 rounds for a whole run, 21 rounds of 524 (0.93 of k = 1)."""
        return [f"{n},{b},{d}" for (n, b, d) in self.cells
                if d >= 2 and self.measured.get((n, b, d), 0) < FEW_ROUNDS and self.rounds - self.newest((n, b, d)) > STALE_GAP
                and f"{n},{b},{d}" in table]

    def _contradicted(self, table: dict[str, float], counts: dict[str, int]) -> list[str]:
        """Cells dearer than a measured one that does more work, unmeasured for STALE_GAP rounds:
        their count reads 0, so `estimate` prices them by their neighbours and the next decision
        that prefers them measures them again (a batch's first k = 1 rounds priced it above k = 2,
        which then bounded it, and it was never tried again where it was 5% the better). A fresh
        round that confirms the figure keeps it for another STALE_GAP rounds."""
        out = []
        for key, v in table.items():
            n, b, d = map(int, key.split(","))
            if b and self.rounds - self.newest((n, b, d)) > STALE_GAP and any(
                    _dominates(k, n, b, d) and counts[k] >= MIN_SAMPLES and w < v for k, w in table.items()):
                out.append(key)
        return out

    def table(self) -> dict[str, float]:
        """Medians of the cells' unexpired rounds, keyed "N,B,D" (what decisions are logged with)."""
        return self.table_and_counts()[0]

    def counts(self) -> dict[str, int]:
        """Unexpired rounds in each cell of `table()` (0 where the ordering contradicts a stale cell)."""
        return self.table_and_counts()[1]


def _cells(table: dict[str, float], n: int) -> list[tuple[int, int, float]]:
    out = []
    for key, v in table.items():
        kn, kb, kd = map(int, key.split(","))
        if kn == n:
            out.append((kb, kd, v))
    return out


def _along(points: dict[int, float], x: int) -> float:
    """Linear between the nearest measured neighbours; the nearest one outside their range."""
    below = [p for p in points if p <= x]
    above = [p for p in points if p >= x]
    if below and above:
        lo, hi = max(below), min(above)
        return points[lo] if lo == hi else points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[min(above)] if above else points[max(below)]


def _from_other_n(table: dict[str, float], n: int, d: int) -> float | None:
    """Depth d as measured (or interpolated between measured depths) with the nearest other number
    of requests, scaled by the ratio of the two plain rounds: the tail of a batch (N falling as
    requests end) need not explore anew."""
    plain = table.get(f"{n},0,0")
    if plain is None:
        return None
    others = sorted({int(k.split(",")[0]) for k in table} - {n}, key=lambda x: (abs(x - n), x))
    for other in others:
        base = table.get(f"{other},0,0")
        by_depth: dict[int, float] = {}
        for _, kd, v in _cells(table, other):
            by_depth[kd] = min(v, by_depth.get(kd, v))
        if base and max(by_depth) >= d:
            return _along(by_depth, d) * plain / base
    return None


def _stand_in(table: dict[str, float], n: int) -> int | None:
    """For N requests of which nothing is measured, the nearest other N whose plain round is: its
    rounds of the same drafts a request price this N's (see `_interpolate`). A batch's tail met
    each smaller N unmeasured and decoded plain, and one request's plain rounds, pipelined, are
    set apart for PIPELINE_WARM_ROUNDS after a start: a short tail never measured them, and every
    tail of α = 0.9 ×4 ran plain (tails of 36 rounds against k = 4's 6, 0.87 of k = 4)."""
    if _cells(table, n):
        return None
    plain = [int(k.split(",")[0]) for k in table if k.endswith(",0,0")]
    return min(plain, key=lambda x: (abs(x - n), x), default=None)


def _reach(table: dict[str, float], n: int) -> int:
    """The deepest depth a decision may choose: one past the deepest measured with these N
    requests, or the deepest measured with another N when both plain rounds are known."""
    if (other := _stand_in(table, n)) is not None:
        return _reach(table, other)
    own = max((kd for _, kd, _ in _cells(table, n)), default=-1) + 1
    if f"{n},0,0" not in table:
        return own
    shared = [int(k.split(",")[2]) for k in table if f"{k.split(',')[0]},0,0" in table]
    return max([own] + shared)


def estimate(table: dict[str, float], n: int, b: int, d: int, counts: dict[str, int] | None = None,
             draft_step: float | None = None) -> float | None:
    """Cost of a round from a logged table (see CostModel); None when nothing of this N is known.

    A round never costs more than a measured one that does more work (at least as many tokens
    and as deep, with `counts`: one of MIN_SAMPLES rounds or more), and a cell of fewer than
    MIN_SAMPLES rounds costs at most what its neighbours imply: one slow first round (a
    neighbour's load, a first allocation) must not price a cell out of ever being measured again.
    `draft_step`: the measured drafting seconds a depth (see `_interpolate`).
    """
    cost = _interpolate(table, n, b, d, draft_step)
    key = f"{n},{b},{d}"
    if cost is not None and counts is not None and key in table and counts.get(key, 0) < MIN_SAMPLES:
        others = _interpolate({k: v for k, v in table.items() if k != key}, n, b, d, draft_step)
        cost = cost if others is None else min(cost, others)
    bounds = [v for k, v in table.items() if _dominates(k, n, b, d) and (counts is None or counts.get(k, 0) >= MIN_SAMPLES)]
    return min([cost] + bounds) if cost is not None else None


def _dominates(key: str, n: int, b: int, d: int) -> bool:
    kn, kb, kd = map(int, key.split(","))
    return kn == n and kb >= b and kd >= d and (kb, kd) != (b, d)


def _interpolate(table: dict[str, float], n: int, b: int, d: int, draft_step: float | None = None) -> float | None:
    exact = table.get(f"{n},{b},{d}")
    if exact is not None:
        return exact
    cells = _cells(table, n)
    if not cells:
        other = _stand_in(table, n)  # its plain round stands in for this N's until one is measured:
        # the ratios between candidates, which decide, carry over (an N's rounds cost about in proportion)
        return None if other is None else _interpolate(table, other, b * other // n, d, draft_step)
    same_d = {kb: v for kb, kd, v in cells if kd == d}
    if same_d:
        return _along(same_d, b)
    by_depth: dict[int, float] = {}
    for _, kd, v in cells:
        by_depth[kd] = min(v, by_depth.get(kd, v))
    deepest = max(by_depth)
    if d < deepest:
        return _along(by_depth, d)
    if d > deepest and (scaled := _from_other_n(table, n, d)) is not None:
        return scaled
    depths = sorted(by_depth)
    if sum(x >= 1 for x in depths) >= 2:  # the cheapest step per depth measured so far
        slope = max(0.0, min((by_depth[b] - by_depth[a]) / (b - a) for a, b in zip(depths, depths[1:])))
    else:
        slope = CostModel.PRIOR_SLOPE * by_depth.get(0, by_depth[min(by_depth)])
    if draft_step is not None:  # a depth more costs at least its draft step; its verify may cost no more
        slope = min(slope, draft_step)
    return by_depth[deepest] + slope * (d - deepest)


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


# ---- the decision ----


def decide(acceptance: Sequence[Sequence[float]], n_requests: int, table: dict[str, float], b_max: int,
           probe: bool = False, counts: dict[str, int] | None = None,
           behind: Sequence[bool] | None = None, switch_s: float = 0.0, stop_s: float = 0.0,
           explore_plain: bool = False, draft_step: float | None = None,
           explore_margin: float | None = EXPLORE_MARGIN) -> dict:
    """B* = argmax over B in 0..b_max of (N + sum of the B largest survivals) / cost(N, B, D(B)).

    `acceptance` has one row per joint request (baseline requests count in N only). Candidates
    whose cost cannot be estimated are skipped; B = 0 is always a candidate. A depth however far
    past the deepest measured is a candidate (`estimate` extrapolates, optimistically, until its
    own rounds price it): where the next depth does not pay and a deeper one does, a reach of one
    depth past the deepest measured never got there (a 0.8 B draft on the H200 at α = 0.95: k = 1
    and 2 lose to plain rounds, k = 4 pays 1.33×; adaptive stayed plain, 0.71 of k = 4). An allocation that drafts for a request whose draft is
    `behind` (it must first catch up on the prompt or on the cycles it sat out) pays that once:
    `switch_s` spread over SWITCH_HORIZON rounds is added to its cost, so noise in a near-tie
    does not start drafting that costs more to start than it gains (`behind` also marks a request
    whose pipelined plain rounds computed a forward ahead, which drafting throws away). Likewise
    `stop_s`, what stopping costs (one request's plain rounds restart their pipeline), spread
    over SWITCH_HORIZON rounds, is added to B = 0: the mode changes only for a clear gain, since
    every change pays both once. With `probe`, a round that
    would draft nothing drafts one token for each request, so acceptance keeps being observed;
    with `explore_plain`, a round that would draft drafts nothing where drafting leads by less than
    `explore_margin` (None: by any lead), so plain rounds keep being measured (see `plain_probe_interval`).
    Returns the inputs' derived values and the choice, as logged and replayed.
    """
    surv = [survivals(a) for a in acceptance]
    ranked = rank(surv)
    candidates = []
    gain = float(n_requests)
    for b in range(0, min(b_max, len(ranked)) + 1):
        if b:
            r, j = ranked[b - 1]
            gain += surv[r][j - 1]
        lengths = allocate(surv, b)
        d = max(lengths, default=0)
        cost = estimate(table, n_requests, b, d, counts, draft_step)
        if cost is None and b == 0:
            cost = 1.0  # nothing measured yet: start plain, which measures B = 0
        if cost is not None:
            switching = switch_s / SWITCH_HORIZON if behind and any(k and x for k, x in zip(lengths, behind)) else 0.0
            switching += stop_s / SWITCH_HORIZON if b == 0 else 0.0
            candidates.append({"B": b, "D": d, "cost": cost, "gain": gain, "objective": gain / (cost + switching)})
    best = _best(candidates)
    budget = best["B"]
    lengths = allocate(surv, budget)
    plain = candidates[0]  # B = 0 is always the first candidate
    explored = bool(explore_plain and budget and (explore_margin is None or best["objective"] < explore_margin * plain["objective"]))
    if explored:
        lengths, budget = [0] * len(surv), 0
    elif probe and budget == 0 and ranked:
        drafting = _best_drafting(candidates)
        widest = allocate(surv, drafting["B"]) if drafting else [0] * len(surv)
        lengths = [max(k, int(bool(row))) for k, row in zip(widest, surv)]  # at least one token for each request with room
        budget = sum(lengths)
    return {"survival": surv, "candidates": candidates, "budget": budget, "allocation": lengths, "explored": explored}


def _best(candidates: list[dict]) -> dict:
    return max(candidates, key=lambda c: (c["objective"], -c["B"]))  # equal objectives: the smaller budget


def _best_drafting(candidates: list[dict]) -> dict | None:
    """The best candidate that drafts (what a probe drafts: where k = 1 costs nearly what k = 8
    does, as the 0.8 B draft's rounds do on the H200, a k = 1 probe can never pay, loses more than
    a deep one, and never observes the deeper positions that decide whether drafting pays)."""
    return _best([c for c in candidates if c["B"]]) if len(candidates) > 1 else None


def probe_interval(table: dict[str, float], n_requests: int, counts: dict[str, int] | None = None,
                   catch_up: float | None = None, first: Sequence[float] = (), discard: float | None = None,
                   behind: bool = False, restart: float = 0.0, drafting: dict | None = None,
                   draft_step: float | None = None) -> int:
    """Plain rounds between probes. A probe drafts at least one token for each joint request
    (`first`: their position-1 estimates), so a change of text shows in one round, not one
    request's in turn, and the drafting round's cost is measured again; it drafts the best drafting
    candidate's allocation where that is wider (`drafting`: that candidate of the last decision,
    its cost and gain). Its expected loss is its cost less the plain time of the tokens it expects
    (N + the sum of `first`, or the candidate's gain); probes come as often as keeps
    that under PROBE_SHARE of the plain time between them. Near where drafting pays a probe costs
    next to nothing and comes every FREE_SIT_OUT rounds, before any draft would have to catch up
    (unless one is `behind` already: a new request's draft lacks its prompt); else the probe's
    draft first catches up on the rounds it sat out, and `catch_up`, the median such catch-up,
    adds to its cost: a useless draft, or a launch-bound one on a GPU, is probed rarely.
    Unbatched plain rounds compute the next forward ahead; a batched probe throws it away:
    `discard`, the median such forward, adds to its cost too (an unbatched one takes its token),
    and so does `restart`, what the plain rounds after it pay to start the pipeline again
    (Scheduler._stop_seconds; left out, a useless draft was probed once a request and adaptive
    ran at 0.91 of baseline). Where no depth within reach would beat plain rounds even
    with every draft accepted, acceptance cannot change the decision, and probes come every
    HOPELESS_EVERY rounds (a tiny pair whose draft costs as much as its target lost 4% to probes
    and their catch-ups on requests of 1,536 tokens; a launch-bound draft on a GPU)."""
    plain, probe = estimate(table, n_requests, 0, 0, counts), estimate(table, n_requests, max(1, len(first)), 1, counts)
    if not plain or probe is None or not first:
        return PROBE_EVERY
    if not _could_pay(table, n_requests, len(first), counts, plain, draft_step):
        return HOPELESS_EVERY
    expected = plain * (n_requests + sum(first)) / n_requests  # plain time for what a probe yields
    if drafting is not None and drafting["B"] > len(first):
        probe, expected = drafting["cost"], plain * drafting["gain"] / n_requests
    loss = probe - expected + (discard or 0.0) + restart + _follow_ups(first) * max(0.0, probe - expected)
    if not behind and loss <= PROBE_SHARE * plain * (FREE_SIT_OUT + 1):
        return FREE_SIT_OUT
    return max(FREE_SIT_OUT + 1, math.ceil((loss + (catch_up or 0.0)) / (PROBE_SHARE * plain)))


def _follow_ups(first: Sequence[float]) -> float:
    """Probe rounds expected to follow a probe (one follows each that any draft hit, chance
    1 - Π(1 - a1)): at α = 0.6 on the H200 a probe was three rounds, not one, and, priced as one,
    probes cost plain decoding 4-5%."""
    miss = math.prod(1.0 - min(a, 1.0) for a in first)
    hit = min(1.0 - miss, MAX_FOLLOW_HIT)
    return hit / (1.0 - hit)


def _could_pay(table: dict[str, float], n: int, joint: int, counts: dict[str, int] | None, plain: float,
               draft_step: float | None = None) -> bool:
    """Whether drafting d tokens for each of `joint` requests, all accepted, beats plain rounds
    at some depth d within reach (one past the deepest measured: the extrapolation past it is
    optimistic enough to make any draft look worth a probe) or, with the measured `draft_step`,
    at any depth up to POSITIONS priced at the least it can cost: the reach's round and a draft
    step more a depth (the H200's k = 1 cost 3 plain rounds and k = 8 3.5; from k = 1 alone no
    depth within reach paid, and in simulation α = 0.95 stayed plain for whole runs: 0.66 of k = 8)."""
    reach = _reach(table, n)
    for d in range(1, POSITIONS + 1):
        if d <= reach:
            cost = estimate(table, n, joint * d, d, counts)
        elif draft_step is not None and reach >= 2:
            cost = estimate(table, n, joint * reach, reach, counts) + (d - reach) * draft_step
        else:
            break
        if cost is not None and (n + joint * d) / cost > n / plain:
            return True
    return False


def plain_probe_interval(d: dict, n_requests: int, restart: float = 0.0, discard: float = 0.0) -> int:
    """Rounds between measurements of plain rounds while drafting (`d`: the drafting decision).
    Nothing else measures them then, and a figure from another spell keeps drafting that loses or
    stops drafting that pays. Exploring costs the plain rounds' expected loss against the chosen
    configuration's time per token, a pipeline's `restart` where plain rounds are pipelined (the
    first PIPELINE_WARM_ROUNDS of them are set apart, the next measured) and the forward computed ahead that drafting
    again `discard`s; explorations come as often as keeps that under PROBE_SHARE of the time
    between them, and at most every PLAIN_GAP rounds."""
    cands = {c["B"]: c for c in d["candidates"]}
    best, plain = cands.get(d["budget"]), cands.get(0)
    if best is None or plain is None or not d["budget"]:
        return PLAIN_GAP
    rounds = 1 + PIPELINE_WARM_ROUNDS if restart else 1
    loss = restart + discard + rounds * max(0.0, plain["cost"] - n_requests * best["cost"] / best["gain"])
    return max(PLAIN_GAP, math.ceil(loss / (PROBE_SHARE * best["cost"])))


# ---- the scheduler the engine runs ----

LOG_BATCH = 256  # decision-log records encoded together (Scheduler.flush_log)
POSITIONS = 8  # deepest draft of one request
DEFAULT_B_MAX = 16  # drafted tokens in one round, all requests together
DECISION_SHARE = 0.01  # a decision may cost this share of the rounds it governs ...
MAX_HOLD = 16  # ... so where rounds take a few ms, one decision governs up to this many rounds


class Scheduler:
    """Chooses each round's draft lengths: adaptive (the rule above) or fixed per request."""

    def __init__(self, fixed: int | None = None, b_max: int = DEFAULT_B_MAX, log_path: str | None = None):
        self.fixed, self.b_max = fixed, b_max
        self.cost = CostModel()
        self.acceptance: dict[str, Acceptance] = {}
        # every request's cycles: each request's prior. Only here does a change forget the deeper
        # positions too: each request's own false alarms (two rejections at α = 0.9) then reset its
        # deeper positions, and α = 0.9 ×4 drafted unevenly ((3, 4, 3, 4)), 0.91 of k = 4
        # it decays by rounds, not by cycles: with 4 requests, decayed per cycle, it remembered ~5
        # rounds, and its position-1 reading at α = 0.3 wandered 0.14-0.33 across the point where
        # k = 1 pays (0.21; realised 0.27), which decided the row's near-tie by noise
        self.overall = Acceptance(POSITIONS, forget_deeper=True, per_round=True)
        self.longrun = Acceptance(POSITIONS, LONG_DECAY, detect_change=False)  # the same over the long run: overall's prior
        self.rounds = 0
        self.rounds_without_draft = 0
        self._round: tuple[int, int, int] | None = None
        self._log = open(log_path, "a") if log_path else None
        self._unwritten: list[dict] = []  # log records not yet encoded (see `flush_log`)
        self._held: tuple[list[str], list[int]] | None = None  # the last decision: (requests, lengths)
        self._hold_left = 0  # rounds it still governs
        self._probe_every = PROBE_EVERY
        self._plain_every: dict[int, int] = {}  # by N: drafting rounds between plain rounds measured
        self._drafting_best: dict[int, dict | None] = {}  # by N: the last decision's best drafting candidate (what a probe drafts)
        self._drafting = False  # see `drafting`
        self._probing = False  # this round is a probe
        self._probe_hit = False  # ... and one of its drafts was accepted: the next round probes too
        self._explorable = True  # the held decision leads plain by less than EXPLORE_MARGIN (see `plan`)
        self._peak = (0, 0)  # the most requests a decision saw lately, and its round (a batch's tail is under it)

    def plan(self, joint_ids: list[str], n_requests: int, behind: Sequence[bool] | None = None,
             room: Sequence[int] | None = None, ahead: Sequence[bool] | None = None,
             pipelined: bool = False, feeds: Sequence[int] | None = None) -> list[int]:
        """Draft length for each joint request of this round (n_requests counts baseline ones);
        `behind`: whose draft would first have to catch up (see `decide`); `room`: the most
        drafts each request's cycle can still use (its remaining tokens less the one a cycle adds);
        `ahead`: whose plain rounds computed a forward ahead (drafting throws it away); `pipelined`:
        plain rounds of these requests would be pipelined (unbatched), so stopping restarts that;
        `feeds`: the tokens each one's draft would feed apart before drafting (its catch-up, priced
        by them: `CostModel.feed_seconds`; None: at the median catch-up)."""
        self.cost.commit()  # the previous round, now known to be complete
        self.rounds += 1
        caps = list(room) if room is not None else [None] * len(joint_ids)
        if not joint_ids:  # baseline requests only: nothing to decide, the round is timed all the same
            lengths: list[int] = []
        elif self.fixed is not None:
            lengths = [self.fixed if c is None else min(self.fixed, c) for c in caps]
        elif self._held and self._held[0] == joint_ids and self._hold_left > 0 and not self._probe_hit \
                and (self.rounds_without_draft < self._probe_every or any(self._held[1])) \
                and not (any(self._held[1]) and self._explorable and self._plain_due(n_requests)):
            self._hold_left -= 1
            lengths = [k if c is None else min(k, c) for k, c in zip(self._held[1], caps)]
            if self._log:
                self._record({"round": self.rounds, "requests": joint_ids, "held": True, "allocation": lengths})
        else:
            d = self._decide(joint_ids, n_requests, behind, caps, ahead, pipelined, feeds)
            lengths = d["allocation"]
            if any(c is None or c > 0 for c in caps):  # a request's last round has no room to draft
                self._drafting = bool(d["budget"]) and not d["probe"]
            self._probe_hit = False
            self._probing = bool(d["budget"]) and d["probe"] and _best(d["candidates"])["B"] == 0
            self._held = (list(joint_ids), lengths)
            self._hold_left = self._hold_rounds(d, d["decide_s"])
            # a due plain exploration ends the hold only where it would be taken (a lead under EXPLORE_MARGIN):
            # at α = 0.95 on the H200, k = 8 leading 2×, every round decided again once plain rounds were due
            best, plain = _best(d["candidates"]), d["candidates"][0]
            self._explorable = d["margin"] is None or best["objective"] < d["margin"] * plain["objective"]
            if d["explored"] and pipelined:  # the first plain rounds restart the pipeline: measure the next
                self._hold_left = max(self._hold_left, PIPELINE_WARM_ROUNDS)
        drafted = sum(lengths)
        self.rounds_without_draft = 0 if drafted else self.rounds_without_draft + 1
        if self.fixed is None:
            self._fade(joint_ids, lengths)
        self._round = (n_requests, drafted, max(lengths, default=0))
        return lengths

    def _decide(self, joint_ids: list[str], n_requests: int, behind: Sequence[bool] | None,
                caps: list[int | None], ahead: Sequence[bool] | None = None, pipelined: bool = False,
                feeds: Sequence[int] | None = None) -> dict:
        """The rule's decision, logged; "decide_s": what deciding took (logging aside)."""
        t0 = time.perf_counter()
        shared = self.shared_rates()
        rates = [self._acceptance(i).rates(shared)[:c] for i, c in zip(joint_ids, caps)]
        table, counts = self.cost.table_and_counts()
        catch_up = probe_catch_up = self.cost.catch_up_seconds(n_requests)
        if feeds is not None and catch_up is not None:  # priced by the tokens each draft would feed:
            # now, where drafting starts now, and, for a probe, at least what one after a sit-out feeds (FREE_SIT_OUT + 1 rounds: 4 tokens)
            catch_up = sum(self.cost.feed_seconds(n_requests, f) for f in feeds)
            probe_catch_up = sum(self.cost.feed_seconds(n_requests, max(f, FREE_SIT_OUT + 2)) for f in feeds)
        discard = self.cost.catch_up_seconds(n_requests, DISCARD_REASONS)
        restart = self._stop_seconds(table, counts, n_requests) if pipelined else 0.0
        self._probe_every = probe_interval(table, n_requests, counts, probe_catch_up, [r[0] for r in rates if r],
                                           discard, any(behind or []), restart, self._drafting_best.get(n_requests),
                                           self.cost.draft_step(n_requests))
        if self.longrun.tried[0] < FEW_OBSERVED and self._probe_every != HOPELESS_EVERY:
            # a guess from a few cycles (3 early rejections at α = 0.6 read 0.14-0.20), priced by that
            # guess, kept probes away for 280 rounds; every PROBE_EVERY rounds, with a pipeline restart
            # after each, they cost α = 0.3 on one request 10%: until the draft is known, 5× as often
            self._probe_every = max(PROBE_EVERY, math.ceil(self._probe_every * PROBE_SHARE / UNCERTAIN_SHARE))
        # a probe whose draft was accepted is followed by another: one observation among SHARED_WEIGHT
        # moves nothing, and probes far apart never fill the short memory that sees a change (α 0.9
        # → 0.2 → 0.9, one request: probes every ~48 plain rounds, each hit lost, plain through the
        # α = 0.9 thirds; 0.89 of k = 1). Consecutive hits do: three forget the older rate
        probe = self.rounds_without_draft >= self._probe_every or self._probe_hit
        behind = list(behind or [False] * len(joint_ids))
        ahead = list(ahead or [False] * len(joint_ids))
        switch_s = ((catch_up or 0.0) if any(behind) else 0.0) + ((discard or 0.0) if any(ahead) else 0.0)
        behind = [b or a for b, a in zip(behind, ahead)]
        stop_s = restart if not any(ahead) else 0.0
        plain_rounds = counts.get(f"{n_requests},0,0", 0)
        explore = self._plain_due(n_requests, plain_rounds)
        # with fewer than MIN_SAMPLES plain rounds the lead itself is a guess: explore whatever it is (at α = 0.6
        # on one request two plain rounds in 370, the plain round priced as k = 1's, k = 3 led 1.9× and nothing
        # measured plain again: 0.80 of k = 1)
        # ... but not in a batch's tail (N under the last PLAIN_GAP rounds' most): its few rounds would all be
        # explorations (α = 0.9 ×4: tails of 1-3 requests decoded plain against leads of 1.26-1.50)
        if n_requests >= self._peak[0] or self.rounds - self._peak[1] > PLAIN_GAP:
            self._peak = (n_requests, self.rounds)
        margin = EXPLORE_MARGIN if plain_rounds >= MIN_SAMPLES or n_requests < self._peak[0] else None
        draft_step = self.cost.draft_step(n_requests)
        d = decide(rates, n_requests, table, self.b_max, probe, counts, behind, switch_s, stop_s, explore, draft_step, margin)
        self._drafting_best[n_requests] = _best_drafting(d["candidates"])
        if d["budget"]:
            self._plain_every[n_requests] = plain_probe_interval(d, n_requests, restart, (discard or 0.0) if pipelined else 0.0)
        decide_s = time.perf_counter() - t0
        if self._log:
            self._record({"round": self.rounds, "requests": joint_ids, "n_requests": n_requests,
                                        "b_max": self.b_max, "probe": probe, "acceptance": rates,
                                        "cost_table": table, "cost_counts": counts, "behind": behind,
                          "switch_s": switch_s, "stop_s": stop_s, "explore_plain": explore,
                          "explore_margin": margin, "draft_step_s": draft_step, **d})
        d["probe"], d["decide_s"], d["margin"] = probe, decide_s, margin
        return d

    def _plain_due(self, n: int, plain_rounds: int | None = None) -> bool:
        """Plain rounds of n requests are due to be measured again (see `plain_probe_interval`);
        `plain_rounds`: the plain cell's count (None: its rounds kept, as a hold checks it)."""
        if plain_rounds is None:
            plain_rounds = len(self.cost.cells.get((n, 0, 0), ()))
        gap = self._plain_every.get(n, PLAIN_GAP) if plain_rounds >= MIN_SAMPLES else FEW_PLAIN_GAP
        return self.cost.rounds - self.cost.newest((n, 0, 0)) >= gap

    def _stop_seconds(self, table: dict[str, float], counts: dict[str, int], n: int) -> float:
        """What the pipelined plain rounds that restart a pipeline cost over steady ones: the
        start's median and PIPELINE_WARM_ROUNDS - 1 warm-up rounds' median, less a plain round each.
        The start computes the next round's forward too; where drafting again takes that forward's
        token (JointDecoder.take_ahead), it gives back a plain round less the wait for it."""
        plain = estimate(table, n, 0, 0, counts)
        if plain is None:
            return 0.0
        start, warm, taken = (self.cost.catch_up_seconds(n, (why,)) for why in PIPELINE_REASONS + TAKEN_REASONS)
        back = plain - taken if taken is not None else 0.0
        return (max(0.0, start - plain - back) if start is not None else 0.0) \
            + (PIPELINE_WARM_ROUNDS - 1) * (max(0.0, warm - plain) if warm is not None else 0.0)

    @staticmethod
    def _hold_rounds(d: dict, decide_s: float) -> int:
        """Further rounds a decision governs: none where a round costs much more than deciding
        (the embedded model's 50 ms), up to MAX_HOLD where it does not (a tiny model's 2 ms round
        against 0.1-0.2 ms of Python), judged by the chosen round's estimated cost. A probe is one
        round; a new or finished request, a due probe or a due plain exploration that would be
        taken (drafting leads by less than EXPLORE_MARGIN) ends a hold; room caps apply every round."""
        if d["probe"]:
            return 0
        cost = next(c["cost"] for c in d["candidates"] if c["B"] == d["budget"])
        return min(MAX_HOLD, int(decide_s / (DECISION_SHARE * cost)))

    def shared_rates(self) -> list[float]:
        """The server-wide estimate, on the long-run one as its prior (each request's prior)."""
        return self.overall.rates(self.longrun.rates(), PRIOR_WEIGHT)

    def _fade(self, joint_ids: list[str], lengths: list[int]) -> None:
        for rid, k in zip(joint_ids, lengths):
            if not k:
                self._acceptance(rid).fade()
        if joint_ids and (self.overall.per_round or not any(lengths)):
            # over plain rounds the server-wide estimate fades to the long-run one, worth FADE_WEIGHT
            # cycles, not to nothing: faded to nothing, the next probe's one cycle was most of it, a
            # miss took it to 2/3 of the long-run rate, and the next probes came as rarely as that
            # priced them (α = 0.3 on one request read 0.09-0.20 for a whole run and stayed plain
            # where k = 1 paid 11%: 0.90 of k = 1)
            plain = not any(lengths)
            self.overall.fade(recent=plain, toward=self.longrun.rates() if plain else None)

    def observe_cycle(self, request_id: str, k: int, n: int) -> None:
        if self._probing and n:
            self._probe_hit = True
        if k:
            self._acceptance(request_id).observe(k, n)
            self.overall.observe(k, n)
            self.longrun.observe(k, n)

    @property
    def drafting(self) -> bool:
        """The last decision with room to draft chose to (a probe aside; none made yet: False)."""
        return self._drafting

    def _record(self, rec: dict) -> None:
        self._unwritten.append(rec)
        if len(self._unwritten) >= LOG_BATCH:
            self.flush_log()

    def flush_log(self) -> None:
        """Encodes and writes the records held back (the engine calls it when idle). Encoded one
        by one in the decode loop, a decision record cost ~1.4 ms there on this CPU, 3% of the
        embedded model's 48 ms drafting round, where the same record encodes in 15 µs right after
        (cold caches after the round's compute, it seems): the bench's adaptive rows paid it."""
        if self._log and self._unwritten:
            self._log.write("".join(json.dumps(r) + "\n" for r in self._unwritten))
            self._log.flush()
            self._unwritten.clear()

    def observe_round(self, seconds: float, complete: bool, reason: str = "", apart: dict | None = None,
                      draft_s: float = 0.0) -> None:
        """The round's time, less `apart`: switching costs its requests paid on their own (a draft's
        catch-up, a discarded look-ahead), recorded apart by reason ({reason: seconds, or (seconds,
        tokens and pieces its catch-ups fed)}); `draft_s`: what of it its drafting took."""
        if self._round is None:
            return
        if self._log:
            self._record({"round": self.rounds, "observed": seconds, "shape": list(self._round),
                          "complete": complete, "reason": reason, "apart": dict(apart or {}), "draft_s": draft_s})
        for why, paid in (apart or {}).items():
            paid_s, *fed = paid if isinstance(paid, (tuple, list)) else (paid, 0, 0)
            self.cost.set_aside(self._round, paid_s, why, tuple(fed))
        if complete:
            self.cost.observe(self._round, seconds, draft_s)
        else:
            self.cost.set_aside(self._round, seconds, reason)
        self._round = None

    def interrupt(self, reason: str) -> None:
        """The last observed round turned out not to be a complete one."""
        self.cost.interrupt(reason)

    def _acceptance(self, request_id: str) -> Acceptance:
        if request_id not in self.acceptance:
            self.acceptance[request_id] = Acceptance(POSITIONS)
        return self.acceptance[request_id]

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def plan_round(self, inp: RoundInput) -> RoundPlan:
        """The round's draft length for each joint row (worker/round.py)."""
        rows = inp.rows
        ks = self.plan([r.request_id for r in rows], inp.n_requests, [r.behind for r in rows], [r.room for r in rows],
                       [r.ahead for r in rows], pipelined=inp.pipelined, feeds=[r.feed for r in rows])
        return RoundPlan({r.request_id: k for r, k in zip(rows, ks)})

    def observe(self, report: RoundReport) -> None:
        """A round as it ran: each cycle's acceptance, then the round's time."""
        for c in report.cycles:
            self.observe_cycle(c.request_id, c.k, c.accepted)
        apart = {str(why): (p.seconds, p.tokens, p.pieces) for why, p in report.apart.items()}
        self.observe_round(report.seconds, report.complete, str(report.reason or ""), apart, report.draft_s)


def replay(lines: Sequence[str]) -> list[str]:
    """Recomputes every logged decision from its inputs; returns the differences found."""
    diffs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("held") or "observed" in rec:
            continue  # a round the previous decision governed (Scheduler._hold_rounds), or a round's time
        got = decide(rec["acceptance"], rec["n_requests"], rec["cost_table"], rec["b_max"], rec["probe"],
                     rec.get("cost_counts"), rec.get("behind"), rec.get("switch_s", 0.0), rec.get("stop_s", 0.0),
                     rec.get("explore_plain", False), rec.get("draft_step_s"), rec.get("explore_margin", EXPLORE_MARGIN))
        for key in ("survival", "candidates", "budget", "allocation"):
            if not _same(got[key], rec[key]):
                diffs.append(f"line {i} (round {rec.get('round')}): {key} logged {rec[key]!r}, recomputed {got[key]!r}")
    return diffs


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-9 * max(1.0, abs(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
