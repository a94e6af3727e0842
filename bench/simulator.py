"""A simulator of the adaptive draft budget, for trying a scheduler change in seconds before a
57-minute `verity bench sched` run:  python -m bench.simulator [--seeds N]

It runs the old engine's round (bench/rounds.py: plan_round, run_round) with stand-in decoders and a
simulated clock. A round costs the median that a table measured on this project's
CPU gives for its requests and deepest draft (from `verity bench sched --decision-log`), times
per-round noise and the machine's slow spells; the controlled draft's rule decides acceptance
(a position's draft is right with probability α, seeded by position, so every configuration meets
the same hard tokens); one request's plain rounds are pipelined (the first after drafting computes
a second forward, the next few warm up) and a draft that sat out catches up. What it leaves out:
costs that drift unevenly between cells (a slow spell of plain rounds alone) and the ratio pricing
that goes wrong on them, which is what the scheduler's explorations hedge against; so a change that
only explores less always looks better here than it is (plain rounds explored every 128 drafting
rounds instead of 64 gained α = 0.6 ×1 2% here and cost it 17% in a whole run). Pure Python, no MLX.

`--batch`: the batch engine of issue #53 instead (every request a row of one persistent batch,
every row computed at the round's widest width, no pipeline restarts, look-ahead or parking), its
round costs modelled from the machine's weights read, tokens' compute and draft steps
(`BatchCosts`), the scheduler called as the engine calls it (plan_round, observe). `--every`
prints every seed's ratio; `--rows TEXT` runs the rows whose name contains it; `--b-max 0` leaves
the round budget to the rows, as the engine does unless --max-round-budget is set.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable

from worker import scheduler as S
from bench.rounds import Row, joint_group, plan_round, run_round
from worker.round import CATCH_UP_LAG, CycleReport, Paid, RoundInput, RoundReport, RowState, SetApart

# medians (ms) by deepest draft, SmolLM2-135M with a 2-layer draft, 2-core CPU, 2026-12-01
EMBEDDED_X1 = {0: 32.2, 1: 43.9, 2: 62.0, 3: 68.0, 4: 76.0, 5: 77.0, 6: 88.0, 7: 100.0, 8: 99.0}
EMBEDDED_X4 = {0: 89.7, 1: 108.4, 2: 135.5, 3: 162.0, 4: 191.5, 5: 203.0, 6: 225.0, 7: 245.0, 8: 265.0}
# the H200's Qwen3.5-9B / 0.8B shapes (`verity bench gpu --decision-log`, 2026-12-03's medians: k = 1, 4, 8 and
# plain measured, the rest between; the 2026-12-02 figures, 6.0 to 18.5 ms, had drafting rounds 2-4 ms too cheap)
H200_X1 = {0: 6.5, 1: 19.8, 2: 20.1, 3: 20.3, 4: 20.5, 5: 21.0, 6: 21.6, 7: 22.1, 8: 22.7}
PROMPT = 64  # tokens a request's draft first feeds (its prompt)
BATCH_SHARE = {1: 0.35, 2: 0.65, 3: 0.86, 4: 1.0}  # a batch of n costs this share of 4's (the tail of a run)


@dataclass(frozen=True)
class Machine:
    prefill_s: float = 0.19  # a run's prefill, the same for every configuration
    catch_up_s: float = 0.006  # switching costs, seconds: a catch-up's, and each of its pieces' more
    piece_s: float = 0.0
    taken_s: float = 0.003
    warm_up_s: float = 0.004  # each warm-up round's extra after a drafting stretch
    first_warm_up_s: float = 0.004  # ... and after a request's start
    draft_step_s: float = 0.004
    spells: tuple = (0.9, 1.0, 1.0, 1.1, 1.2)  # the pace's factors, each for spell_s seconds
    spell_s: tuple = (5, 30)
    decide_s: float = 0.0005  # what a decision takes (it sets how long decisions hold: Scheduler._hold_rounds)


CPU = Machine()
# plain runs of one bench read 83-180 tok/s; a draft's catch-up cost 5-7 ms a piece (a shape's first time up to
# 10 more); after a stop the pipeline's restart round 12-29 ms and the rounds after it steady (2026-12-02's
# diagnostic: the 26, 61, 22, 58 ms of an earlier run did not reproduce)
H200 = Machine(prefill_s=0.03, catch_up_s=0.002, piece_s=0.006, taken_s=0.002, warm_up_s=0.001, first_warm_up_s=0.0,
               draft_step_s=0.0015, spells=(1.0, 1.0, 1.15, 1.4, 1.6), spell_s=(1, 6), decide_s=0.0002)


@dataclass
class Scenario:
    name: str
    alpha: Callable[[int, int], float]  # (output position, tokens a request) -> chance a draft is right
    requests: int
    costs: dict  # deepest draft -> ms, with `requests` requests
    tokens: int = 48
    runs: int = 16
    warm_runs: int = 2
    machine: Machine = CPU


class Spells:
    """The machine's pace: a factor that changes every few simulated seconds (Machine.spell_s)."""

    def __init__(self, rng: random.Random, machine: Machine = CPU):
        self.rng, self.machine, self.factor, self.until = rng, machine, 1.0, 0.0

    def at(self, now: float) -> float:
        if now >= self.until:
            self.factor = self.rng.choice(self.machine.spells)
            self.until = now + self.rng.uniform(*self.machine.spell_s)
        return self.factor


