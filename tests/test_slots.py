"""The slot caches (worker/batch/): rows of one batch joining, leaving, feeding forwards of
random widths and keeping random prefixes of them hold exactly what one-token decoding of their
kept tokens holds, on both recovery paths; and a request's phases move only along their edges."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from bench.tiny_models import tiny_model_dir
from worker.batch.rows import Phase, advance
from worker.batch.slotbatch import SlotBatch
from worker.batch.slots import CAUSAL_FROM
from worker.loader import load_model
from worker.state import checkpoint as st

ROUNDS = 40


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request, tmp_path_factory):
    lm = load_model(str(tiny_model_dir(tmp_path_factory, request.param, seed=5)))
    st.install_recording(lm.model)
    return lm.model


def _sequential(model, tokens: list[int]) -> list[mx.array]:
    cache = st.make_cache(model)
    for t in tokens:
        model(mx.array([[t]]), cache=cache)
    return st.cache_arrays(cache)


def _same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and mx.allclose(x, y, rtol=1e-4, atol=1e-4).item()
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("record", [True, False], ids=["fast", "replay"])
def test_rows_of_random_widths_keep_exactly_their_tokens(model, record):
    """Each round: a row may join (empty) or leave; the live rows feed 1-6 random tokens each in
    one forward (right-padded) and keep a random prefix of them (at least one). After every round
    each row's caches equal a one-token decode of the tokens it kept."""
    rng = random.Random(7 if record else 8)
    batch, kept, next_id = SlotBatch(model), {}, 0
    for rnd in range(ROUNDS):
        if len(kept) < 5 and (not kept or rng.random() < 0.3):
            rid = f"r{next_id}"
            next_id += 1
            batch.add(rid)
            kept[rid] = []
        if len(kept) > 2 and rng.random() < 0.15:
            gone = rng.choice(sorted(kept))
            batch.remove(gone)
            del kept[gone]
        ids = batch.arrange(set(kept))
        feeds = {rid: [rng.randrange(1, 300) for _ in range(rng.randint(1, 6))] for rid in ids}
        width = max(len(f) for f in feeds.values())
        x = mx.array([feeds[r] + [0] * (width - len(feeds[r])) for r in ids], dtype=mx.uint32)
        f = batch.forward(ids, x, [len(feeds[r]) for r in ids], record=record)
        keep = [rng.randint(1, len(feeds[r])) for r in ids]
        batch.commit(f, keep)
        for rid, n in zip(ids, keep):
            kept[rid] += feeds[rid][:n]
        for rid in ids:
            assert batch.lengths[rid] == len(kept[rid])
            got = st.cache_arrays(batch.row_cache(rid))
            assert _same(got, _sequential(model, kept[rid])), (rnd, rid)


@pytest.mark.parametrize("pad", [0, 3, CAUSAL_FROM - 21, CAUSAL_FROM + 5], ids=["exact", "array-mask", "to-causal", "past-causal"])
def test_a_forward_padded_past_its_widest_row_keeps_the_rows_exact(model, pad):
    """A forward wider than any of its rows (a catch-up padded to a recurring width) leaves each
    row's caches as a one-token decode of what it fed: the padding is masked, never attended."""
    batch, first = SlotBatch(model), list(range(5, 47))
    batch.add("a")
    ids = batch.arrange({"a"})
    batch.commit(batch.forward(ids, mx.array([first], dtype=mx.uint32), [len(first)]), [len(first)])
    fed = list(range(60, 81))
    f = batch.forward(ids, mx.array([fed + [0] * pad], dtype=mx.uint32), [len(fed)])
    batch.commit(f, [len(fed)])
    assert _same(st.cache_arrays(batch.row_cache("a")), _sequential(model, first + fed))


def test_a_row_restored_from_caches_goes_on_as_one_never_taken_out(model):
    """A row's caches taken out (a snapshot) and put into another row hold the same state: both
    decode on alike."""
    batch = SlotBatch(model)
    batch.add("a")
    ids = batch.arrange({"a"})
    prompt = [5, 9, 17, 33, 2, 40]
    batch.commit(batch.forward(ids, mx.array([prompt], dtype=mx.uint32), [len(prompt)]), [len(prompt)])
    batch.add("b", batch.row_cache("a"), len(prompt))
    ids = batch.arrange({"a", "b"})
    f = batch.forward(ids, mx.array([[7], [7]], dtype=mx.uint32), [1, 1])
    assert mx.allclose(f.logits[0], f.logits[1], atol=1e-5).item()


