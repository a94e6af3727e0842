"""The scheduler the engine runs: each round's draft lengths, adaptive or fixed, from the
acceptance estimates, the cost model and the decision rule, with the log every decision goes to."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from worker.round import FREE_SIT_OUT, PIPELINE_WARM_ROUNDS, Cell, RoundInput, RoundPlan, RoundReport, SetApart
from worker.scheduler.acceptance import LONG_DECAY, PRIOR_WEIGHT, Acceptance
from worker.scheduler.allocation import POSITIONS, allocate, survivals
from worker.scheduler.cost import DISCARD_REASONS, MIN_SAMPLES, PIPELINE_REASONS, TAKEN_REASONS, CostModel
from worker.scheduler.decide import (DRAFT_LEAD, EXPLORE_MARGIN, FEW_PLAIN_GAP, PLAIN_GAP, Candidate, Decision, _best,
                                     _best_drafting, decide, plain_probe_interval)
from worker.scheduler.probe import (FEW_OBSERVED, PROBE_DEPTH, PROBE_EVERY, Probe, plausible_acceptance, probe_count,
                                    probe_interval, probe_lengths)
from worker.scheduler.log import DecisionLog, cells_to_log
from worker.scheduler.table import estimate
from worker.scheduler.window import SWITCHING, NeverLose, WindowState

DEFAULT_B_MAX = 16  # unless set: drafted tokens in one round, all requests together, at the least ...
B_PER_ROW = 4  # ... and this many a request (at 32-64 rows no 16 drafted tokens pay: docs/scheduler.md)
B_CEILING = 256  # ... and never more (a decision over 256 takes ~5 ms at 64 rows)
DECISION_SHARE = 0.01  # a decision may cost this share of the rounds it governs ...
MAX_HOLD = 16  # ... so where rounds take a few ms, one decision governs up to this many rounds


class Scheduler:
    """Chooses each round's draft lengths: adaptive (`decide` over the acceptance estimates and
    the cost model) or fixed per request; docs/scheduler.md."""

    def __init__(self, fixed: int | None = None, b_max: int | None = None, log_path: str | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """`b_max`: drafted tokens a round may hold in all (None: by the rows, `round_budget`);
        `clock`: what a decision's own time is read with (the simulator's stands still)."""
        self.fixed, self.b_max, self.clock = fixed, b_max, clock
        self.cost = CostModel()
        self.acceptance: dict[str, Acceptance] = {}
        # the server-wide estimate, every request's prior: it decays by rounds, not cycles, and only
        # here does a fall forget the deeper positions too (docs/scheduler.md, "Acceptance estimates")
        self.overall = Acceptance(POSITIONS, forget_deeper=True, per_round=True)
        self.longrun = Acceptance(POSITIONS, LONG_DECAY, detect_change=False)  # the same over the long run: overall's prior
        self.rounds = 0
        self.rounds_without_draft = 0
        self._round: Cell | None = None  # the planned round's cell, until its time is observed
        self._log = DecisionLog(log_path) if log_path else None
        self._held: tuple[list[str], list[int]] | None = None  # the last decision: (requests, lengths)
        self._hold_left = 0  # rounds it still governs
        self._probe_every = PROBE_EVERY
        self._plain_every: dict[int, int] = {}  # by N: drafting rounds between plain rounds measured
        self._drafting_best: dict[int, Candidate | None] = {}  # by N: the last decision's best drafting candidate (what a probe drafts)
        self._drafting = False  # see `drafting`
        self._probing = False  # this round is a probe
        self._probe_hit = False  # ... and it accepted more drafts than expected: the next round probes too
        self._probe_left = 0.0  # drafts it must still accept to do so
        self._probes = 0  # probes run: their depth goes 1 to PROBE_DEPTH in turn
        self._probed: dict[str, int] = {}  # by request: the round a probe last drafted for it
        self._explorable = True  # the held decision leads plain by less than EXPLORE_MARGIN (see `plan`)
        self._peak = (0, 0)  # the most requests a decision saw lately, and its round (a batch's tail is under it)
        self.never_lose = NeverLose()  # drafting that loses to plain rounds stops (window.py)
        self._cycles: list[tuple[str, int, int]] = []  # the planned round's drafting cycles: request, drafted, accepted

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
        halted = self.fixed is None and bool(joint_ids) and self.never_lose.stopped(n_requests)
        if not joint_ids:  # baseline requests only: nothing to decide, the round is timed all the same
            lengths: list[int] = []
        elif self.fixed is not None:
            lengths = [self.fixed if c is None else min(self.fixed, c) for c in caps]
        elif self._holds(joint_ids, n_requests) and not (halted and any(self._held[1])):
            self._hold_left -= 1
            lengths = [k if c is None else min(k, c) for k, c in zip(self._held[1], caps)]
            if self._log:
                self._log.record({"round": self.rounds, "requests": joint_ids, "held": True, "allocation": lengths})
        else:
            d, probe, decide_s, margin = self._decide(joint_ids, n_requests, behind, caps, ahead, pipelined, feeds, halted)
            lengths = d.allocation
            if any(c is None or c > 0 for c in caps):  # a request's last round has no room to draft
                self._drafting = bool(d.budget) and not probe
            self._probe_hit = False
            self._probing = bool(d.budget) and probe and _best(d.candidates).b == 0
            if self._probing:
                self._probe_left = Probe.of(d.survival, lengths).gain + 1e-9
                self._probes += 1
                self._probed.update((rid, self.rounds) for rid, k in zip(joint_ids, lengths) if k)
            self._held = (list(joint_ids), lengths)
            self._hold_left = 0 if probe else self._hold_rounds(d, decide_s)
            # a due plain exploration ends the hold only where it would be taken (a lead under the margin)
            best, plain = _best(d.candidates), d.candidates[0]
            self._explorable = margin is None or best.objective < margin * plain.objective
            if d.explored and pipelined:  # the first plain rounds restart the pipeline: measure the next
                self._hold_left = max(self._hold_left, PIPELINE_WARM_ROUNDS)
        drafted = sum(lengths)
        self.rounds_without_draft = 0 if drafted else self.rounds_without_draft + 1
        self._cycles = []
        if self.fixed is None:
            self._fade(joint_ids, lengths)
        self._round = Cell(n_requests, drafted, max(lengths, default=0))
        return lengths

    def _holds(self, joint_ids: list[str], n_requests: int) -> bool:
        """The last decision governs this round too: the same requests, rounds of its hold left, and
        no probe due or followed (where it drafts nothing) nor a plain exploration due that would
        be taken (where it drafts)."""
        if not self._held or self._held[0] != joint_ids or self._hold_left <= 0 or self._probe_hit:
            return False
        drafts = any(self._held[1])
        return (self.rounds_without_draft < self._probe_every or drafts) \
            and not (drafts and self._explorable and self._plain_due(n_requests))

    def round_budget(self, n_requests: int) -> int:
        """Drafted tokens a round may hold in all: `b_max` where set, else DEFAULT_B_MAX or
        B_PER_ROW a request, at most B_CEILING."""
        if self.b_max is not None:
            return self.b_max
        return max(DEFAULT_B_MAX, min(B_CEILING, B_PER_ROW * n_requests))

    def _decide(self, joint_ids: list[str], n_requests: int, behind: Sequence[bool] | None,
                caps: list[int | None], ahead: Sequence[bool] | None = None, pipelined: bool = False,
                feeds: Sequence[int] | None = None, halted: bool = False) -> tuple[Decision, bool, float, float | None]:
        """The rule's decision, logged, with whether it probes, what deciding took (logging aside)
        and the exploration margin it applied; `halted`: the never-lose rule stopped drafting."""
        t0 = self.clock()
        shared = self.shared_rates()
        rates = [self._acceptance(i).rates(shared)[:c] for i, c in zip(joint_ids, caps)]
        table, counts = self.cost.table_and_counts()
        draft_steps = self.cost.draft_steps_now()
        rows, depth, shape = self._next_probe(joint_ids, rates, n_requests)
        catch_up, probe_catch_up = self._catch_up_seconds(n_requests, feeds, shape.lengths)
        discard = self.cost.catch_up_seconds(n_requests, DISCARD_REASONS)
        restart = self._stop_seconds(table, counts, n_requests) if pipelined else 0.0
        self._probe_every = self._probe_interval(table, counts, n_requests, rates, probe_catch_up, discard,
                                                 any(behind or []), restart, shape, draft_steps)
        probe = self.rounds_without_draft >= self._probe_every or self._probe_hit  # a probe that hit: another
        probe = probe and not halted
        behind = list(behind or [False] * len(joint_ids))
        ahead = list(ahead or [False] * len(joint_ids))
        switch_s = ((catch_up or 0.0) if any(behind) else 0.0) + ((discard or 0.0) if any(ahead) else 0.0)
        behind = [b or a for b, a in zip(behind, ahead)]
        stop_s = restart if not any(ahead) else 0.0
        plain_rounds = counts.get(Cell(n_requests, 0, 0), 0)
        explore = self._plain_due(n_requests, plain_rounds)
        margin = self._explore_margin(n_requests, plain_rounds)
        b_max = self.round_budget(n_requests)
        d = decide(rates, n_requests, table, b_max, probe, counts, behind, switch_s, stop_s, explore, draft_steps, margin,
                   True, rows, depth, halted, True, DRAFT_LEAD, rising=True)
        self._drafting_best[n_requests] = _best_drafting(d.candidates)
        if d.budget:
            self._plain_every[n_requests] = plain_probe_interval(d, n_requests, restart, (discard or 0.0) if pipelined else 0.0)
        decide_s = self.clock() - t0
        if self._log:
            self._log.record({"round": self.rounds, "requests": joint_ids, "n_requests": n_requests,
                              "b_max": b_max, "probe": probe, "acceptance": rates,
                              "cost_table": cells_to_log(table), "cost_counts": cells_to_log(counts), "behind": behind,
                              "switch_s": switch_s, "stop_s": stop_s, "explore_plain": explore,
                              "explore_margin": margin, "draft_step_s": draft_steps.get(n_requests),
                              "draft_steps_s": {str(k): v for k, v in draft_steps.items()}, "padding": True,
                              "probe_rows": rows, "probe_depth": depth, "halted": halted, "step_by_step": True, "lead": DRAFT_LEAD,
                              "rising_steps": True,
                              **d.to_log()})
        return d, probe, decide_s, margin

    def _catch_up_seconds(self, n: int, feeds: Sequence[int] | None,
                          probed: Sequence[int]) -> tuple[float | None, float | None]:
        """What the drafts' catch-ups cost: where drafting starts now, and for a probe (drafting
        `probed` per request), which feeds at least what a draft feeds after FREE_SIT_OUT + 1 plain
        rounds; by the tokens each feeds where `feeds` are known, else the median catch-up."""
        catch_up = probe_catch_up = self.cost.catch_up_seconds(n)
        if feeds is not None and catch_up is not None:
            catch_up = sum(self.cost.feed_seconds(n, f) for f in feeds)
            probe_catch_up = sum(self.cost.feed_seconds(n, max(f, FREE_SIT_OUT + 2)) for f, k in zip(feeds, probed) if k)
        return catch_up, probe_catch_up

    def _next_probe(self, joint_ids: list[str], rates: list[list[float]], n: int) -> tuple[list[int], int, Probe]:
        """The next probe: its requests (`probe_count` of those with room, the fewest observations at
        position 1 first, then those probed longest ago), its depth (1 to PROBE_DEPTH in turn; where
        the round is one request, the probe is the whole round: the last decision's best drafting
        candidate's, which observes the deeper positions) and what it drafts."""
        open_rows = [i for i, r in enumerate(rates) if r]
        order = sorted(open_rows, key=lambda i: (self._acceptance(joint_ids[i]).tried[0],
                                                 self._probed.get(joint_ids[i], -1), i))
        rows = sorted(order[:probe_count(len(open_rows))])
        surv = [survivals(r) for r in rates]
        best = self._drafting_best.get(n)
        depth = 1 + self._probes % PROBE_DEPTH
        if n == 1:
            depth = max([1] + (allocate(surv, best.b) if best else []))
        return rows, depth, Probe.of(surv, probe_lengths(surv, rows, depth))

    def _probe_interval(self, table: dict[Cell, float], counts: dict[Cell, int], n: int, rates: list[list[float]],
                        catch_up: float | None, discard: float | None, behind: bool, restart: float,
                        probe: Probe, draft_steps: dict[int, float]) -> int:
        """Plain rounds between probes (`probe_interval`; `draft_steps`: by N, as the decision
        reads them); until position 1 has FEW_OBSERVED observations over the long run, priced for
        the acceptance they plausibly allow (every position's long-run counts together), where
        probes may cost UNCERTAIN_SHARE of plain time."""
        uncertain = self.longrun.tried[0] < FEW_OBSERVED
        plausible = plausible_acceptance(sum(self.longrun.accepted), sum(self.longrun.tried)) if uncertain else None
        return probe_interval(table, n, counts, catch_up, [r[0] for r in rates if r], discard, behind, restart,
                              probe, draft_steps, plausible)

    def _explore_margin(self, n: int, plain_rounds: int) -> float | None:
        """The lead under which a due plain exploration is taken: EXPLORE_MARGIN; any lead (None)
        while the plain cell has fewer than MIN_SAMPLES rounds, except in a batch's tail (N under
        the most a decision saw in the last PLAIN_GAP rounds)."""
        if n >= self._peak[0] or self.rounds - self._peak[1] > PLAIN_GAP:
            self._peak = (n, self.rounds)
        return EXPLORE_MARGIN if plain_rounds >= MIN_SAMPLES or n < self._peak[0] else None

    def _plain_due(self, n: int, plain_rounds: int | None = None) -> bool:
        """Plain rounds of n requests are due to be measured again (see `plain_probe_interval`;
        FEW_PLAIN_GAP while the plain cell has fewer than MIN_SAMPLES rounds); `plain_rounds`: the
        plain cell's count (None: its rounds kept, as a hold checks it)."""
        if plain_rounds is None:
            plain_rounds = len(self.cost.cells.get(Cell(n, 0, 0), ()))
        gap = self._plain_every.get(n, PLAIN_GAP) if plain_rounds >= MIN_SAMPLES else FEW_PLAIN_GAP
        return self.cost.rounds - self.cost.newest(Cell(n, 0, 0)) >= gap

    def _stop_seconds(self, table: dict[Cell, float], counts: dict[Cell, int], n: int) -> float:
        """What the pipelined plain rounds that restart a pipeline cost over steady ones: the
        start's median and PIPELINE_WARM_ROUNDS - 1 warm-up rounds' median, less a plain round each.
        The start computes the next round's forward too; where drafting again takes that forward's
        token (the engine before the batch), it gives back a plain round less the wait for it. The
        batch reports none of these rounds apart: 0 there."""
        plain = estimate(table, n, 0, 0, counts)
        if plain is None:
            return 0.0
        start, warm, taken = (self.cost.catch_up_seconds(n, (why,)) for why in PIPELINE_REASONS + TAKEN_REASONS)
        back = plain - taken if taken is not None else 0.0
        return (max(0.0, start - plain - back) if start is not None else 0.0) \
            + (PIPELINE_WARM_ROUNDS - 1) * (max(0.0, warm - plain) if warm is not None else 0.0)

    @staticmethod
    def _hold_rounds(d: Decision, decide_s: float) -> int:
        """Further rounds a decision governs: as many as keep deciding under DECISION_SHARE of
        them, judged by the chosen round's estimated cost, MAX_HOLD at most (see `_holds`)."""
        cost = next(c.cost for c in d.candidates if c.b == d.budget)
        return min(MAX_HOLD, int(decide_s / (DECISION_SHARE * cost)))

    def shared_rates(self) -> list[float]:
        """The server-wide estimate, on the long-run one as its prior (each request's prior)."""
        return self.overall.rates(self.longrun.rates(), PRIOR_WEIGHT)

    def _fade(self, joint_ids: list[str], lengths: list[int]) -> None:
        """A round's fading: each request that drafted nothing, and the server-wide estimate (every
        round: it decays by rounds)."""
        for rid, k in zip(joint_ids, lengths):
            if not k:
                self._acceptance(rid).fade()
        if joint_ids and (self.overall.per_round or not any(lengths)):
            # over plain rounds the server-wide estimate's position 1 fades to the long-run one, worth
            # FADE_WEIGHT cycles, not to nothing
            plain = not any(lengths)
            self.overall.fade(recent=plain, toward=self.longrun.rates() if plain else None)

    def observe_cycle(self, request_id: str, k: int, n: int) -> None:
        if k:
            self._cycles.append((request_id, k, n))
        if self._probing and n:
            self._probe_left -= n
            self._probe_hit = self._probe_left < 0
        if k:
            self._acceptance(request_id).observe(k, n)
            self.overall.observe(k, n)
            self.longrun.observe(k, n)

    @property
    def drafting(self) -> bool:
        """The last decision with room to draft chose to (a probe aside; none made yet: False)."""
        return self._drafting

    def flush_log(self) -> None:
        """Writes the decision log's held-back records (the engine calls it when idle)."""
        if self._log:
            self._log.flush()

    def observe_round(self, seconds: float, complete: bool, reason: SetApart | str = "",
                      apart: dict[SetApart | str, float | tuple[float, int, int]] | None = None,
                      draft_s: float = 0.0) -> None:
        """The round's time, less `apart`: switching costs its requests paid on their own (a draft's
        catch-up, a discarded look-ahead), recorded apart by reason ({reason: seconds, or (seconds,
        tokens and pieces its catch-ups fed)}); `draft_s`: what of it its drafting took."""
        if self._round is None:
            return
        if complete and self.cost.stalled(self._round, seconds):  # no sample of drafting or of plain rounds
            complete, reason = False, SetApart.STALL
        stop = self._never_lose(seconds, complete, reason, apart) if self.fixed is None else None
        if self._log:
            self._log.record({"round": self.rounds, "observed": seconds, "shape": list(self._round),
                              "complete": complete, "reason": reason, "apart": dict(apart or {}), "draft_s": draft_s,
                              **({"cycles": [list(c) for c in self._cycles]} if self._cycles else {}),
                              **({"stopped": stop.to_log()} if stop else {})})
        for why, paid in (apart or {}).items():
            paid_s, *fed = paid if isinstance(paid, (tuple, list)) else (paid, 0, 0)
            self.cost.set_aside(self._round, paid_s, why, tuple(fed))
        if complete:
            self.cost.observe(self._round, seconds, draft_s)
        else:
            self.cost.set_aside(self._round, seconds, reason)
        self._round = None

    def _never_lose(self, seconds: float, complete: bool, reason: SetApart | str,
                    apart: dict[SetApart | str, float | tuple[float, int, int]] | None) -> WindowState | None:
        """A round, and what it paid apart, at the machine's pace, to the never-lose rule: complete,
        or set apart for what drafting costs (`SWITCHING`: counted with the drafting rounds); the
        state where it stopped drafting (None: it did not)."""
        switched = not complete and reason in SWITCHING
        if not (complete or switched):
            return None
        paid = sum(p[0] if isinstance(p, (tuple, list)) else p for p in (apart or {}).values())
        n, b = self._round.n, self._round.b
        emitted = n + sum(accepted for _, _, accepted in self._cycles)
        return self.never_lose.observe(n, self.rounds, emitted, (seconds + paid) / self.cost.pace, b,
                                       bool(b) and self._probing, switched)

    def window(self, n: int) -> WindowState:
        """The never-lose rule's state for n requests (window.py)."""
        return self.never_lose.state(n)

    def interrupt(self, reason: SetApart | str) -> None:
        """The last observed round turned out not to be a complete one."""
        self.cost.interrupt(reason)

    def _acceptance(self, request_id: str) -> Acceptance:
        if request_id not in self.acceptance:
            self.acceptance[request_id] = Acceptance(POSITIONS)
        return self.acceptance[request_id]

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self._probed.pop(request_id, None)

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
        apart = {why: (p.seconds, p.tokens, p.pieces) for why, p in report.apart.items()}
        self.observe_round(report.seconds, report.complete, report.reason or "", apart, report.draft_s)
