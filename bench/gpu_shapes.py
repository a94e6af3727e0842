"""`python -m bench.gpu_shapes`: each round's time on a GPU as the draft width and row count change,
to find what a new shape costs (a kernel or attention plan built for it) and whether it repeats.
Prints one line per round: rows, draft length, widest forward, the longest cache, seconds."""

from __future__ import annotations

import argparse
import json
import os
import time

from worker.backend_env import apply


class Fixed:
    """A planner that drafts `k` for every joint row in each round, from a schedule."""

    def __init__(self, schedule: list[int]):
        self.schedule, self.i = schedule, 0

    def plan_round(self, inp):
        from worker.round import RoundPlan

        k = self.schedule[min(self.i, len(self.schedule) - 1)]
        self.i += 1
        return RoundPlan({r.request_id: k for r in inp.rows})


def run(n: int, schedule: list[int], prompt: int, small: bool, profile_from: int = -1) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from bench import gpu_models as gb
    from bench.gpu_batch import _prompts
    from worker.batch.rows import Row
    from worker.batch.runner import BatchRunner, play
    from worker.joint.sampling import make_key_fn
    from worker.kernels import fast_draft
    from worker.sampling import RowSampling

    tcfg, dcfg = dict(gb.TARGET_9B), dict(gb.DRAFT_08B)
    if small:
        tcfg.update(gb.SMALL)
        dcfg.update(gb.SMALL, hidden_size=128, intermediate_size=256)
    target, draft = gb.build(tcfg, gb.DTYPES["bf16"], 0), gb.build(dcfg, gb.DTYPES["bf16"], 1)
    forward = fast_draft.where_it_runs(draft)
    prompts = _prompts(n, prompt, tcfg["vocab_size"])
    runner = BatchRunner(target, draft, 2048, draft_forward=forward)
    runner.warm(prompts[0], 9)
    for i, p in enumerate(prompts):
        runner.join(Row(f"r{i}", p, RowSampling(), make_key_fn(0), joint=True))
    import cProfile
    import pstats

    planner, out, prof, profiling = Fixed(schedule), [], cProfile.Profile(), False
    with mx.stream(generation_stream):
        for i in range(len(schedule)):
            if schedule[i] < 0:  # a row leaves: the next rounds run one row fewer
                runner.leave(next(iter(runner.rows)))
                continue
            if i >= profile_from >= 0 and not profiling:
                profiling = True
                prof.enable()
            t0 = time.perf_counter()
            rnd = play(runner, planner, lambda rid: 10_000)
            host = time.perf_counter() - t0
            mx.synchronize()
            dt = time.perf_counter() - t0
            longest = max(len(r.seq) for r in runner.rows.values())
            out.append({"round": i, "rows": len(rnd.decoding), "k": schedule[i], "longest": longest,
                        "prefill": rnd.prefilled, "ms": round(dt * 1000, 1),
                        "host_ms": round(host * 1000, 1)})
            print(json.dumps(out[-1]), flush=True)
    if profiling:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--small", action="store_true")
    p.add_argument("--exact-catch-up", action="store_true", help="catch-up forwards at their own width, not padded")
    p.add_argument("--profile-from", type=int, default=-1, help="cProfile the rounds from this one on")
    p.add_argument("--schedule", default="0*6,2*8,4*8,0*4,4*6,8*6,2*4,-1*1,4*4,-1*1,4*4",
                   help="draft length * rounds, comma-separated; -1 * n: n rows leave")
    a = p.parse_args()
    sched = [int(k) for part in a.schedule.split(",") for k in [part.split("*")[0]] * int(part.split("*")[1])]
    apply()
    if a.exact_catch_up:  # the way before catch-up widths were padded to recurring shapes
        from worker.batch import drafts

        drafts.CATCH_UP_PADDED = False
    print(json.dumps({"exact_catch_up": a.exact_catch_up, "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "default"), "n": a.n}), flush=True)
    run(a.n, sched, a.prompt, a.small, a.profile_from)


if __name__ == "__main__":
    main()
