"""verity: clients of a running stack (generate, chat, monitor, replay); `bench` and `distill`
hand the whole command line to the lab (bench/), imported only then."""

from __future__ import annotations

import argparse
import sys

LAB_COMMANDS = {"bench": "benchmarks (each starts what it measures); verity bench --help lists them",
                "distill": "build the embedded model's draft here (resumable); verity distill --help"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LAB_COMMANDS:
        from bench.cli import main as lab_main

        return lab_main(argv)
    p = argparse.ArgumentParser(prog="verity", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    from cli import client, monitor, replay

    client.add_commands(sub)
    monitor.add_commands(sub)
    replay.add_commands(sub)
    for name, help_text in LAB_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = p.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