def test_rows_snapshotted_as_they_leave_in_turn_hold_their_own_tokens(model):
    """Rows leave one by one, each copied out just before (as finished requests are kept): each
    copy holds exactly its row's tokens, and the rows left decode on exactly."""
    batch, tokens = SlotBatch(model), {}
    for i in range(4):
        batch.add(f"r{i}")
        tokens[f"r{i}"] = [3 + 7 * i + j for j in range(3 + i)]
    ids = batch.arrange(set(tokens))
    width = max(len(t) for t in tokens.values())
    x = mx.array([tokens[r] + [0] * (width - len(tokens[r])) for r in ids], dtype=mx.uint32)
    batch.commit(batch.forward(ids, x, [len(tokens[r]) for r in ids]), [len(tokens[r]) for r in ids])
    for rid in ["r0", "r2"]:
        assert _same(st.cache_arrays(batch.row_cache(rid)), _sequential(model, tokens.pop(rid)))
        batch.remove(rid)
    ids = batch.arrange(set(tokens))
    batch.commit(batch.forward(ids, mx.array([[11]] * len(ids), dtype=mx.uint32), [1] * len(ids)), [1] * len(ids))
    for rid in ids:
        assert _same(st.cache_arrays(batch.row_cache(rid)), _sequential(model, tokens[rid] + [11]))