def _round_ms(sc: Scenario, n: int, depth: int) -> float:
    if n == sc.requests or sc.requests == 1:
        return sc.costs[depth]
    return EMBEDDED_X1[depth] if n == 1 else sc.costs[depth] * BATCH_SHARE[n]


def _hits(seed: int, position: int, k: int, alpha: float) -> int:
    n = 0
    while n < k and random.Random(seed * 1_000_003 + position + n).random() < alpha:
        n += 1
    return n


class SimClock:
    """Simulated seconds: the round's decoders advance it by what their work would cost."""

    def __init__(self):
        self.now, self.pace = 0.0, 1.0  # pace: this round's factor (the spell's, with noise)

    def __call__(self) -> float:
        return self.now


class SimDecoder:
    """A request of the controlled draft as a round's Decoder (bench/rounds.py): its draft is right
    by the controlled rule, and what its cycles would cost advances the clock."""

    def __init__(self, sc: Scenario, seed: int, clock: SimClock):
        self.sc, self.m, self.seed, self.clock = sc, sc.machine, seed, clock
        self.started, self.stats = True, None
        self.pos, self.lag, self.ahead, self.plain_run, self.drafted = 0, PROMPT, False, 0, False
        self.last_cycle, self.draft_s, self._apart, self._got = (0, 0), 0.0, {}, 0

    def state(self, request_id: str, tokens_left: int) -> RowState:
        return RowState(request_id, room=max(0, tokens_left - 1 - self.ahead), lag=self.lag,
                        lacks_prompt=not self.drafted, ahead=self.ahead, plain_run=self.plain_run,
                        has_drafted=self.drafted, last=tokens_left <= 1)

    def advance(self, k: int, last: bool) -> list[int]:
        """Unbatched (one request, pipelined): the round's cost, and a pipeline's restart."""
        self.clock.now += _round_ms(self.sc, 1, k) / 1000 * self.clock.pace
        if not k:
            if not self.ahead:
                self.clock.now += _round_ms(self.sc, 1, 0) / 1000 * self.clock.pace  # a second forward, for the next
            elif self.plain_run < S.PIPELINE_WARM_ROUNDS:
                self.clock.now += (self.m.warm_up_s if self.drafted else self.m.first_warm_up_s) * self.clock.pace
            self.ahead, self.plain_run = not last, self.plain_run + 1
        return self.cycle(k)

    def cycle(self, k: int) -> list[int]:
        if not k:
            self.lag += 1
            self.last_cycle, self._got = (0, 0), 1
            return [0]
        got = int(self.ahead)  # a look-ahead's token is taken as the cycle's first
        if self.lag > CATCH_UP_LAG:
            fed, why = self.lag - 1, SetApart.DRAFT_CATCH_UP if self.drafted else SetApart.DRAFT_PREFILL
            pieces = S.feed_pieces(fed)
            self._pay(why, Paid((self.m.catch_up_s + self.m.piece_s * pieces) * self.clock.pace, fed, pieces))
        if self.ahead:
            self._pay(SetApart.LOOK_AHEAD_TAKEN, Paid(self.m.taken_s * self.clock.pace))
        n = _hits(self.seed, self.pos + got, k, self.sc.alpha(self.pos + got, self.sc.tokens))
        self.ahead, self.plain_run, self.lag, self.drafted = False, 0, 1 if n == k else 2, True
        self.draft_s = k * self.m.draft_step_s * self.clock.pace
        self.last_cycle, self._got = (k, n), got + n + 1
        return [0] * self._got

    def _pay(self, why: SetApart, paid: Paid) -> None:
        self.clock.now += paid.seconds
        self._apart[why] = self._apart.get(why, Paid()).add(paid)

    def commit(self, kept: int) -> None:
        self.pos += kept

    def take_apart(self) -> dict[SetApart, Paid]:
        out, self._apart = self._apart, {}
        return out


