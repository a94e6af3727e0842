"""`python -m bench.draft_launch`: the draft's one-launch step (worker/kernels/persistent_draft.py)
by rows, on a CUDA GPU: for one row (its T = 1 launch) and for R rows of a token each (the rows'
launch, padded to ROWS), the step whole, its layers' launch alone and the head alone, then the
layers again with the barriers skipped (wrong results: the phases' cost alone), staging inputs
as float32 (`--f32`) and with each `--warps` a block. Rows hold `--length` tokens. Prints a JSON line per measurement, every
repeat's milliseconds in it."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from worker.backend_env import apply


def _time(fn, repeats: int) -> dict:
    import mlx.core as mx

    out = []
    for _ in range(repeats + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append(round((time.perf_counter() - t0) * 1000, 3))
    out = out[3:]  # the first calls compile
    return {"median": statistics.median(out), "all": out}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--length", type=int, default=560)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warps", type=int, nargs="*", default=[], help="also the layers' launch at these warps a block")
    p.add_argument("--check", action="store_true", help="first check the launches against the ops (bench.step_parts)")
    p.add_argument("--f32", action="store_true", help="also the layers' launch staging its inputs as float32")
    p.add_argument("--skip", type=int, nargs="*", default=[],
                   help="also the layers' launch leaving these phases out (persistent_draft._Weights.skip masks)")
    a = p.parse_args()
    apply()
    import mlx.core as mx

    from bench import gpu_models as gb
    from worker.batch.slotbatch import SlotBatch
    from worker.kernels import fast_draft
    from worker.kernels import persistent_draft as pd

    draft = gb.build(dict(gb.DRAFT_08B), gb.DTYPES["bf16"], 1)
    one = fast_draft.where_it_runs(draft)
    if one is None or one.one is None:
        raise SystemExit("the one-launch step runs on a CUDA GPU only")
    w, text = one.one, draft.language_model
    if a.check:
        from bench.step_parts import check_one_row, check_rows

        for rows in (r for r in a.rows if r > 1):
            print(json.dumps(check_rows(draft, rows)), flush=True)
        print(json.dumps(check_one_row(draft)), flush=True)
    for rows in a.rows:
        batch = SlotBatch(draft, one)
        ids = [f"r{i}" for i in range(rows)]
        for rid in ids:
            batch.add(rid)
        batch.arrange(set(ids))
        x = mx.array([[(7 * i + j) % 1000 + 1 for j in range(a.length)] for i in range(rows)])
        batch.commit(batch.forward(ids, x, [a.length] * rows), [a.length] * rows)
        mx.eval(batch.arrays())
        step = mx.array([[5 + i] for i in range(rows)])
        TP = 1 if rows == 1 else next(n for n in pd.ROWS if n >= rows)
        h = text.model.embed_tokens(mx.zeros((TP,), mx.uint32)).reshape(TP, -1)

        def layers():
            batch.run = lambda tokens, cache: cache  # the step's views alone (never committed: each
            v = batch.forward(ids, step, [1] * rows).logits  # call writes past the rows' lengths, unseen)
            batch.run = one
            return pd.layers_step(draft, w, h, v) if rows == 1 else pd.rows_step(draft, w, h, v)

        def head():
            return pd.head_logits(draft, h)

        line = {"rows": rows, "launch_rows": TP, "length": a.length,
                "step_ms": _time(lambda: batch.forward(ids, step, [1] * rows).logits, a.repeats),
                "layers_ms": _time(layers, a.repeats), "head_ms": _time(head, a.repeats)}
        w.nosync = True
        line["layers_no_barriers_ms"] = _time(layers, a.repeats)
        w.nosync = False
        for mask in a.skip:
            w.skip = mask
            line[f"layers_skip_{mask}_ms"] = _time(layers, a.repeats)
            w.skip = 0
        if a.f32:
            pd.STAGE_F32 = True
            line["layers_f32_staged_ms"] = _time(layers, a.repeats)
            pd.STAGE_F32 = False
        for warps in a.warps:
            before = dict(pd.WARPS)
            pd.WARPS[TP] = warps
            try:
                line[f"layers_{warps}_warps_ms"] = _time(layers, a.repeats)
            except Exception as e:  # a launch the SM cannot hold (registers)
                line[f"layers_{warps}_warps_ms"] = str(e)[:200]
            pd.WARPS.clear()
            pd.WARPS.update(before)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
