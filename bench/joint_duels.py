"""Cycle-interleaved duels for `verity bench joint`: verity's joint decoding (fast recovery) and
mlx-lm's speculative_generate_step take turns one cycle at a time on the same target, draft and
k, which resolves their ratio far better than whole runs on a shared machine."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from bench.joint_rows import Group


class VerityCycles:
    """verity's engine (fast recovery, a fixed k) one round at a time, one request in it: a round
    is a cycle. A generation restarts after n tokens; its prefill and the rounds up to its first
    token are not timed (as mlx-lm's first cycle)."""

    def __init__(self, target, draft, prompt: list[int], k: int, n: int):
        from bench import engine_runs as er

        self.engine = er.engine(target, draft, k, "fast")
        self.request = er.request(prompt, n, "joint")
        self.out, self.finished, self.started = [], [], 0

    def _step(self) -> int:
        from protocol import messages as m

        got = 0
        for ev in self.engine.step():
            if isinstance(ev, m.Error):
                raise RuntimeError(ev.message)
            if isinstance(ev, m.TextDelta):
                self.out += ev.token_ids
                got += len(ev.token_ids)
        return got

    def cycle(self) -> tuple[float, int]:
        if not self.engine.has_work():
            if self.started:
                self.finished.append(self.out)
            self.started += 1
            self.out = []
            self.engine.submit(f"duel-{self.started}", self.request)
            while not self._step():
                pass
        t0 = time.perf_counter()
        got = self._step()
        return time.perf_counter() - t0, got


class MlxCycles:
    """mlx-lm's speculative_generate_step one cycle at a time (a cycle ends with the target's own token;
    it includes the previous cycle's cache rewind); the first cycle of each generation holds the
    prefill and is not timed."""

    def __init__(self, model, draft, prompt: list[int], k: int, n: int):
        self.model, self.draft, self.prompt, self.k, self.n = model, draft, prompt, k, n
        self.gen, self.out, self.finished = None, [], []

    def _one(self) -> int:
        m = 0
        for tok, _, from_draft in self.gen:
            self.out.append(int(tok))
            m += 1
            if not from_draft or len(self.out) >= self.n:
                break
        return m

    def cycle(self) -> tuple[float, int]:
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step

        while self.gen is None or len(self.out) >= self.n:
            if self.gen is not None:
                self.gen.close()
                self.finished.append(self.out)
            self.gen = speculative_generate_step(mx.array(self.prompt), self.model, self.draft,
                                                 num_draft_tokens=self.k, max_tokens=self.n)
            self.out = []
            self._one()
        t0 = time.perf_counter()
        m = self._one()
        return time.perf_counter() - t0, m


def duel(g: Group, draft_name: str, k: int, cycles: int) -> dict:
    """verity (fast) and mlx-lm alternate single cycles (ABBA), so that drift on a shared machine
    hits both alike; returns their tokens/s over all timed cycles and the ratio."""
    draft = g.duel_drafts[draft_name]
    players = [VerityCycles(g.target, draft, g.prompt, k, g.tokens),
               MlxCycles(g.target.model, draft.model, g.prompt, k, g.tokens)]
    for p in players:  # warm-up
        for _ in range(max(3, cycles // 10)):
            p.cycle()
    timed = [[], []]
    for i in range(cycles):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            timed[j].append(players[j].cycle())
    rate = [sum(m for _, m in t) / sum(dt for dt, _ in t) for t in timed]
    block = max(5, cycles // 10)

    def block_rate(t: list, b: int) -> float:
        return sum(m for _, m in t[b : b + block]) / sum(dt for dt, _ in t[b : b + block])

    blocks = [block_rate(timed[0], b) / block_rate(timed[1], b) for b in range(0, cycles - block + 1, block)]
    q = statistics.quantiles(blocks, n=4) if len(blocks) >= 2 else [blocks[0]] * 3
    ref = g.reference[: g.tokens]
    outs = [o for p in players for o in p.finished]
    mism = max((sum(a != b for a, b in zip(o, ref)) + abs(len(o) - len(ref)) for o in outs), default=0)
    return {"cycles": cycles, "verity_tps": rate[0], "mlx_tps": rate[1], "ratio": rate[0] / rate[1],
            "block_ratio_median": statistics.median(blocks), "block_ratio_iqr": [q[0], q[2]],
            "tokens_per_cycle": sum(m for _, m in timed[0]) / cycles,
            "generations_checked": len(outs), "mismatches": mism}


def run_duels(g: Group, s: argparse.Namespace, progress: Callable[[str], None]) -> None:
    if not g.duel_drafts or s.duel_cycles <= 0:
        return
    for name in g.duel_drafts:
        for k in s.ks:
            t0 = time.perf_counter()
            d = g.duels.setdefault(name, {})[str(k)] = duel(g, name, k, s.duel_cycles)
            progress(f"[{g.name}] duel, {name} draft, k={k}: verity {d['verity_tps']:.1f} tok/s, mlx-lm "
                     f"{d['mlx_tps']:.1f} → {d['ratio']:.3f} ({time.perf_counter() - t0:.0f}s)")