def _sim_batch(sc: Scenario, clock: SimClock):
    """The batched joint round: one cost for every row, by its deepest draft."""
    def batch(decoders: list[SimDecoder], budgets: list[int]) -> list[list[int]]:
        clock.now += _round_ms(sc, len(decoders), max(budgets)) / 1000 * clock.pace
        return [d.cycle(k) for d, k in zip(decoders, budgets)]
    return batch


def simulate(sched: S.Scheduler, sc: Scenario, runs: int, rng: random.Random, spells: Spells,
             clock: SimClock) -> tuple[int, float]:
    """`runs` runs of sc.requests requests through the old engine's round (bench/rounds.py): (tokens, seconds)."""
    tokens, start = 0, clock.now
    batch = _sim_batch(sc, clock)
    for run in range(runs):
        rows = [Row(f"{run}-{i}", SimDecoder(sc, i, clock), sc.tokens) for i in range(sc.requests)]
        while rows:
            clock.pace = spells.at(clock.now) * math.exp(rng.gauss(0, 0.05))
            sr = plan_round(rows, sched)
            sched.observe(run_round(sr, lambda row, t: min(len(t), row.tokens_left), _raise, joint_group(sr, batch), clock))
            for r in rows:
                tokens += r.tokens_left - (left := sc.tokens - r.decoder.pos)
                r.tokens_left = left
                if not left:
                    sched.forget(r.request_id)
            rows = [r for r in rows if r.tokens_left]
        clock.now += sc.machine.prefill_s
    return tokens, clock.now - start


def _raise(row: Row, e: Exception) -> None:
    raise e


@dataclass(frozen=True)
class BatchCosts:
    """A round of the batch engine (issue #53), modelled, not measured: every row of the round is
    computed at its widest width 1 + D, one forward that costs the weights' read or its tokens'
    compute, whichever is more; a drafting round adds a fixed cost (the plain rounds' overlap
    lost, the draft's launch) and D draft steps over the rows that draft."""

    overhead_ms: float  # a forward's launches and sampling
    weights_ms: float  # the target's weights read
    row_ms: float  # each row's cache read
    token_ms: float  # each token's compute
    draft_fixed_ms: float
    step_ms: float  # a draft step ...
    step_row_ms: float  # ... and each drafting row's part of it

    def round_ms(self, n: int, lengths: list[int]) -> tuple[float, float]:
        """(the round, its drafting) in ms for n rows, the joint ones drafting `lengths`."""
        d = max(lengths, default=0)
        verify = self.overhead_ms + max(self.weights_ms + self.row_ms * n, self.token_ms * n * (1 + d))
        draft = self.draft_fixed_ms + d * (self.step_ms + self.step_row_ms * sum(k > 0 for k in lengths)) if d else 0.0
        return verify + draft, draft


