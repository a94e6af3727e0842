"""Attention slab writes four ways, side by side in one process on the gpu-batch shapes
(worker/kernels/kv_write.py, docs/design.md "Slab writes on a GPU"): "wide" (as served: the
in-place kernel for forwards wider than one token and big slabs, MLX's scatter for the rest),
"every" (the kernel for every write), "none" (the scatter everywhere, which a GPU may copy by
timing) and "settle" (the scatter, the batch waiting for the device before it encodes each round).
Each repeat runs, for each way, every row plain, every row joint under the adaptive scheduler (one
scheduler a way, kept across repeats) and every row joint 2 deep, α = 0.8 by construction; it
prints tokens/s, the ratios to plain, drafted/accepted and the stalls as gpu-batch counts them
(rounds over 5x the run's median round), and the joint rows equal to plain's tokens, with the
target's top-two logit gap where one differs (a near-tie flipped by a wide forward's rounding, or
a fault: compare the ways); plain's rows against the first plain run's (the same shapes: any
difference is a fault). On the CPU every way is the scatter.

    python -m bench.slab_writes --n 8 --repeats 3      # the 9B/0.8B shapes
    python -m bench.slab_writes --small --n 4 --repeats 1
"""

from __future__ import annotations

import argparse
import time

from worker.kernels.kv_write import MODES



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (a check on any device)")
    p.add_argument("--n", type=int, default=8, help="rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    from worker.backend_env import apply

    apply()
    import mlx.core as mx

    from bench import gpu_batch as g
    from bench import gpu_models as gb
    from worker.kernels import fast_draft, kv_write
    from worker.scheduler import Scheduler

    tcfg, dcfg = dict(gb.TARGET_9B), dict(gb.DRAFT_08B)
    if a.small:
        tcfg.update(gb.SMALL)
        dcfg.update(gb.SMALL, hidden_size=128, intermediate_size=256)
    target, draft = gb.build(tcfg, mx.bfloat16, 0), gb.build(dcfg, mx.bfloat16, 1)
    vocab, forward = tcfg["vocab_size"], fast_draft.where_it_runs(draft)
    prompts = g._prompts(a.n, 64, vocab)

    def runs(sched):
        plain = g.verity_run(target, prompts, a.tokens)
        joint = [g.verity_run(target, prompts, a.tokens, draft, ref, 0.8, vocab, s, 1, forward)
                 for s in (sched, Scheduler(fixed=2))]
        return plain, joint

    t0 = time.perf_counter()
    ref = g.verity_run(target, prompts, a.tokens).tokens
    for mode in MODES:  # every way's shapes met once before anything is timed
        kv_write.set_mode(mode)
        runs(Scheduler())
    print(f"device {gb.device()}, {a.n} rows; warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    scheds = {m: Scheduler() for m in MODES}
    for rep in range(a.repeats):
        for mode in MODES:
            kv_write.set_mode(mode)
            plain, (ad, fx) = runs(scheds[mode])
            for r in (plain, ad, fx):  # plain's shapes are the first plain's: a difference is a fault
                r.differ = g.divergences(target, prompts, ref, r.tokens)
            pt = plain.tokens_per_s
            print(f"repeat {rep} {mode:5s}: plain {pt:.1f} tok/s (stalls {plain.stalls}, "
                  f"{g.said_divergences(plain, a.n, 'first plain')}) | adaptive "
                  f"{ad.tokens_per_s:.1f} = {ad.tokens_per_s / pt:.2f}, {ad.drafted}/{ad.accepted} (stalls {ad.stalls}, "
                  f"{g.said_divergences(ad, a.n)}) | 2 deep {fx.tokens_per_s:.1f} = {fx.tokens_per_s / pt:.2f} "
                  f"(stalls {fx.stalls}, {g.said_divergences(fx, a.n)})", flush=True)
    kv_write.set_mode("wide")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
