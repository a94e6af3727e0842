"""verity bench sched runs end to end (quick settings, tiny hybrid pair) and prints its JSON."""

import json
import subprocess
import sys


def test_bench_sched_quick():
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "sched", "--quick", "--skip-embedded", "--skip-distilled", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    rows = figures["rows"]
    assert [(row["scenario"].split(" (")[0], row["concurrency"]) for row in rows] == [("tiny hybrid", 1), ("tiny hybrid", 4)]
    for row in rows:
        assert row["baseline"] > 0 and row["adaptive"] > 0 and row["best_fixed"].startswith("k=")
        assert all(c["mismatching_requests"] == 0 for c in row["configs"].values()), row["configs"]
    assert "batched_vs_unbatched" in rows[1]
    assert figures["ratio"] == min(row["adaptive_vs_baseline"] for row in rows)
