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
    assert set(fig["target_forward_ms"]) == {"1", "2", "4", "8", "16"}
    for figure in ("draft_step_ms", "draft_chain_step_ms", "plain_tps_by_mode"):  # eager and compiled, side by side
        modes = {"eager", "fused", "static"} | ({"kernels"} if figure != "plain_tps_by_mode" else set())
        assert set(fig[figure]) == modes and min(fig[figure].values()) > 0
    assert fig["mode"] == "static" and fig["env"]["MLX_CUDA_GRAPH_CACHE_SIZE"]
    assert fig["warm_joint_s"] > 0  # every shape a joint run may meet compiled before the joint rows
    assert fig["draft_mode"] == "kernels"  # the joint runs' draft takes the kernels' path (their ops on the CPU)
    check = fig["fast_check"]
    assert not check["kernels_ran"] and check["logits_1_ops_vs_mlx_lm"] <= 1e-4 * check["logits_1_max_abs"]
    configs = {(j["recovery"], j["config"]) for j in fig["joint"]}
    assert configs == {(rec, c) for rec in ("fast", "replay") for c in ("k=0", "k=1", "k=2", "adaptive")} - {("replay", "k=0")}
    assert all(j["runs_differing_from_reference"] == 0 for j in fig["joint"])  # exact at small size
    assert all(0 <= j["acceptance"] <= 1 and j["tps"] > 0 for j in fig["joint"])
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


def test_fused_layers_compute_what_eager_layers_compute():
    """Compiled Gated-DeltaNet layers: the same logits as mlx-lm's (float32, CPU) for one-token
    steps, a recorded verify window and a recovery from it; and greedy joint decoding with both
    models compiled equals the compiled target's own greedy tokens."""
    import mlx.core as mx

    from bench import gpu_rounds as gb
    from worker.state import checkpoint as st
    from bench.fused import FusedDecoderLayer, set_fused

    cfg = dict(gb.DRAFT_08B, **gb.SMALL)
    eager, fused = gb.build(cfg, mx.float32, seed=3), gb.build(cfg, mx.float32, seed=3)
    assert set_fused(fused) == 3 and isinstance(fused.layers[0], FusedDecoderLayer)
    ce, cf = st.make_cache(eager), st.make_cache(fused)
    prompt = mx.array([list(range(1, 40))])
    assert mx.array_equal(eager(prompt, cache=ce), fused(prompt, cache=cf))  # long inputs stay eager
    for tok in (5, 17, 3):
        x = mx.array([[tok]])
        assert mx.allclose(eager(x, cache=ce), fused(x, cache=cf), atol=1e-5)
    st.set_record(ce, True)
    st.set_record(cf, True)
    window = mx.array([[5, 9, 11, 2]])
    assert mx.allclose(eager(window, cache=ce), fused(window, cache=cf), atol=1e-5)
    st.keep_recorded(ce, 4, 2)
    st.keep_recorded(cf, 4, 2)
    assert mx.allclose(eager(mx.array([[7]]), cache=ce), fused(mx.array([[7]]), cache=cf), atol=1e-5)

    target = gb.build(dict(gb.TARGET_9B, **gb.SMALL), mx.float32, seed=0)
    set_fused(target)
    prompt = list(range(1, 17))
    reference = gb.greedy_reference(target, prompt, 24)
    for recovery in ("fast", "replay"):
        run = gb.joint_decode(target, fused, prompt, reference, lambda p: 0.7, 24, recovery, 3, cfg["vocab_size"])
        assert run.tokens == reference[: len(run.tokens)] and len(run.tokens) == 24


