"""verity bench gpu runs its whole procedure on tiny shapes (here on the CPU) and prints its JSON."""

import json
import statistics
import subprocess
import sys


def test_bench_gpu_small(tmp_path):
    logs = tmp_path / "decisions"
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "gpu", "--small", "--dtype", "fp32", "--tokens", "12",
                        "--repeats", "1", "--alphas", "0.8", "--ks", "0", "1", "2", "--decision-log", str(logs), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["small"] and fig["plain_tps"] > 0 and fig["roofline_tps"] > 0
    assert fig["mlx_lm_tps"] > 0 and fig["plain_equals_mlx_lm"]  # the engine's plain tokens are mlx-lm's
    assert set(fig["target_forward_ms"]) == {"1", "2", "4", "8", "16"}
    assert set(fig["target_forward_recorded_ms"]) == {"2", "4", "8", "16"}
    assert fig["draft_step_ms"] > 0 and fig["draft_chain_step_ms"] > 0 and fig["env"]["MLX_CUDA_GRAPH_CACHE_SIZE"]
    assert fig["draft_forward"] == "mlx-lm"  # as the engine runs the draft here (the kernels' path: CUDA only)
    assert fig["warm_joint_s"] > 0  # every shape a joint run may meet compiled before the joint rows
    check = fig["fast_check"]  # the draft kernels' path against mlx-lm's forward (their ops on the CPU)
    assert not check["kernels_ran"] and check["logits_1_ops_vs_mlx_lm"] <= 1e-4 * check["logits_1_max_abs"]
    configs = {(j["recovery"], j["config"]) for j in fig["joint"]}
    assert configs == {(rec, c) for rec in ("fast", "replay") for c in ("k=0", "k=1", "k=2", "adaptive")} - {("replay", "k=0")}
    assert all(j["runs_differing_from_reference"] == 0 for j in fig["joint"])  # exact at small size
    assert all(0 <= j["acceptance"] <= 1 and j["tps"] > 0 for j in fig["joint"])
    for j in fig["joint"]:  # drafting rounds' time: draft, verify, recovery
        if j["config"] in ("k=1", "k=2"):
            assert j["acceptance"] > 0 and abs(j["draft_share"] + j["verify_share"] + j["recovery_share"] - 1) < 1e-6
    for j in fig["joint"]:  # paired with the plain run of the same repeat
        assert len(j["runs_tps"]) == len(j["plain_tps"]) == 1 and j["vs_plain"] == j["runs_tps"][0] / j["plain_tps"][0]
    assert {j["alpha"] for j in fig["joint"] if "vs_best_fixed" in j} == {0.8}
    ad = next(j for j in fig["joint"] if "vs_best_fixed" in j)  # read from pairs of runs back to back
    assert len(ad["pairs_vs_best"]) == 8 and ad["vs_best_fixed"] == statistics.median(ad["pairs_vs_best"])
    assert len(ad["pairs_vs_plain"]) == 8 and ad["vs_plain_goal"] == statistics.median(ad["pairs_vs_plain"])  # between plain runs
    assert fig["ratio"] > 0 and set(fig["goals"]) == {"roofline", "joint_vs_plain", "adaptive"}
    best08 = max((j for j in fig["joint"] if j["recovery"] == "fast" and j["config"] in ("k=1", "k=2")),
                 key=lambda j: j["vs_plain"])
    assert fig["ratio_in_repeats"] == best08["vs_plain"]
    if ad["pairs_best"] == best08["config"]:  # the headline reads the best k's runs in the pairs too, each ÷ its plain runs
        assert len(best08["pairs_vs_plain"]) == 8
        assert fig["ratio"] == statistics.median([best08["vs_plain"], *best08["pairs_vs_plain"]])
    else:
        assert fig["ratio"] == best08["vs_plain"]
    names = {f"a0.8-{rec}-{c}.jsonl" for rec in ("fast", "replay") for c in ("k0", "k1", "k2", "adaptive")} - {"a0.8-replay-k0.jsonl"}
    assert {p.name for p in logs.iterdir()} == names  # every configuration's rounds, adaptive's decisions too
    for log in logs.glob("*adaptive.jsonl"):  # the adaptive schedulers' decisions and round times, which replay reproduces
        recs = [json.loads(line) for line in log.read_text().splitlines()]
        assert any("budget" in rec for rec in recs) and any("observed" in rec for rec in recs)
        replay = subprocess.run([sys.executable, "-m", "cli.main", "replay", str(log)], capture_output=True, text=True)
        assert replay.returncode == 0, replay.stdout + replay.stderr


