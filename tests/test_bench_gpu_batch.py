"""bench/gpu_batch.py's reporting: stall rounds named by their shape, fixed-depth configurations and
their decision logs (the GPU runs themselves are benches, not tests)."""

import argparse

from bench import gpu_batch as gb


def _args(tmp_path, **kw):
    base = dict(alphas=[0.8], mixed=[8], fixed=[2], log_dir=str(tmp_path))
    return argparse.Namespace(**{**base, **kw})


def test_a_stall_is_reported_with_its_rows_depth_and_drafted_tokens():
    run = gb.Run([[1]], 1, 1.0, rounds=[0.01] * 9 + [0.2], shapes=[(8, 0, 0)] * 9 + [(8, 4, 32)])
    assert run.stalls == "1:0.20s (8x4/32=0.20)"
    assert gb.Run([[1]], 1, 1.0, rounds=[0.01] * 3, shapes=[(1, 0, 0)] * 3).stalls == "0"


def test_fixed_depths_run_beside_adaptive_with_fixed_schedulers_and_ascii_logs(tmp_path):
    args = _args(tmp_path)
    configs = gb._configs(args, 8)
    assert [c.name for c in configs] == ["adaptive α=0.8", "mixed α=0.8", "fixed k=2 α=0.8"]
    assert [c.every for c in configs] == [1, 2, 1] and [c.fixed for c in configs] == [None, None, 2]
    fixed, adaptive = gb._scheduler(args, 8, configs[2]), gb._scheduler(args, 8, configs[0])
    assert fixed.fixed == 2 and adaptive.fixed is None
    for s in (fixed, adaptive):
        s.plan(["r0"], 1)
        s.flush_log()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["N8-adaptive-a-0.8.jsonl", "N8-fixed-k-2-a-0.8.jsonl"]