# the H200's 9B / 0.8B shapes: memory-bound to ~200 tokens a forward; drafting priced so that α = 0.8 on one
# request pays 1.5× at k = 4, as the unbatched joint path measured (issue #53: 1.46-1.60)
GPU_BATCH = BatchCosts(2.0, 4.5, 0.03, 0.025, 2.0, 1.5, 0.01)
# an H100's 9B / 0.8B shapes as the batch engine ran them (2026-12-05: a plain round 7 ms at one row, 14 ms at 32;
# a drafting round 24.5 ms at one row and k = 2, 42 ms at 8 rows, 54 ms at 32): drafting pays nowhere
H100_BATCH = BatchCosts(2.0, 5.0, 0.23, 0.025, 9.0, 4.3, 0.3)
# one row of that H100 with its draft step in one launch (2026-12-06, 6ab4ac3: a plain round 7.7 ms, drafting
# rounds 18.5 ms at k = 2 and 20 ms at k = 4, from gpu-batch's fixed depths): drafting pays at one row
H100_ONE_ROW = BatchCosts(2.0, 5.0, 0.23, 0.025, 9.7, 0.45, 0.3)
# the 2-core CPU's SmolLM2-135M and its 2-layer draft: compute-bound past 7 tokens a forward; one request's
# plain and k = 1, 8 rounds as EMBEDDED_X1 measured (32, 44, 99 ms)
CPU_BATCH = BatchCosts(4.0, 28.0, 0.0, 4.0, 6.0, 5.0, 0.5)


@dataclass
class BatchScenario:
    """Rows of one persistent batch from their start to their end, `joint` of the `requests`
    drafting (the rest baseline), every row `tokens` long."""

    name: str
    alpha: Callable[[int, int], float]  # as Scenario's
    requests: int
    joint: int
    costs: BatchCosts
    machine: Machine
    tokens: int = 64
    runs: int = 4
    warm_runs: int = 1
    first_ms: float = 0.0  # what a round of a shape (rows, drafted, deepest) met the first time adds: a GPU
    # instantiating its CUDA graphs (an H100's 9B / 0.8B pair: 100-300 ms; docs/scheduler.md, "Stalls")
    switch_ms: float = 0.0  # a joint row that starts or stops drafting moves its cache out of the batch or back:
    # main's engine (issue #53), its round set apart as a batch switch, which no cell sees


def simulate_batch(sched: S.Scheduler, sc: BatchScenario, runs: int, rng: random.Random, spells: Spells,
                   clock: SimClock, met: set | None = None) -> tuple[int, float]:
    """`runs` runs of the batch engine's rounds (the scheduler's plan_round and observe, as the
    engine calls them): (tokens, seconds); `met`: the round shapes met so far (see `first_ms`)."""
    met = set() if met is None else met
    tokens, start = 0, clock.now
    for run in range(runs):
        clock.now += sc.machine.prefill_s
        left = {f"{run}-{i}": sc.tokens for i in range(sc.requests)}
        pos = dict.fromkeys(left, 0)
        joint, drafting = set(list(left)[:sc.joint]), set()
        while left:
            clock.pace = spells.at(clock.now) * math.exp(rng.gauss(0, 0.05))
            states = [RowState(r, room=left[r] - 1, has_drafted=True, last=left[r] <= 1) for r in left if r in joint]
            plan = sched.plan_round(RoundInput(states, len(left)))
            lengths = [plan.k(s.request_id) for s in states]
            round_ms, draft_ms = sc.costs.round_ms(len(left), lengths)
            switched = {s.request_id for s in states if bool(plan.k(s.request_id)) != (s.request_id in drafting)}
            drafting ^= switched
            switched = switched if sc.switch_ms else set()
            round_ms += sc.switch_ms * len(switched)
            shape = (len(left), sum(lengths), max(lengths, default=0))
            round_ms += sc.first_ms * (shape not in met)
            met.add(shape)
            clock.now += round_ms / 1000 * clock.pace
            cycles = []
            for r in list(left):
                k = plan.k(r)
                hits = _hits(int(r.split("-")[1]), pos[r], k, sc.alpha(pos[r], sc.tokens)) if k else 0
                if r in joint:
                    cycles.append(CycleReport(r, k, hits))
                got = min(hits + 1, left[r])
                pos[r], left[r], tokens = pos[r] + got, left[r] - got, tokens + got
                if not left[r]:
                    del left[r]
                    sched.forget(r)
            sched.observe(RoundReport(round_ms / 1000 * clock.pace, SetApart.BATCH_SWITCH if switched else None,
                                      draft_s=draft_ms / 1000 * clock.pace, cycles=cycles))
    return tokens, clock.now - start


