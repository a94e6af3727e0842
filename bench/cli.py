"""`verity bench ...` and `verity distill ...`: the lab's commands, loaded only when one is run.

Each bench is a sub-subcommand of `bench` built on bench/common.py (a stack started as a
subprocess, medians, a rich table on stdout, `--json` as the last line of stdout). Progress goes to
stderr. Exit 0 when a bench ran, whatever its figures.
"""

from __future__ import annotations

import argparse
import sys

from bench import agent_loop, batch, cache, distributed, gpu, gpu_batch, joint, memory, overhead, sched
from bench.distill import cli as distill


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verity")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmarks (each starts what it measures)")
    benches = b.add_subparsers(dest="bench", required=True)
    for module in (overhead, batch, joint, sched, gpu, gpu_batch, cache, agent_loop, distributed, memory):
        module.add_command(benches)
    distill.add_commands(sub)
    return p


def main(argv: list[str]) -> int:
    """argv: the whole command line after `verity` (it starts with "bench" or "distill")."""
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