def test_a_quantized_model_reports_its_logical_parameter_count():
    """4-bit weights pack 8 parameters into each uint32: the bench's table names the model's size,
    not the number of packed elements (a 4-bit 9 B target once read "1.40 B")."""
    import mlx.core as mx

    from bench import gpu_models as gb

    cfg = dict(gb.TARGET_9B, **gb.SMALL)
    plain, packed = gb.build(cfg, mx.float32, 0), gb.build(cfg, mx.float32, 0, bits=4)
    assert gb.n_params(packed) == gb.n_params(plain)
    assert gb.bytes_per_token(packed, cfg) < gb.bytes_per_token(plain, cfg) / 4


def test_bench_gpu_fast_rows_only(tmp_path):
    """--recoveries fast leaves out the replay rows (the goals read the fast ones) and
    --no-side-by-side the kernel's side by side (CUDA): on the device their time goes to more
    pairs within one call's 600 s."""
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "gpu", "--small", "--dtype", "fp32", "--tokens", "8",
                        "--repeats", "1", "--pair-repeats", "2", "--probe-repeats", "1", "--alphas", "0.8", "--ks", "0", "1",
                        "--recoveries", "fast", "--no-side-by-side", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(j["recovery"], j["config"]) for j in fig["joint"]} == {("fast", c) for c in ("k=0", "k=1", "adaptive")}
    ad = next(j for j in fig["joint"] if j["config"] == "adaptive")
    assert len(ad["pairs_vs_best"]) == 2 and set(fig["goals"]) == {"roofline", "joint_vs_plain", "adaptive"}
    assert fig["pairs_by_alpha"] == {"0.8": 2} and not fig["side_by_side"]
    assert "[" in r.stderr and " s] " in r.stderr  # progress lines tell the seconds since the start


class _Clock:
    """perf_counter() for bench.gpu, advanced by the fake runs below."""
    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


def test_pairs_fill_the_time_they_are_given(monkeypatch):
    """With a deadline the pairs run past --pair-repeats, two at a time, while two more fit before
    it; without one, or with it already past, exactly --pair-repeats."""
    from types import SimpleNamespace

    from bench import gpu as bg

    monkeypatch.setattr(bg, "time", _Clock)

    def run(name, k):
        _Clock.now += 1.0
        return SimpleNamespace(tps=100.0 if name == "adaptive" else 80.0)

    def plain():
        _Clock.now += 0.5
        return 50.0

    for until, pairs in ((None, 2), (-1.0, 2), (20.0, 6)):
        _Clock.now = 0.0
        rows = [{"config": c, "vs_plain": v, "alpha": 0.8} for c, v in (("k=4", 1.6), ("k=0", 1.0), ("adaptive", 1.2))]
        bg._pairs(rows, {"k=4": 4, "k=0": 0, "adaptive": None}, run, 2, plain, None if until is None else until)
        ad = rows[-1]
        assert ad["pairs_best"] == "k=4" and len(ad["pairs_vs_best"]) == pairs  # each pair 2.5 s: 6 end at 15.5
        assert ad["pairs_vs_best"] == [1.25] * pairs and ad["pairs_vs_plain"] == [2.0] * pairs
        assert until is None or until < 0 or _Clock.now <= until


def test_the_time_left_is_shared_among_the_fast_blocks_still_to_run(monkeypatch):
    """PairTime: the budget less the report's share and the blocks to come (timed as this run's
    blocks of the same recovery took, else as any block), split among the fast blocks left."""
    from bench import gpu as bg

    monkeypatch.setattr(bg, "time", _Clock)
    budget = bg.PairTime(end=100.0 + bg.REPORT_S)
    _Clock.now = 20.0
    rest = [(0.6, "replay"), (0.8, "fast"), (0.8, "replay")]
    assert budget.pairs_until("fast", 10.0, rest) == 20.0 + (100.0 - 20.0 - 3 * 10.0) / 2
    _Clock.now = 45.0
    assert budget.pairs_until("replay", 6.0, rest[1:]) is None  # a replay block runs no pairs
    _Clock.now = 51.0
    assert budget.pairs_until("fast", 12.0, rest[2:]) == 51.0 + (100.0 - 51.0 - 6.0)
    assert bg.PairTime(end=None).pairs_until("fast", 10.0, []) is None
