"""verity bench sched runs end to end (quick settings, tiny hybrid pair) and prints its JSON."""

import json
import statistics
import subprocess
import sys

from bench.sched import TINY_REPEAT_FACTOR


def test_bench_sched_quick(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "sched", "--quick", "--skip-embedded", "--skip-distilled", "--json",
                        "--decision-log", str(tmp_path / "logs")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    rows = figures["rows"]
    assert [(row["scenario"].split(" (")[0], row["concurrency"]) for row in rows] == [("tiny hybrid", 1), ("tiny hybrid", 4)]
    for row in rows:
        assert row["baseline"] > 0 and row["adaptive"] > 0 and row["best_fixed"].startswith("k=")
        assert all(c["mismatching_requests"] == 0 for c in row["configs"].values()), row["configs"]
    # short ×1 runs repeat 4× as often (as many tokens as ×4), and the tiny pair's ×1 row 3× more (its runs are noisy)
    assert [row["repeats"] for row in rows] == [4 * TINY_REPEAT_FACTOR, 1]
    assert figures["ratio"] == min(row["adaptive_vs_baseline"] for row in rows)
    for row in rows:  # ratios are medians of per-repeat ratios, from the same runs as the medians
        runs = {name: c["runs_tps"] for name, c in row["configs"].items()}
        assert len(runs["adaptive"]) == len(runs["baseline"]) == row["repeats"]
        assert row["adaptive_vs_baseline"] == statistics.median(a / b for a, b in zip(runs["adaptive"], runs["baseline"]))
        assert row["ratio_of_medians_vs_baseline"] == row["adaptive"] / row["baseline"]
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())  # every engine's log: adaptive's decisions, replayable
    rows_logged = ["adaptive", "baseline", "k1", "k2"]
    assert logs == sorted(f"tiny_hybrid-x{n}-{r}.jsonl" for n in (1, 4) for r in rows_logged)
    for name in logs:
        records = [json.loads(line) for line in (tmp_path / "logs" / name).read_text().splitlines()]
        assert any("observed" in rec for rec in records), name  # each row's round costs
        assert any("candidates" in rec for rec in records) == ("adaptive" in name), name
        replay = subprocess.run([sys.executable, "-m", "cli.main", "replay", str(tmp_path / "logs" / name)],
                                capture_output=True, text=True, timeout=120)
        assert replay.returncode == 0, replay.stdout[-2000:]

def test_the_controlled_draft_meets_the_same_hard_tokens_whatever_the_budget():
    """Whether a position is proposed right depends on (seed, position) only, so configurations
    compared in one bench meet the same hard tokens, in whatever order they propose them."""
    from bench.drafters import Controlled

    ref = list(range(100, 400))

    def drafter(seed):
        return Controlled(ref, lambda p: 0.6, 1000, seed=seed)

    first = [drafter(7).pick(p) for p in range(300)]
    again = drafter(7)
    assert [again.pick(p) for p in reversed(range(300))][::-1] == first
    assert 0.5 < sum(t == r for t, r in zip(first, ref)) / 300 < 0.7
    assert all(t in (r, r + 1) for t, r in zip(first, ref))
    assert [drafter(8).pick(p) for p in range(300)] != first
