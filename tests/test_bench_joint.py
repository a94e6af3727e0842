"""`verity bench joint --quick --json`: every group of rows runs, every row is exact, the ratio is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cli.blas import blas_env

QUICK_TIMEOUT_S = 300  # about 30 s on 2 shared CPU cores; generous for a loaded machine


def test_bench_joint_quick_json():
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "joint", "--quick", "--json"],
                       capture_output=True, text=True, timeout=QUICK_TIMEOUT_S, env=blas_env(os.environ),
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "joint"
    ks, alphas = figures["ks"], figures["alphas"]
    assert 4 in ks and figures["ratio_k"] == 4
    rows = figures["rows"]

    def find(group, method, **kw):
        return [f for f in rows if f["group"] == group and f["method"] == method
                and all(f.get(key) == v for key, v in kw.items())]

    for group in ("llama", "hybrid", "distilled", "embedded"):
        assert len(find(group, "mlx-lm generate_step")) == 1, group
        assert len(find(group, "verity k=0")) == 1, group
        for k in ks:
            for recovery in ("fast", "replay"):
                n = len(alphas) if group == "embedded" else (2 if group == "llama" else 1)
                assert len(find(group, "verity joint", k=k, recovery=recovery)) == n, (group, k, recovery)
    for draft in ("perturbed", "1-layer"):
        for k in ks:
            assert len(find("llama", "mlx-lm speculative", draft=draft, k=k)) == 1, (draft, k)
    for k in ks:  # the distilled draft is a llama: mlx-lm runs it too
        assert len(find("distilled", "mlx-lm speculative", draft="distilled", k=k)) == 1, k
    deepest = find("distilled", "verity joint", k=max(ks), recovery="fast")[0]
    assert 1 <= len(deepest["acceptance_per_position"]) <= max(ks)
    assert "distilled: acceptance per draft position" in r.stdout
    assert "trimmable" in find("hybrid", "mlx-lm speculative")[0]["error"]  # mlx-lm refuses the hybrid

    timed = [f for f in rows if "tps" in f]
    assert len(timed) == len(rows) - 1
    for f in timed:
        assert f["tps"] > 0, f["label"]
        assert f["mismatches"] == 0, f"{f['group']} {f['label']}: {f}"
        assert f["runs_checked"] == figures["repeats"] == 1
        if f["method"] == "verity joint":
            assert f["drafted"] > 0 and 0 <= f["acceptance"] <= 1
            assert abs(f["draft_share"] + f["verify_share"] + f["recovery_share"] - 1) < 1e-6
    assert figures["ratio"] > 0 and figures["ratio_runs"] > 0
    for draft in ("perturbed", "1-layer"):  # the cycle-interleaved duels behind the headline
        for k in ks:
            d = figures["duels"][draft][str(k)]
            assert d["verity_tps"] > 0 and d["mlx_tps"] > 0 and d["mismatches"] == 0, (draft, k, d)
    assert set(figures["ratios_vs_mlx"]["perturbed"]["fast"]) == {str(k) for k in ks}
    assert isinstance(figures["goals"]["recovery_goal_met"], bool)
    assert "headline ratio" in r.stdout and "goal 1" in r.stdout and "goal 2" in r.stdout
