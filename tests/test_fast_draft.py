"""The draft's few-kernel forward (worker/spec/fast_draft.py) against mlx-lm's forward.

On the CPU it runs the kernels' ops (worker/spec/draft_kernels.py); `verity bench gpu` checks the
CUDA kernels against those ops on the device."""

import mlx.core as mx
import pytest

from worker import gpu_bench as gb
from worker.spec import draft_kernels as dk
from worker.spec import fast_draft
from worker.spec import state as st


@pytest.fixture(scope="module")
def model():
    # Hv = 4 value heads over Hk = 2 key heads, one attention layer in two
    return gb.build(dict(gb.DRAFT_08B, **gb.SMALL, full_attention_interval=2), mx.float32, 3)


def _state(cache) -> list[mx.array]:
    return [a for c in cache for a in (c.cache if not hasattr(c, "keys") else (c.keys[..., :c.offset, :], c.values[..., :c.offset, :]))]


def test_the_fast_forward_computes_mlx_lms_forward(model):
    layers = fast_draft._prepare(model)
    assert layers is not None
    prompt = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3, 250, 11, 12, 13]])
    ref, fast = st.make_cache(model), st.make_cache(model)
    mx.eval(model(prompt, cache=ref), model(prompt, cache=fast))
    for step in ([[8]], [[400, 401]], [[2]], [[31, 32, 33]], [[4095]]):
        x = mx.array(step)
        want = model(x, cache=ref)
        got = fast_draft.forward(model, x, fast, layers, kernel=False)
        assert got.shape == want.shape
        scale = mx.abs(want).max().item()
        assert mx.abs(got - want).max().item() <= 1e-4 * scale
        for a, b in zip(_state(fast), _state(ref), strict=True):
            assert a.shape == b.shape and mx.abs(a - b).max().item() <= 1e-4 * max(1.0, mx.abs(b).max().item())
    assert [getattr(c, "offset", None) for c in fast] == [getattr(c, "offset", None) for c in ref]


def test_set_fast_routes_only_narrow_forwards_of_one_sequence(model, monkeypatch):
    calls = []
    real = fast_draft.forward
    monkeypatch.setattr(fast_draft, "forward", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    assert fast_draft.set_fast(model)
    try:
        cache = st.make_cache(model)
        model(mx.array([list(range(1, 13))]), cache=cache)  # a prompt: mlx-lm's forward
        model(mx.array([[5]]), cache=cache)
        model(mx.array([[5] * dk.MAX_T]), cache=cache)
        st.set_record(cache, True)  # a recording cache (the verify's): mlx-lm's forward
        model(mx.array([[6, 7]]), cache=cache)
        assert calls == [(1, 1), (1, dk.MAX_T)]
    finally:
        fast_draft.set_fast(model, False)
    assert not isinstance(model, fast_draft.FastForward)


def test_a_draft_takes_the_kernels_path_only_where_they_run(monkeypatch):
    """The loader installs the path for a draft on a CUDA GPU in bfloat16 (here: claimed), and
    leaves it alone elsewhere (here: the CPU)."""
    m = gb.build(dict(gb.DRAFT_08B, **gb.SMALL), mx.bfloat16, 4)
    assert not fast_draft.install_where_it_runs(m) and not isinstance(m, fast_draft.FastForward)
    monkeypatch.setattr(dk, "available", lambda dtype=mx.bfloat16: dtype == mx.bfloat16)
    assert fast_draft.install_where_it_runs(m) and isinstance(m, fast_draft.FastForward)
    q = gb.build(dict(gb.DRAFT_08B, **gb.SMALL), mx.bfloat16, 4, bits=4)
    assert not fast_draft.install_where_it_runs(q)  # quantized layers: mlx-lm's forward
