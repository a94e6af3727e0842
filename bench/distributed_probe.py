"""One rank of `verity bench distributed`'s probe (started with MLX's ring environment): prints,
on rank 0, the seconds one all_sum takes of a [batch, hidden] float32 array and of the control
message's byte buffer (one at a time, as rank 0 sends it)."""

from __future__ import annotations

import sys
import time

import mlx.core as mx


def timed(a: mx.array, group: mx.distributed.Group, reps: int, chain: int) -> float:
    """Seconds per all_sum in a graph of `chain` dependent all_sums evaluated at once, as a
    sharded forward runs them."""

    def once() -> None:
        x = a
        for _ in range(chain):
            x = mx.distributed.all_sum(x, group=group) * 0.5
        mx.eval(x)

    once()  # the first connects and allocates
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t0) / (reps * chain)


def main(argv: list[str]) -> int:
    hidden, batch, reps, control, chain = (int(x) for x in argv)
    group = mx.distributed.init(backend="ring", strict=True)
    forward = timed(mx.ones((batch, hidden)), group, reps, chain)
    message = timed(mx.zeros((control,), mx.uint8), group, reps * chain, 1)
    if group.rank() == 0:
        print(forward, message, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
