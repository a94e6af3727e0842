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
    """verity's joint decoding (fast recovery) one cycle at a time; restarts (prefill untimed) after n tokens."""

    def __init__(self, model, draft, prompt: list[int], k: int, n: int):
        self.model, self.draft, self.prompt, self.k, self.n = model, draft, prompt, k, n
        self.jd, self.out, self.finished = None, [], []

    def cycle(self) -> tuple[float, int]:
        from worker.joint.draft import Drafter
        from worker.joint.decoder import JointDecoder
        from worker.joint.sampling import SamplingParams

        if self.jd is None or len(self.out) >= self.n:
            if self.jd is not None:
                self.finished.append(self.out)
            self.jd = JointDecoder(self.model, Drafter(self.draft, recovery="fast"), self.prompt, SamplingParams(),
                                   recovery="fast")
            self.out = [self.jd.start()]
        t0 = time.perf_counter()
        emitted = self.jd.cycle(min(self.k, self.n - len(self.out) - 1))
        keep = min(len(emitted), self.n - len(self.out))
        self.jd.commit(keep)
        dt = time.perf_counter() - t0
        self.out += emitted[:keep]
        return dt, keep


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
    players = [VerityCycles(g.target.model, draft, g.prompt, k, g.tokens),
               MlxCycles(g.target.model, draft, g.prompt, k, g.tokens)]
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

