"""`python -m bench.step_parts`: where a round's time goes on a GPU (with `--embedded`, the
embedded pair on any device), rows of equal or staggered lengths. For each (rows, stagger, k)
it plays rounds twice: free (each round's wall time, as served) and split (a wait after each
part: the draft's proposals, the target's forward, the commit, the draft's recovery; the rest
is the host's). Then attention alone on the slab: the
mask and the write each row at its own length needs, against one slice and no mask.
Prints a JSON line per measurement, every round's time in it."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from worker.backend_env import apply


def _ms(xs: list[float]) -> dict:
    xs = [round(x * 1000, 2) for x in xs]
    return {"median": statistics.median(xs) if xs else None, "all": xs}


class Split:
    """Wraps a batch's forward and commit and the draft module's propose and recover with a wait
    after each, adding up each part's seconds."""

    def __init__(self, runner, drafts_module):
        import mlx.core as mx

        self.mx, self.parts, self.on, self.depth = mx, defaultdict(float), False, 0
        self._wrap(runner.target, "forward", "target_forward", lambda f: [f.logits])
        self._wrap(runner.target, "commit", "target_commit", lambda _: runner.target.arrays())
        if runner.draft is not None:
            self._wrap(runner.draft, "forward", "draft_forward", lambda f: [f.logits])
            self._wrap(runner.draft, "commit", "draft_commit", lambda _: runner.draft.arrays())
            self._wrap(drafts_module, "recover", "draft_recover", lambda _: runner.draft.arrays())

    def _wrap(self, owner, name: str, part: str, outputs) -> None:
        inner = getattr(owner, name)

        def timed(*a, **kw):
            if not self.on or self.depth:  # a part inside a part (a recovery's forward) counts once
                return inner(*a, **kw)
            self.mx.synchronize()
            t0, self.depth = time.perf_counter(), 1
            try:
                out = inner(*a, **kw)
                self.mx.eval(outputs(out))
                self.mx.synchronize()
            finally:
                self.depth = 0
            self.parts[part] += time.perf_counter() - t0
            return out

        setattr(owner, name, timed)


def rounds(runner, planner, n: int, split: Split, on: bool) -> tuple[list[float], dict]:
    import mlx.core as mx

    from worker.batch.runner import play

    split.on, split.parts = on, defaultdict(float)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        play(runner, planner, lambda rid: 100_000)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    split.on = False
    return times, {k: round(v * 1000 / n, 2) for k, v in split.parts.items()}


def cell(runner, split: Split, k: int, warm: int, timed: int) -> dict:
    from bench.gpu_shapes import Fixed

    planner = Fixed([k])
    rounds(runner, planner, warm, split, False)
    free, _ = rounds(runner, planner, timed, split, False)
    spl, parts = rounds(runner, planner, timed, split, True)
    total = statistics.median(spl) * 1000
    parts["host_and_rest"] = round(total - sum(parts.values()), 2)
    lengths = sorted(runner.target.lengths.values())
    return {"k": k, "rows": len(lengths), "lengths": [lengths[0], lengths[-1]],
            "free_ms": _ms(free), "split_ms": _ms(spl), "parts_ms_per_round": parts}


def builds(runner, reps: int = 10) -> dict:
    """Host time to build one forward's graph (no evaluation) and the time to evaluate it, for the
    target and the draft over the decoding rows at width 1 (nothing committed: no row changes)."""
    import mlx.core as mx

    ids = runner.decoding()
    out = {}
    for name, batch in (("target", runner.target), ("draft", runner.draft)):
        build, run = [], []
        for _ in range(reps):
            mx.synchronize()
            t0 = time.perf_counter()
            f = batch.forward(ids, mx.zeros((len(ids), 1), mx.uint32), [1] * len(ids))
            t1 = time.perf_counter()
            mx.eval(f.logits)
            mx.synchronize()
            build.append(t1 - t0)
            run.append(time.perf_counter() - t1)
        out[name] = {"build_ms": _ms(build[2:]), "eval_ms": _ms(run[2:])}
    return out


