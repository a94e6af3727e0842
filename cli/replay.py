"""verity replay LOG: recomputes every logged scheduler decision and reports any difference."""

from __future__ import annotations

import sys


def add_commands(sub) -> None:
    p = sub.add_parser("replay", help="recompute every decision of a scheduler decision log")
    p.add_argument("log", help="the file written by launch-stack --decision-log")
    p.set_defaults(run=run)


def run(args) -> int:
    from worker.scheduler import replay

    with open(args.log) as f:
        lines = f.readlines()
    diffs = replay(lines)
    for d in diffs:
        print(d)
    decisions = sum(1 for line in lines if '"n_requests"' in line)  # not held rounds, round times or cycles
    print(f"{decisions} decisions replayed, {len(diffs)} differences", file=sys.stderr)
    return 1 if diffs else 0
