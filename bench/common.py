"""What every `verity bench ...` shares: a stack started as a subprocess, medians, a rich table
on stdout, `--json` as the last line of stdout, progress on stderr."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Iterable, Optional

from rich.console import Console
from rich.table import Table

from cli.stack_process import StackProcess

progress_console = Console(stderr=True, highlight=False)
DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."



def progress(msg: str) -> None:
    progress_console.print(msg, style="dim", markup=False)


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def print_report(title: str, rows: list[tuple[str, ...]], headers: tuple[str, ...],
                 figures: dict[str, Any], as_json: bool, footer: Optional[str] = None) -> None:
    """The human table on stdout; with as_json, one JSON object as the last line of stdout."""
    table = Table()
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    out = Console(highlight=False)
    out.print(title, style="bold", markup=False)
    out.print(table)
    if footer:
        out.print(footer)
    sys.stdout.flush()
    if as_json:
        print(json.dumps(figures), flush=True)


def add_stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="'embedded', an MLX folder or a Hugging Face id")
    p.add_argument("--port", type=int, default=0, help="port of the stack the bench starts (0: any free one)")
    p.add_argument("--stack-output", action="store_true", help="echo launch-stack's output to stderr")


def start_stack(args: argparse.Namespace, extra_args: tuple[str, ...] = ()) -> StackProcess:
    """Starts launch-stack for a bench (use as a context manager); check .exit_code after it."""
    progress(f"starting launch-stack --model {args.model} …")
    t0 = time.perf_counter()
    stack = StackProcess(model=args.model, port=args.port, extra_args=extra_args, echo=args.stack_output).start()
    progress(f"stack ready on {stack.url} in {time.perf_counter() - t0:.1f}s")
    return stack


def decode_tps(n_tokens: int, t_first: float, t_last: float) -> float:
    """Decode tokens/s: (N-1) tokens after the first, over the time from the first to the last."""
    span = t_last - t_first
    return (n_tokens - 1) / span if n_tokens > 1 and span > 0 else 0.0