def compare_batch(sc: BatchScenario, seed: int, ks=(0, 1, 2, 4),
                  b_max: int | None = S.DEFAULT_B_MAX) -> dict[str, float]:
    """Tokens/s of each fixed k and of adaptive on the batch engine, as `compare`; `b_max`:
    adaptive's drafted tokens a round (the engine's --max-round-budget; None: by the rows, as unset)."""
    out = {}
    decisions = DecisionClock(sc.machine.decide_s)
    for name, fixed in [(f"k={k}", k) for k in ks] + [("adaptive", None)]:
        rng, spells, clock = random.Random(seed), Spells(random.Random(seed + 1), sc.machine), SimClock()
        sched = S.Scheduler(fixed=fixed, b_max=b_max, clock=decisions.perf_counter)
        met: set = set()
        simulate_batch(sched, sc, sc.warm_runs, rng, spells, clock, met)
        tokens, seconds = simulate_batch(sched, sc, sc.runs, rng, spells, clock, met)
        out[name] = tokens / seconds
    return out


def batch_rows() -> list[BatchScenario]:
    """The batch engine's rows: `verity bench gpu-batch`'s (N = 1, 8, 32, 64 at α = 0.6 and 0.8, and
    half the requests joint at 8 and 32) and `verity bench batch`'s on the CPU (N = 1, 4, 8, 16)."""
    rows = [BatchScenario(f"gpu α={a} N={n}", lambda p, t, a=a: a, n, n, GPU_BATCH, H200, runs=3)
            for a in (0.6, 0.8) for n in (1, 8, 32, 64)]
    rows += [BatchScenario(f"gpu α=0.8 N={n} half", lambda p, t: 0.8, n, n // 2, GPU_BATCH, H200, runs=3) for n in (8, 32)]
    rows += [BatchScenario(f"h100 α={a} N={n}", lambda p, t, a=a: a, n, n, H100_BATCH, H200, runs=3)
             for a in (0.6, 0.8) for n in (1, 8, 32)]
    rows += [BatchScenario(f"h100 one launch α={a} N=1", lambda p, t, a=a: a, 1, 1, H100_ONE_ROW, H200, runs=3)
             for a in (0.6, 0.8)]
    rows += [BatchScenario(f"cpu α={a} N={n}", lambda p, t, a=a: a, n, n, CPU_BATCH, CPU, tokens=48)
             for a in (0.6, 0.9) for n in (1, 4, 8, 16)]
    # main's engine: rows moving out of the batch and back, 2 ms each (a probe of 32 rows at 10× a plain round)
    rows += [BatchScenario(f"gpu α={a} N={n} switch", lambda p, t, a=a: a, n, n, GPU_BATCH, H200, runs=3, switch_ms=2.0)
             for a in (0.6, 0.8) for n in (8, 32)]
    # a GPU's first rounds of each shape (its CUDA graphs instantiated), 150 ms each
    rows += [BatchScenario(f"gpu α={a} N={n} first shapes", lambda p, t, a=a: a, n, n, GPU_BATCH, H200, runs=3,
                           first_ms=150.0) for a in (0.6, 0.8) for n in (8, 32)]
    return rows


class DecisionClock:
    """Stands in for the scheduler's clock, so that every decision takes Machine.decide_s and a
    run does not depend on what else the machine running the simulation does."""

    def __init__(self, decide_s: float):
        self.now, self.step = 0.0, decide_s  # read before and after a decision

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def compare(sc: Scenario, seed: int, ks=(0, 1, 2, 4)) -> dict[str, float]:
    """Tokens/s of each fixed k and of adaptive, each a fresh scheduler meeting the same draws."""
    out = {}
    decisions = DecisionClock(sc.machine.decide_s)
    for name, fixed in [(f"k={k}", k) for k in ks] + [("adaptive", None)]:
        rng, spells, clock = random.Random(seed), Spells(random.Random(seed + 1), sc.machine), SimClock()
        sched = S.Scheduler(fixed=fixed, clock=decisions.perf_counter)
        simulate(sched, sc, sc.warm_runs, rng, spells, clock)
        tokens, seconds = simulate(sched, sc, sc.runs, rng, spells, clock)
        out[name] = tokens / seconds
    return out


def bench_rows() -> list[Scenario]:
    """The embedded rows of `verity bench sched`."""
    def const(a):
        return lambda p, n: a

    def schedule(p, n):
        return (0.9, 0.2, 0.9)[min(2, 3 * p // n)]

    rows = []
    for n, costs, runs in ((1, EMBEDDED_X1, 16), (4, EMBEDDED_X4, 4)):
        for a in (0.3, 0.6, 0.9):
            rows.append(Scenario(f"α={a} ×{n}", const(a), n, costs, runs=runs))
        rows.append(Scenario(f"α 0.9→0.2→0.9 ×{n}", schedule, n, costs, runs=runs))
    return rows


def gpu_rows() -> list[Scenario]:
    """The adaptive rows of `verity bench gpu` (one request of 64 tokens, 4 repeats, its spells)."""
    return [Scenario(f"H200 α={a}", lambda p, n, a=a: a, 1, H200_X1, tokens=64, runs=4, warm_runs=2, machine=H200)
            for a in (0.6, 0.8, 0.95)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--gpu", action="store_true", help="the H200 rows of `verity bench gpu` instead")
    p.add_argument("--batch", action="store_true", help="the batch engine's rows (issue #53) instead")
    p.add_argument("--rows", default="", help="only the rows whose name contains this")
    p.add_argument("--every", action="store_true", help="print every seed's ratio")
    p.add_argument("--b-max", type=int, default=S.DEFAULT_B_MAX,
                   help="adaptive's drafted tokens a round (--batch; 0: by the rows, the engine's default)")
    args = p.parse_args(argv)
    rows = batch_rows() if args.batch else gpu_rows() if args.gpu else bench_rows()
    for sc in [sc for sc in rows if args.rows in sc.name]:
        best, plain = [], []
        for seed in range(args.seeds):
            if args.batch:
                o = compare_batch(sc, seed, b_max=args.b_max or None)
            else:
                o = compare(sc, seed, (0, 4, 8) if args.gpu else (0, 1, 2, 4))
            best.append(o["adaptive"] / max(v for k, v in o.items() if k.startswith("k=")))
            plain.append(o["adaptive"] / o["k=0"])
        line = f"{sc.name:18s} adaptive ÷ best fixed k (k = 0 included): median {statistics.median(best):.3f}, " \
               f"least {min(best):.3f}; ÷ plain: median {statistics.median(plain):.3f}, least {min(plain):.3f}"
        print(line + (f" over {args.seeds} seeds" if not args.every else
                      "\n    ÷ best: " + " ".join(f"{r:.3f}" for r in best) + "\n    ÷ plain: " + " ".join(f"{r:.3f}" for r in plain)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