def attention(rows: int, length: int, heads: int, kv_heads: int, dim: int, repeats: int) -> list[dict]:
    """The slab's attention and writes alone: one layer, `repeats` calls a measurement."""
    import mlx.core as mx

    from worker.batch.slots import KVView, SlotKV, Span

    out = []
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    kv = mx.random.normal((rows, kv_heads, 1, dim)).astype(mx.bfloat16)
    for stagger in (0, 1):
        lengths = tuple(length + stagger * 7 * i for i in range(rows))
        slab = SlotKV()
        slab.reserve(rows, max(lengths) + 64, ([kv], [kv]))
        mx.eval(slab.parts())
        span = Span(0, rows, lengths, (1,) * rows)
        view = KVView(slab, span, mx.array(lengths))
        for what in ("write", "mask", "sdpa", "all"):
            times = []
            for _ in range(repeats):
                mx.synchronize()
                t0 = time.perf_counter()
                if what == "write":
                    slab.write(span, view.offset, kv, kv)
                    mx.eval(slab.parts())
                elif what == "mask":
                    mx.eval(mx.array(0) if view.make_mask(1) is None else view.make_mask(1))
                else:
                    k, v = view.update_and_fetch(kv, kv) if what == "all" else slab.fetch(span, view.upto)
                    mask = view.make_mask(1)
                    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask))
                mx.synchronize()
                times.append(time.perf_counter() - t0)
            out.append({"attention": what, "rows": rows, "stagger": bool(stagger), "length": length,
                        "ms": _ms(times[repeats // 4:])})
    return out


def check_rows(draft, rows: int) -> dict:
    """The draft's step of many rows in one launch (persistent_draft.forward_rows) and through its
    rows kernels (fast_draft.forward_rows) against the rows' ops, on the device, over three
    one-token steps of `rows` rows at staggered lengths (at the second, row 1 has width 0 and
    keeps its state): the worst relative errors, argmax agreement and the one-launch calls made."""
    import mlx.core as mx

    from worker.batch.slotbatch import SlotBatch
    from worker.kernels import fast_draft

    one, fast = fast_draft.where_it_runs(draft), fast_draft.narrow_forward(draft)
    ops = (lambda x, c: fast_draft.forward_rows(draft, x, c, fast.layers, kernel=False)
           if x.shape[1] == 1 else draft(x, cache=c))
    ids, widths = [f"c{i}" for i in range(rows)], [40 + 9 * i for i in range(rows)]
    batches = [SlotBatch(draft, f) for f in (one, fast, ops)]
    for b in batches:
        for rid in ids:
            b.add(rid)
        b.arrange(set(ids))
        b.commit(b.forward(ids, mx.array([[(7 * i + j) % 1000 + 1 for j in range(max(widths))] for i in range(rows)]),
                           widths), widths)
    worst, agree, calls0 = [0.0, 0.0], [0, 0], one.one.calls if one and one.one else 0
    for n in range(3):
        x = mx.array([[(31 * n + 11 * i) % 1000 + 1] for i in range(rows)])
        step = [0 if n == 1 and i == 1 else 1 for i in range(rows)]
        fs = [b.forward(ids, x, step) for b in batches]
        for b, f in zip(batches, fs):
            b.commit(f, step)
        live = mx.array([i for i, w in enumerate(step) if w])
        got = [f.logits[live].astype(mx.float32) for f in fs]
        for j in range(2):
            worst[j] = max(worst[j], (mx.abs(got[j] - got[2]).max() / mx.abs(got[2]).max()).item())
            agree[j] += int(mx.array_equal(mx.argmax(got[j], -1), mx.argmax(got[2], -1)).item())
    calls = (one.one.calls if one and one.one else 0) - calls0
    return {"rows": rows, "one_launch_calls": calls, "one_launch_vs_ops_worst_relative_error": worst[0],
            "rows_kernels_vs_ops_worst_relative_error": worst[1],
            "argmax_agrees_with_ops": {"one_launch": agree[0], "rows_kernels": agree[1], "of": 3}}


def check_one_row(draft, steps: int = 6) -> dict:
    """A one-row draft step on the batch's slots through the one-launch kernel (writing the slab in
    place) against mlx-lm's forward on the same slots, on the device, with the kernels a sublayer
    as a control: rows at slots 0 and 1 of different lengths, each stepped alone; at step 2 the
    row rejects its token (its length stays, the next step writes there again), at step 3 it
    feeds two tokens. The worst relative logit errors, how often each path's argmax agrees with
    mlx-lm's (bf16 rounding flips near-ties of random weights), and the one-launch calls made
    (0: the kernel did not run)."""
    import mlx.core as mx

    from worker.batch.slotbatch import SlotBatch
    from worker.kernels import fast_draft

    fast = fast_draft.where_it_runs(draft)
    ids, widths = ["a", "b"], [40, 57]
    sub = fast_draft.narrow_forward(draft, persistent=False, widest=fast_draft.WIDEST) if fast else None  # a sublayer
    batches = [SlotBatch(draft, fast), SlotBatch(draft), SlotBatch(draft, sub)]
    for b in batches:
        for rid in ids:
            b.add(rid)
        b.arrange(set(ids))
        b.commit(b.forward(ids, mx.array([[(7 * i + j) % 1000 + 1 for j in range(57)] for i in range(2)]), widths), widths)
    worst, agree, checks, calls0 = [0.0, 0.0], [0, 0], 0, fast.one.calls if fast and fast.one else 0
    for n in range(steps):
        width = 2 if n == 3 else 1  # a row lagging two tokens (after a round that accepted every draft)
        for i, rid in enumerate(ids):
            x = mx.array([[(31 * n + 11 * i + j) % 1000 + 1 for j in range(width)]])
            fs = [b.forward([rid], x, [width]) for b in batches]
            for b, f in zip(batches, fs):
                b.commit(f, [0 if n == 2 else width])
            g, w, u = (f.logits.astype(mx.float32) for f in fs)
            for j, other in enumerate((g, u)):
                worst[j] = max(worst[j], (mx.abs(other - w).max() / mx.abs(w).max()).item())
            for j, other in enumerate((g, u)):
                agree[j] += int(mx.array_equal(mx.argmax(other, -1), mx.argmax(w, -1)).item())
            checks += 1
    calls = (fast.one.calls if fast and fast.one else 0) - calls0
    return {"one_row_persistent_calls": calls, "one_launch_vs_mlx_lm_worst_relative_error": worst[0],
            "sublayers_vs_mlx_lm_worst_relative_error": worst[1],
            "argmax_agrees_with_mlx_lm": {"one_launch": agree[0], "sublayers": agree[1], "of": checks}}


def _embedded():
    """The embedded model and its shipped draft, with the config keys the prompts and `--attention` read."""
    from worker.loader import load_draft, load_model

    lm = load_model("embedded")
    args = lm.model.args
    cfg = {"vocab_size": args.vocab_size, "num_attention_heads": args.num_attention_heads,
           "num_key_value_heads": args.num_key_value_heads, "head_dim": args.hidden_size // args.num_attention_heads}
    return lm.model, load_draft("embedded", lm).model, cfg


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ns", type=int, nargs="+", default=[8, 32])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--stagger", type=int, nargs="+", default=[0, 37], help="row i's prompt is 'prompt + i * stagger'")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--small", action="store_true")
    p.add_argument("--embedded", action="store_true", help="the embedded model and its shipped draft (any device)")
    p.add_argument("--check-rows", type=int, nargs="*", default=[], help="check the draft's rows path at these row counts")
    p.add_argument("--attention", action="store_true", help="also time one attention layer's parts alone")
    p.add_argument("--check-one-row", action="store_true", help="check the one-launch draft step on the batch's slots")
    p.add_argument("--sublayers", action="store_true",
                   help="the draft path before the one launch ran on the batch's slots (a comparison)")
    p.add_argument("--row-pads", type=int, nargs="+", default=None,
                   help="the row counts a draft step of many rows pads to for the gemv kernels (8: as before 16 and 32)")
    a = p.parse_args()
    apply()
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from bench import gpu_models as gb
    from bench.gpu_batch import _prompts
    from worker.batch import drafts as dr
    from worker.batch.rows import Row
    from worker.batch.runner import BatchRunner
    from worker.joint.sampling import make_key_fn
    from worker.kernels import fast_draft
    from worker.sampling import RowSampling

    tcfg, dcfg = dict(gb.TARGET_9B), dict(gb.DRAFT_08B)
    if a.small:
        tcfg.update(gb.SMALL)
        dcfg.update(gb.SMALL, hidden_size=128, intermediate_size=256)
    if a.embedded:
        target, draft, tcfg = _embedded()
    else:
        target, draft = gb.build(tcfg, gb.DTYPES["bf16"], 0), gb.build(dcfg, gb.DTYPES["bf16"], 1)
    forward = fast_draft.where_it_runs(draft)
    if a.row_pads:
        fast_draft.ROW_PADS = tuple(a.row_pads)
    if forward is not None and a.sublayers:
        forward = fast_draft.narrow_forward(draft, persistent=False, widest=1)
    runner = BatchRunner(target, draft, 2048, draft_forward=forward)
    split = Split(runner, dr)
    for rows in a.check_rows:
        print(json.dumps(check_rows(draft, rows)), flush=True)
    if a.check_one_row:
        print(json.dumps(check_one_row(draft)), flush=True)
    with mx.stream(generation_stream):
        base = _prompts(1, a.prompt + max(a.ns) * max(a.stagger), tcfg["vocab_size"])[0]
        runner.warm(base, 9)
        for n in a.ns:
            for stagger in a.stagger:
                ids = [f"n{n}s{stagger}r{i}" for i in range(n)]
                for i, rid in enumerate(ids):
                    runner.join(Row(rid, base[: a.prompt + i * stagger], RowSampling(), make_key_fn(0), joint=True))
                while runner.prefill_next():
                    runner.prefill()
                for k in a.ks:
                    print(json.dumps({"n": n, "stagger": stagger, **cell(runner, split, k, a.warm, a.rounds)}), flush=True)
                runner.draft.arrange(set(runner.decoding()))
                print(json.dumps({"n": n, "stagger": stagger, "forward": builds(runner)}), flush=True)
                for rid in ids:
                    runner.leave(rid)
        heads, kvh, dim = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["head_dim"]
        for n in a.ns if a.attention else []:
            for line in attention(n, a.prompt + 64, heads, kvh, dim, 24):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
