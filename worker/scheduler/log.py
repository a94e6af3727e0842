"""The decision log: every decision with its inputs, as JSON lines, and `replay`, which
recomputes each from its inputs (`verity replay`); docs/scheduler.md, "The decision log". Cells
are written "N,B,D" and decisions as `Decision.to_log` writes them, so every log replays."""

from __future__ import annotations

import json
from typing import Sequence

from worker.round import Cell
from worker.scheduler.decide import EXPLORE_MARGIN, Decision, decide
from worker.scheduler.probe import PROBE_DEPTH

LOG_BATCH = 256  # records encoded together (see DecisionLog.flush)


class DecisionLog:
    """JSON lines, held back and encoded together (LOG_BATCH at a time, and at `flush`): encoding
    each record in the decode loop slowed the rounds."""

    def __init__(self, path: str):
        self.file = open(path, "a")
        self.unwritten: list[dict] = []

    def record(self, rec: dict) -> None:
        self.unwritten.append(rec)
        if len(self.unwritten) >= LOG_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.unwritten:
            self.file.write("".join(json.dumps(r) + "\n" for r in self.unwritten))
            self.file.flush()
            self.unwritten.clear()


def cells_to_log(cells: dict[Cell, float] | dict[Cell, int]) -> dict[str, float]:
    """A cost table (or its counts) as the log writes it: keyed "N,B,D"."""
    return {c.key(): v for c, v in cells.items()}


def cells_from_log(cells: dict[str, float] | None) -> dict[Cell, float] | None:
    return None if cells is None else {Cell.parse(k): v for k, v in cells.items()}


def replay(lines: Sequence[str]) -> list[str]:
    """Recomputes every logged decision from its inputs; returns the differences found."""
    diffs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("held") or "observed" in rec:
            continue  # a round the previous decision governed (the scheduler's held rounds), or a round's time
        got, logged = decide_again(rec).to_log(), Decision.from_log(rec).to_log()
        for key in ("survival", "candidates", "budget", "allocation"):
            if not _same(got[key], logged[key]):
                diffs.append(f"line {i} (round {rec.get('round')}): {key} logged {logged[key]!r}, recomputed {got[key]!r}")
    return diffs


def decide_again(rec: dict) -> Decision:
    """The decision a logged record's inputs give now."""
    return decide(rec["acceptance"], rec["n_requests"], cells_from_log(rec["cost_table"]), rec["b_max"], rec["probe"],
                  cells_from_log(rec.get("cost_counts")), rec.get("behind"), rec.get("switch_s", 0.0), rec.get("stop_s", 0.0),
                  rec.get("explore_plain", False), _draft_steps(rec), rec.get("explore_margin", EXPLORE_MARGIN),
                  rec.get("padding", False), rec.get("probe_rows"), rec.get("probe_depth", PROBE_DEPTH),
                  rec.get("halted", False), rec.get("step_by_step", False), rec.get("lead", 1.0),
                  rec.get("rising_steps", False))


def _draft_steps(rec: dict) -> dict[int, float] | float | None:
    """A decision's drafting seconds a depth: by N, or (logs written before) its own N's figure."""
    steps = rec.get("draft_steps_s")
    return {int(n): s for n, s in steps.items()} if steps is not None else rec.get("draft_step_s")


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-9 * max(1.0, abs(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