def test_a_static_forward_computes_what_the_eager_forward_computes(monkeypatch):
    """The whole forward compiled on fixed-capacity KV (float32, CPU): the same logits as mlx-lm's
    for one-token steps, a recorded verify window, a recovery from it, eager prompt chunks between
    compiled steps, and across a capacity step; greedy joint decoding with both models static
    equals the static target's own greedy tokens, which equal the eager target's."""
    import mlx.core as mx

    from bench import gpu_rounds as gb
    from worker.state import checkpoint as st
    from bench import static

    monkeypatch.setattr(static, "CAPACITY_STEP", 64)
    cfg = dict(gb.DRAFT_08B, **gb.SMALL)
    eager, stat = gb.build(cfg, mx.float32, seed=3), gb.build(cfg, mx.float32, seed=3)
    static.set_static(stat)
    ce, cs = st.make_cache(eager), st.make_cache(stat)
    prompt = mx.array([list(range(1, 40))])
    assert mx.array_equal(eager(prompt, cache=ce), stat(prompt, cache=cs))  # long inputs stay eager
    kv = next(c for c in cs if type(c).__name__ == "KVCache")

    def same(x):
        assert mx.allclose(eager(x, cache=ce), stat(x, cache=cs), atol=1e-5)

    for tok in (5, 17, 3):
        same(mx.array([[tok]]))
    assert kv.keys.shape[2] == 256 and kv.offset == 42  # mlx-lm's eager step (256) is a whole capacity step
    st.set_record(ce, True)
    st.set_record(cs, True)
    same(mx.array([[5, 9, 11, 2]]))
    st.keep_recorded(ce, 4, 2)
    st.keep_recorded(cs, 4, 2)
    same(mx.array([[7]]))
    same(mx.array([list(range(60, 260))]))  # an eager chunk in between
    for tok in range(6):  # crosses 256: the buffer grows to the next step, the state carried over
        same(mx.array([[tok + 1, tok + 2]]))
    assert kv.keys.shape[2] == 256 + 64 and kv.offset == 257
    static.set_static(stat, False)
    assert type(stat) is type(eager)

    target = gb.build(dict(gb.TARGET_9B, **gb.SMALL), mx.float32, seed=0)
    prompt = list(range(1, 17))
    reference = gb.greedy_reference(target, prompt, 24)
    static.set_static(target)
    static.set_static(stat)
    assert gb.greedy_reference(target, prompt, 24) == reference
    for recovery in ("fast", "replay"):
        run = gb.joint_decode(target, stat, prompt, reference, lambda p: 0.7, 24, recovery, 3, cfg["vocab_size"])
        assert run.tokens == reference[: len(run.tokens)] and len(run.tokens) == 24 and run.acceptance > 0.3


def test_a_quantized_model_reports_its_logical_parameter_count():
    """4-bit weights pack 8 parameters into each uint32: the bench's table names the model's size,
    not the number of packed elements (a 4-bit 9 B target once read "1.40 B")."""
    import mlx.core as mx

    from bench import gpu_rounds as gb

    cfg = dict(gb.TARGET_9B, **gb.SMALL)
    plain, packed = gb.build(cfg, mx.float32, 0), gb.build(cfg, mx.float32, 0, bits=4)
    assert gb.n_params(packed) == gb.n_params(plain)
    assert gb.bytes_per_token(packed, cfg) < gb.bytes_per_token(plain, cfg) / 4


def test_bench_gpu_fast_rows_only(tmp_path):
    """--recoveries fast leaves out the replay rows (the goals read the fast ones) and
    --no-side-by-side the forwards the joint rows do not use: on the device their time goes to
    more pairs within one call's 600 s."""
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "gpu", "--small", "--dtype", "fp32", "--tokens", "8",
                        "--repeats", "1", "--pair-repeats", "2", "--probe-repeats", "1", "--alphas", "0.8", "--ks", "0", "1",
                        "--recoveries", "fast", "--no-side-by-side", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(j["recovery"], j["config"]) for j in fig["joint"]} == {("fast", c) for c in ("k=0", "k=1", "adaptive")}
    ad = next(j for j in fig["joint"] if j["config"] == "adaptive")
    assert len(ad["pairs_vs_best"]) == 2 and set(fig["goals"]) == {"roofline", "joint_vs_plain", "adaptive"}
    assert fig["pairs_by_alpha"] == {"0.8": 2} and not fig["side_by_side"]
    assert set(fig["plain_tps_by_mode"]) == {"static"} and set(fig["draft_step_ms"]) == {"static", "kernels"}
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
        return SimpleNamespace(tokens_per_s=100.0 if name == "adaptive" else 80.0)

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
