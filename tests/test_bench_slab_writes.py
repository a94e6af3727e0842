"""bench/slab_writes.py: the three ways of writing attention slabs side by side; on the CPU every
way is MLX's scatter, and each repeat's joint rows equal plain's tokens."""

from bench import slab_writes
from worker.kernels import kv_write


def test_each_way_prints_a_repeat_line_with_its_ratios_and_the_served_way_is_restored(capsys):
    assert slab_writes.main(["--small", "--n", "2", "--repeats", "1", "--tokens", "12"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("repeat 0")]
    assert [l.split()[2].rstrip(":") for l in lines] == list(slab_writes.MODES)
    for line in lines:
        assert "plain " in line and " = " in line and line.count("(stalls ") == 3, line
        assert line.count("= plain 2/2)") == 2, line  # adaptive and 2 deep: every row is plain's
        assert "= first plain 2/2)" in line, line
    assert kv_write.mode() == "wide"


def test_a_way_that_is_not_one_is_refused_by_name():
    import pytest

    with pytest.raises(ValueError, match="slab write mode 'all'"):
        kv_write.set_mode("all")


def test_a_settling_batch_waits_for_the_device_before_it_encodes_each_round(monkeypatch):
    """In "settle" (a lab way) every decode round, plain or drafting, waits for the device before
    it is encoded; otherwise no round waits; the tokens stay the target's own."""
    import mlx.core as mx

    from bench import gpu_batch as g
    from bench import gpu_models as gb
    from worker.kernels import fast_draft
    from worker.scheduler import Scheduler

    cfg = dict(gb.TARGET_9B, **gb.SMALL)
    target, draft = gb.build(cfg, mx.float32, 0), gb.build(dict(gb.DRAFT_08B, **gb.SMALL), mx.float32, 1)
    prompts, vocab = g._prompts(2, 8, cfg["vocab_size"]), cfg["vocab_size"]
    waits = []
    monkeypatch.setattr(mx, "synchronize", lambda *a: waits.append(1))
    ref = g.verity_run(target, prompts, 6).tokens
    assert waits == []
    monkeypatch.setattr(kv_write, "settles", lambda: True)
    g.verity_run(target, prompts, 6)
    assert len(waits) >= 5  # 6 tokens a row: the prompt's last forward gives the first
    waits.clear()
    joint = g.verity_run(target, prompts, 6, draft, ref, 0.8, vocab, Scheduler(fixed=2), 1,
                         fast_draft.where_it_runs(draft))
    assert joint.tokens == ref and len(waits) >= joint.drafted // 4 > 0


def test_a_row_that_differs_from_plain_is_named_with_its_position_and_the_targets_gap_there():
    import mlx.core as mx

    from bench import gpu_batch as g
    from bench import gpu_models as gb

    cfg = dict(gb.TARGET_9B, **gb.SMALL)
    target = gb.build(cfg, mx.float32, 0)
    prompts = g._prompts(3, 8, cfg["vocab_size"])
    ref = g.verity_run(target, prompts, 6).tokens
    got = [list(t) for t in ref]
    got[1][4] = (got[1][4] + 1) % cfg["vocab_size"]
    assert g.divergences(target, prompts, ref, ref) == []
    [(row, at, gap)] = g.divergences(target, prompts, ref, got)
    assert (row, at) == (1, 4) and gap >= 0
    logits = target(mx.array([prompts[1] + ref[1][:4]]))[0, -1]
    top = mx.sort(logits)
    assert int(mx.argmax(logits)) == ref[1][4] and abs(gap - (top[-1] - top[-2]).item()) < 1e-3
    run = g.Run(got, 0, 1.0, differ=g.divergences(target, prompts, ref, got))
    assert g.said_divergences(run, 3) == f"= plain 2/3 [row 1 at 4: gap {gap}]"


def test_the_gpu_benches_run_without_the_service_stacks_packages():
    """The GPU machine carries MLX, mlx-lm and a few wheels, not the service's packages: the GPU
    benches run whole with those unimportable (a lazy import through worker.engine once stopped
    them there)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    blocked = ("llguidance", "aiohttp", "httpx", "openai")
    code = (f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
            "from bench import slab_writes\n"
            "sys.exit(slab_writes.main(['--small', '--n', '2', '--repeats', '1', '--tokens', '8']))")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "repeat 0 wide" in done.stdout