def test_a_request_moves_only_along_its_phases():
    assert advance(Phase.WAITING, Phase.PREFILL) == Phase.PREFILL
    assert advance(Phase.PREFILL, Phase.DECODE) == Phase.DECODE
    assert advance(Phase.DECODE, Phase.DONE) == Phase.DONE
    for bad in [(Phase.WAITING, Phase.DECODE), (Phase.DECODE, Phase.PREFILL), (Phase.DONE, Phase.DECODE)]:
        with pytest.raises(RuntimeError, match="cannot go from"):
            advance(*bad)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_draft_on_its_kernels_path_keeps_the_batch_exact(rows, monkeypatch):
    """A Qwen3.5 draft whose one-row forwards take the draft kernels' path (their ops on the CPU)
    inside the batch: joint rows' greedy output is the target's own; with two joint rows the
    draft's forwards are batched (mlx-lm's)."""
    from bench import gpu_models as gb
    from worker.batch.rows import Row
    from worker.batch.runner import BatchRunner, play
    from worker.joint.sampling import make_key_fn
    from worker.kernels import fast_draft
    from worker.sampling import RowSampling
    from worker.scheduler import Scheduler

    cfg = dict(gb.TARGET_9B, **gb.SMALL)
    target = gb.build(cfg, mx.float32, 0)
    draft = gb.build(dict(gb.DRAFT_08B, **gb.SMALL), mx.float32, 1)
    forward = fast_draft.narrow_forward(draft)
    assert forward is not None
    calls = []
    real = fast_draft.forward
    monkeypatch.setattr(fast_draft, "forward", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    prompts = [[5, 9, 300, 17, 2, 41], [8, 8, 1000, 3]][:rows]

    def run(with_draft: bool) -> dict[str, list[int]]:
        runner = BatchRunner(target, draft if with_draft else None, 64, draft_forward=forward if with_draft else None)
        out = {}
        for i, p in enumerate(prompts):
            runner.join(Row(f"r{i}", p, RowSampling(), make_key_fn(0), joint=with_draft))
            out[f"r{i}"] = []
        sched = Scheduler(fixed=3)
        while runner.rows:
            rnd = play(runner, sched, lambda rid: 12 - len(out[rid]))
            for o in rnd.decoded.outcomes:
                out[o.id] += o.tokens[: 12 - len(out[o.id])]
            for rid in [r for r in runner.rows if len(out[r]) >= 12]:
                runner.leave(rid)
        return out

    joint, plain = run(True), run(False)
    assert joint == plain
    assert bool(calls) == (rows == 1)


def test_recurrent_rows_rearranged_take_their_own_arrays():
    """A leave, a join (with and without state of its own) and a truncation put each recurrent
    row's arrays where the new order says: old rows by index, joining rows their own or zeros."""
    from worker.batch.slots import SlotArrays

    layer = SlotArrays(2)
    old = [mx.arange(4 * 3).reshape(4, 3).astype(mx.float32), mx.arange(4 * 2).reshape(4, 2).astype(mx.bfloat16)]
    mine = [mx.full((1, 3), 7.0), None]  # a joining row with a conv window and no state
    cases = [([0, 1, 2], {}), ([0, 3, 2], {}), ([2, 0, 1, 3], {}), ([0, 1, 2, 3, -1], {4: mine}),
             ([3, -1, 0, -1], {1: mine}), ([-1], {})]
    for order, fresh in cases:
        layer.arrays = list(old)
        layer.apply(order, fresh)
        for e, a in enumerate(layer.arrays):
            want = [old[e][s] if s >= 0 else (fresh[i][e][0] if i in fresh and fresh[i][e] is not None
                                              else mx.zeros(old[e].shape[1:], old[e].dtype))
                    for i, s in enumerate(order)]
            assert a.dtype == old[e].dtype and a.tolist() == mx.stack(want).tolist(), (order, e)
    layer.arrays = [None, None]
    layer.apply([-1, -1], {0: mine})
    assert layer.arrays[0].tolist() == [[7.0] * 3, [0.0] * 3] and layer.arrays[1] is None


def test_a_rows_move_writes_the_slab_in_place_not_a_copy_of_it():
    """Moving a row into another's slot (a leave) rewrites that slot only: the slab keeps its
    memory where a scatter reading its own input would copy all of it first."""
    import numpy as np

    from worker.batch.slots import SlotKV, Span

    slab = SlotKV()
    rows = mx.random.normal((4, 2, 64, 8)).astype(mx.float16)
    slab.write(Span(0, 4, (0,) * 4, (64,) * 4), mx.zeros((4,), mx.int32), rows, rows)
    slab.move_rows([(0, 3)], 4)
    mx.eval(slab.parts())
    where = np.asarray(slab.keys[0]).ctypes.data
    slab.move_rows([(1, 2)], 4)
    mx.eval(slab.parts())
    assert np.asarray(slab.keys[0]).ctypes.data == where
    held = slab.keys[0][:, :, :64]  # the slab's capacity runs past the 64 positions written
    assert mx.array_equal(held[1], rows[2]).item() and mx.array_equal(held[0], rows[3]).item()


def test_a_gpus_wide_forward_writes_the_slab_in_place_and_a_one_token_forward_scatters(monkeypatch):
    """Where the in-place kernel runs, a verify or prompt chunk (wider than one token) takes it and
    a plain round's one-token write keeps MLX's scatter unless the slab is big; a quantized slab
    always scatters."""
    from worker.batch.slots import SlotKV, Span
    from worker.kernels import kv_write
    from worker.kvformat import KVFormat

    calls = []

    def fake_write(keys, values, start, offsets, k, v):
        calls.append((start, k.shape[2]))
        return keys, values

    monkeypatch.setattr(kv_write, "available", lambda: True)
    monkeypatch.setattr(kv_write, "write", fake_write)
    new = mx.ones((2, 2, 3, 32))
    for fmt in (None, KVFormat(bits=8, group_size=32)):
        slab = SlotKV() if fmt is None else SlotKV(fmt=fmt)
        slab.write(Span(0, 2, (0, 0), (3, 3)), mx.array([0, 0]), new, new)
        slab.write(Span(0, 2, (3, 3), (1, 1)), mx.array([3, 3]), new[:, :, :1], new[:, :, :1])
        mx.eval(slab.parts())
    assert calls == [(0, 3)]
    monkeypatch.setattr(kv_write, "BIG", 1)  # every slab big: one-token writes take the kernel too
    slab = SlotKV()
    slab.write(Span(0, 2, (0, 0), (3, 3)), mx.array([0, 0]), new, new)
    slab.write(Span(0, 2, (3, 3), (1, 1)), mx.array([3, 3]), new[:, :, :1], new[:, :, :1])
    assert calls == [(0, 3), (0, 3), (0, 1)]
