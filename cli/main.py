"""verity: clients of a running stack (generate, chat, monitor) and benchmarks."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verity")
    sub = p.add_subparsers(dest="command", required=True)
    from cli import bench, client, distill, monitor, replay

    client.add_commands(sub)
    monitor.add_commands(sub)
    bench.add_commands(sub)
    replay.add_commands(sub)
    distill.add_commands(sub)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
