"""The draft's few-kernel forward (worker/kernels/fast_draft.py) against mlx-lm's forward.

On the CPU it runs the kernels' ops (worker/kernels/draft.py); `verity bench gpu` checks the
CUDA kernels against those ops on the device."""

import mlx.core as mx
import pytest

from mlx_lm.models.cache import ArraysCache

from bench import gpu_models as gb
from worker.batch.slots import StateView
from worker.kernels import draft as dk
from worker.kernels import fast_draft
from worker.state import checkpoint as st


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


def test_the_narrow_forward_takes_the_kernels_path_only_for_narrow_forwards_of_one_sequence(model, monkeypatch):
    calls = []
    real = fast_draft.forward
    monkeypatch.setattr(fast_draft, "forward", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    forward = fast_draft.narrow_forward(model)
    assert forward is not None
    cache = st.make_cache(model)
    forward(mx.array([list(range(1, 13))]), cache=cache)  # a prompt: mlx-lm's forward
    forward(mx.array([[5]]), cache=cache)
    forward(mx.array([[5] * dk.MAX_T]), cache=cache)
    recording = [StateView(list(c.cache), None, record=True) if isinstance(c, ArraysCache) else c for c in cache]
    forward(mx.array([[6, 7]]), cache=recording)  # a recording cache (the verify's): mlx-lm's forward
    assert calls == [(1, 1), (1, dk.MAX_T)]


def test_a_draft_takes_the_kernels_path_only_where_they_run(monkeypatch):
    """The engine runs a draft through the path on a CUDA GPU in bfloat16 (here: claimed), and
    through mlx-lm's forward elsewhere (here: the CPU)."""
    m = gb.build(dict(gb.DRAFT_08B, **gb.SMALL), mx.bfloat16, 4)
    assert fast_draft.where_it_runs(m) is None
    monkeypatch.setattr(dk, "available", lambda dtype=mx.bfloat16: dtype == mx.bfloat16)
    assert isinstance(fast_draft.where_it_runs(m), fast_draft.NarrowForward)
    q = gb.build(dict(gb.DRAFT_08B, **gb.SMALL), mx.bfloat16, 4, bits=4)
    assert fast_draft.where_it_runs(q) is None  # quantized layers: mlx-lm's forward


def test_the_one_launch_steps_weights_are_stacked_and_shared_with_the_sublayer_path():
    from worker.kernels import persistent_draft as pd

    # head_dim 256 with a quarter rotary: the 64 RoPE dims the one-launch step takes (as the 0.8 B draft's)
    m = gb.build(dict(gb.DRAFT_08B, **dict(gb.SMALL, head_dim=256), full_attention_interval=2), mx.float32, 4)
    layers = fast_draft._prepare(m)
    w = pd.prepare(m, layers)
    assert w is not None and w.attn_layers == 2
    lin = [i for i, l in enumerate(m.layers) if l.is_linear]
    assert w.gate_up.shape[0] == len(m.layers) and w.in_w.shape[0] == len(lin) == 2
    assert dict(w.template)["ROT"] == 64 and dict(w.template)["FAI"] == 2
    for i, x in enumerate(layers):  # the sublayer path reads the same weights (views of the stacks)
        assert mx.array_equal(x.gate_up, w.gate_up[i]).item()
    attn = next(l.self_attn for l in m.layers if not l.is_linear)
    assert mx.array_equal(w.qkv_w[0], mx.concatenate([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])).item()
    m2 = gb.build(dict(gb.DRAFT_08B, **gb.SMALL, full_attention_interval=2), mx.float32, 5)
    assert pd.prepare(m2, fast_draft._prepare(m2)) is None  # head_dim 64: 16 rotary dims, not a multiple of 64


def test_a_full_kv_cache_grows_before_the_one_launch_step_writes_into_it():
    from mlx_lm.models.cache import KVCache
    from worker.kernels import persistent_draft as pd

    c = KVCache()
    k = mx.random.normal((1, 2, 256, 8))
    c.update_and_fetch(k, k + 1)
    assert c.keys.shape[2] == 256 == c.offset
    pd._make_room(c, 2)
    assert c.keys.shape[2] == 512 and c.offset == 256
    assert mx.array_equal(c.keys[..., :256, :], k).item() and mx.array_equal(c.values[..., :256, :], k + 1).item()
    before = c.keys
    pd._make_room(c, 2)  # room already: the same arrays, written in place by the kernel
    assert c.keys is before


def test_a_batch_view_hands_the_one_launch_step_its_slots_to_write_in_place():
    """The one-launch step writes its rows' keys into the batch's slab itself: the view gives it
    those rows' slots (views of the slab, with room for the new positions) and their lengths; only
    for native keys on a layer without a window, within the kernel's longest window (one row: the
    one-row launch; 2-8 rows of a token each: the rows' launch)."""
    from worker.batch.slots import SlotKV, Span
    from worker.kernels import persistent_draft as pd
    from worker.kvformat import KVFormat

    def slab(**kw):
        s = SlotKV(**kw)
        keys = mx.random.normal((2, 2, 60, 8)).astype(mx.bfloat16)
        s.write(Span(0, 2, (0, 0), (60, 60)), mx.array([0, 0]), keys, keys + 1)
        return s, keys

    s, keys = slab()
    state = StateView([mx.zeros((1, 3, 16)), mx.zeros((1, 2, 4, 4))], None, record=False)
    one = s.view(Span(1, 2, (57,), (1,)), mx.array([57]))
    k, v, n = one.in_place(200)  # past the slab's 256 positions: it grows first
    assert n == (57,) and k.shape == (1, 2, 512, 8) and s.keys[0].shape == (2, 2, 512, 8)
    assert mx.array_equal(k[:, :, :60], keys[1:2]).item() and mx.array_equal(v[:, :, :60], keys[1:2] + 1).item()
    assert pd.eligible([one, state], 1)
    before = s.keys[0]
    one.written(mx.zeros((1,), mx.uint32))  # later readers wait for the kernel; the slab holds what it held
    assert s.keys[0] is not before and mx.array_equal(s.keys[0], before).item()
    two = s.view(Span(0, 2, (57, 40), (1, 0)), mx.array([57, 40]))  # two rows: their slots and lengths
    k2, _, lengths = two.in_place(1)
    assert lengths == (57, 40) and k2.shape == (2, 2, 512, 8) and mx.array_equal(k2[:, :, :60], keys).item()
    states = StateView([mx.zeros((2, 3, 16)), mx.zeros((2, 2, 4, 4))], mx.array([1, 0]), record=False)
    assert not pd.eligible([two, states], 1) and pd.rows_eligible([two, states])  # the rows' launch takes them
    assert not pd.rows_eligible([one, state])  # one row: the one-row launch
    assert not pd.rows_eligible([s.view(Span(0, 2, (4096, 40), (1, 1)), mx.array([4096, 40])), states])  # past MAX_S
    assert not pd.eligible([s.view(Span(1, 2, (4096,), (1,)), mx.array([4096])), state], 1)  # past MAX_S
    assert slab(window=32)[0].view(Span(1, 2, (57,), (1,)), mx.array([57])).in_place(1) is None
    q, wide = SlotKV(fmt=KVFormat(bits=4, group_size=32)), mx.zeros((1, 2, 8, 32), mx.bfloat16)
    q.write(Span(0, 1, (0,), (8,)), mx.array([0]), wide, wide)
    assert q.view(Span(0, 1, (8,), (1,)), mx.array([8])).in_place(1) is None  # packed keys: not in place
    assert not pd.eligible([one, StateView([mx.zeros((1, 3, 16)), None], None, record=False)], 1)  # no state yet


def test_the_one_launch_step_is_prepared_only_where_cuda_runs():
    # head_dim 256: a model the one-launch step applies to (see above)
    m = gb.build(dict(gb.DRAFT_08B, **dict(gb.SMALL, head_dim=256), full_attention_interval=2), mx.float32, 4)
    forward = fast_draft.narrow_forward(m, persistent=True)  # the sublayer path applies ...
    assert forward is not None and (forward.one is not None) == dk.available(mx.float32)  # ... the one-launch step on CUDA only


def _batch_step(batch, ids, x, widths):
    f = batch.forward(ids, x, widths)
    batch.commit(f, widths)
    return f


@pytest.mark.parametrize("rows", [3, 10, fast_draft.ROW_PADS[-1] + 1])
def test_a_batch_draft_step_of_many_rows_computes_mlx_lms_forward(model, rows, monkeypatch):
    """Rows of one token each at their own lengths (the batch's draft steps), some of width 0
    (a row past its draft length): the rows' path (padded to 8, 16 or 32 rows, or the gemvs' ops
    past them) gives mlx-lm's logits and leaves the same caches."""
    from worker.batch.slotbatch import SlotBatch

    calls = []
    real = fast_draft.forward_rows
    monkeypatch.setattr(fast_draft, "forward_rows", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    ids = [f"r{i}" for i in range(rows)]
    ref, fast = SlotBatch(model), SlotBatch(model, fast_draft.narrow_forward(model))
    widths = [4 + 3 * i for i in range(rows)]
    prompt = mx.array([[(7 * i + 5 * j) % 4000 + 1 for j in range(max(widths))] for i in range(rows)])
    for b in (ref, fast):
        for rid in ids:
            b.add(rid)
        b.arrange(set(ids))
        _batch_step(b, ids, prompt, widths)
    for n, live in enumerate(([1] * rows, [1, 0] * (rows // 2) + [1] * (rows % 2), [1] * rows)):
        x = mx.array([[(31 * n + 11 * i) % 4000 + 1] for i in range(rows)])
        want, got = _batch_step(ref, ids, x, live), _batch_step(fast, ids, x, live)
        for i in (i for i in range(rows) if live[i]):
            scale = mx.abs(want.logits[i]).max().item()
            assert mx.abs(got.logits[i] - want.logits[i]).max().item() <= 1e-4 * scale, (n, i)
        span = ref.span(ids)
        for a, b in zip(sum(fast.recurrent_rows(span), []), sum(ref.recurrent_rows(span), []), strict=True):
            assert a.shape == b.shape and mx.abs(a - b).max().item() <= 1e-4 * max(1.0, mx.abs(b).max().item())
        assert ref.lengths == fast.lengths
    assert calls == [(rows, 1)] * 3
