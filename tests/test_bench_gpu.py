"""verity bench gpu runs its whole procedure on tiny shapes (here on the CPU) and prints its JSON."""

import json
import subprocess
import sys


def test_bench_gpu_small():
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "gpu", "--small", "--dtype", "fp32", "--tokens", "12",
                        "--repeats", "1", "--alphas", "0.8", "--ks", "1", "2", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["small"] and fig["plain_tps"] > 0 and fig["roofline_tps"] > 0
    assert set(fig["target_forward_ms"]) == {"1", "2", "4", "8", "16"} and fig["draft_step_ms"] > 0
    configs = {(j["recovery"], j["config"]) for j in fig["joint"]}
    assert configs == {(rec, c) for rec in ("fast", "replay") for c in ("k=1", "k=2", "adaptive")}
    assert all(0 <= j["acceptance"] <= 1 and j["tps"] > 0 for j in fig["joint"])
    assert fig["ratio"] > 0 and set(fig["goals"]) == {"roofline", "joint_vs_plain", "adaptive"}
