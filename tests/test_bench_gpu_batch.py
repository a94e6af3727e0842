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


def test_the_pace_tells_plain_rounds_from_drafting_ones():
    run = gb.Run([[1]], 1, 1.0, rounds=[0.006, 0.008, 0.007, 0.030], shapes=[(1, 0, 0)] * 3 + [(1, 2, 2)])
    assert run.pace == "plain 7.0 ms x3, drafting 30.0 ms x1"
    assert gb.Run([[1]], 1, 1.0, rounds=[0.01], shapes=[(1, 0, 0)]).pace == "plain 10.0 ms x1"


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


def test_bits_builds_quantized_weights_and_the_roofline_reads_their_bytes():
    import pytest
    from bench import gpu_models

    benches = argparse.ArgumentParser().add_subparsers()
    gb.add_command(benches)
    parser = benches.choices["gpu-batch"]
    assert parser.parse_args(["--bits", "4"]).bits == 4 and parser.parse_args([]).bits is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--bits", "3"])
    cfg = dict(gpu_models.TARGET_9B, **gpu_models.SMALL)
    full, four = (gpu_models.build(cfg, gpu_models.DTYPES["bf16"], 0, bits) for bits in (None, 4))
    assert type(four.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    ratio = gpu_models.bytes_per_token(four, cfg) / gpu_models.bytes_per_token(full, cfg)
    assert 0.25 < ratio < 0.35  # 4 bits a weight plus a bf16 scale and bias a group of 64: 0.28 of bf16
    assert gb.roofline(four, 1e12, gpu_models.bytes_per_token(four, cfg), 8, 128) > \
        gb.roofline(full, 1e12, gpu_models.bytes_per_token(full, cfg), 8, 128)


def test_a_repeat_line_adds_the_gpu_used_memory_where_nvidia_smi_answers(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 46336\necho 100\n")  # MiB of the first GPU, then a second's
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert gb._memory().endswith(", GPU used 45.2 GiB") and gb._memory().startswith("MLX active ")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "GPU" not in gb._memory()


def test_the_footer_counts_rows_that_differ_from_plain_apart_for_plain_and_joint():
    d = gb.Divergence
    differ = [[d(3, 37, 0.0156)], []]
    f = {"configs": {"bg": {}, "plain": {"differ": [[], [d(0, 5, 0.5)]]}, "adaptive α=0.8": {"differ": differ},
                     "mixed α=0.8": {"differ": [[d(1, 2, 0.01), d(4, 9, 0.02)]]}}}
    assert (gb._differing(f, True), gb._differing(f, False)) == (1, 3)
    run = gb.Run([[1]], 1, 1.0, differ=differ[0])
    assert gb.said_divergences(run, 8) == "= plain 7/8 [row 3 at 37: gap 0.0156]"
    assert gb.said_divergences(gb.Run([[1]], 1, 1.0), 8, "first plain") == "= first plain 8/8"


def test_goals_follow_both_issues_and_give_a_lower_alpha_its_own_goal():
    def cfg(ratio, pairs, key="vs_plain"):
        return {key: ratio, "pairs": pairs}

    fig = {"alphas": [0.6], "ns": {
        "32": {"plain_vs_roofline": 0.55, "configs": {"plain": cfg(1.2, [1.1, 1.31], "vs_bg"),
                                                      "adaptive α=0.6": cfg(0.98, [0.98])}},
        "64": {"plain_vs_roofline": 0.55, "configs": {"plain": cfg(1.2, [1.2], "vs_bg"),
                                                      "adaptive α=0.8": cfg(0.98, [0.98])}}}}
    assert gb._goals(fig) == {
        "N=32 plain ÷ BG ≥ 1.3": "tie", "N=32 adaptive α=0.6 ÷ plain ≥ 0.97": "met",
        "N=32 plain at ≥ 50% of the roofline": "met",
        "N=64 plain ÷ BG ≥ 1.3": "missed", "N=64 adaptive α=0.8 ÷ plain ≥ 0.97": "met",
        "N=64 plain at ≥ 60% of the roofline": "missed"}


def test_a_run_out_of_device_memory_still_reports_the_ns_it_finished(monkeypatch, capsys):
    """MLX's out-of-memory error at one N ends the run, but the table and footer carry every N
    measured before it, and each finished N prints its figures at once (a run cut off keeps them)."""
    benches = argparse.ArgumentParser().add_subparsers()
    gb.add_command(benches)
    args = benches.choices["gpu-batch"].parse_args(
        ["--small", "--ns", "2", "4", "--alphas", "0.8", "--mixed", "--repeats", "1", "--tokens", "6"])
    measure = gb._measure

    def out_of_memory_at_4(args, target, draft, vocab, n):
        if n == 4:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return measure(args, target, draft, vocab, n)

    monkeypatch.setattr(gb, "_measure", out_of_memory_at_4)
    assert gb.run_gpu_batch(args) == 1
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "N=2 figures: bg" in text and "stopped at N=4: cudaMallocAsync" in text
    assert "STOPPED at N=4" in text and "N=2 plain ÷ BG" in text and "N=4 plain" not in text
