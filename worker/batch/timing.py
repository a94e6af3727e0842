"""Plain rounds timed on rows of their own, for the BLAS's thread calibration (worker/blas_threads.py)."""

from __future__ import annotations

import time

import mlx.core as mx

from worker.batch.rows import Phase, Row
from worker.batch.runner import WARM, BatchRunner
from worker.joint.sampling import make_key_fn
from worker.sampling import RowSampling

UNTIMED_ROUNDS = 2  # the first rounds fill the pipeline


class PlainRounds:
    """Times pipelined plain rounds, as served (each round reads the tokens of the one before), of
    rows of `tokens` that join an empty batch and stay while the row count asked stays the same
    (a prompt is prefilled once, whatever is timed on it); `close` lets them leave."""

    def __init__(self, runner: BatchRunner, tokens: list[int], rounds: int):
        if runner.rows:
            raise ValueError("plain rounds are timed on an empty batch only")
        self.runner, self.tokens, self.rounds = runner, tokens, rounds
        self.ids: list[str] = []

    def __call__(self, rows: int) -> float:
        """Mean seconds of a round of `rows` rows, over `rounds` after UNTIMED_ROUNDS."""
        if len(self.ids) != rows:
            self.close()
            self._join(rows)
        for _ in range(UNTIMED_ROUNDS):
            self.runner.decode({})
        t0 = time.perf_counter()
        for _ in range(self.rounds):
            self.runner.decode({})
        self.runner.decode({})  # reads the last timed round's tokens
        seconds = (time.perf_counter() - t0) / (self.rounds + 1)
        mx.eval(self.runner.target.arrays())
        return seconds

    def _join(self, rows: int) -> None:
        self.ids = [f"{WARM}t{i}" for i in range(rows)]
        for i, rid in enumerate(self.ids):
            self.runner.join(Row(rid, self.tokens[: len(self.tokens) - i], RowSampling(), make_key_fn(0)))
        while any(self.runner.rows[rid].phase == Phase.PREFILL for rid in self.ids):
            self.runner.prefill()

    def close(self) -> None:
        for rid in self.ids:
            self.runner.leave(rid)
        self.ids = []
