"""`verity bench distributed`: the same model and prompts served by one worker process and by a
group of ranks (launch-stack --ranks N: ring over 127.0.0.1, tensor sharding), alternated in one
run: aggregate decode tokens/s and time to first token at each number of concurrent streams.

And what the group's collectives cost. Tensor sharding joins the ranks' halves with an all_sum
after each layer's attention and MLP: 2 × layers all_sums a forward, each of the batch's hidden
states. A probe of N ranks on the same ring times one such all_sum (and rank 0's per-step control
message, a 1 KiB buffer); the table gives bytes and time per forward. With --json the headline
`ratio` is the group's decode tokens/s ÷ the single process's at the first N.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.batch import run_http
from bench.common import median, print_report, progress
from cli.blas import reexec_with_blas
from cli.stack_process import StackProcess

PROBE_REPS = 20  # forwards' worth of all_sums
CONTROL_BYTES = 1024  # worker/distributed/link.py's HEAD_BYTES


def default_model(root: Path) -> Path:
    """A random-weight llama wide enough that a forward is not all overhead (~40M parameters)."""
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(root / "llama-768x8", "llama", seed=0, hidden=768, layers=8, heads=12, kv_heads=4)


def model_shape(path: Path) -> tuple[int, int]:
    import json

    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    return text["hidden_size"], text["num_hidden_layers"]


def probe(ranks: int, hidden: int, batch: int, chain: int) -> dict:
    """Times all_sums on a ring of `ranks` local processes: one forward's (a [batch, hidden]
    float32 array) and the control message's. Seconds per all_sum, as rank 0 measures them."""
    from cli.ranks import GroupPlan, Host, files_env, rank_env

    with tempfile.TemporaryDirectory() as tmp:
        plan = GroupPlan([Host("127.0.0.1", ["127.0.0.1"]) for _ in range(ranks)], "ring")
        argv = [sys.executable, "-m", "bench.distributed_probe", str(hidden), str(batch), str(PROBE_REPS), str(CONTROL_BYTES),
                str(chain)]
        procs = [subprocess.Popen(argv, env={**os.environ, **files_env(env, tmp, i)}, stdout=subprocess.PIPE, text=True)
                 for i, env in enumerate(rank_env(plan, tmp))]
        out = [p.communicate(timeout=300)[0] for p in procs]
    forward_s, control_s = (float(x) for x in out[0].split())
    return {"allsum_s": forward_s, "control_s": control_s}


def run_side(url: str, n: int, tokens: int) -> dict:
    return run_http(url, n, tokens, "baseline").figures()


def run_distributed(args: argparse.Namespace) -> int:
    reexec_with_blas()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else default_model(Path(tmp))
        if not (model / "config.json").is_file():
            progress(f"--model {args.model}: not an MLX model folder (the bench reads its config.json)")
            return 2
        hidden, layers = model_shape(model)
        ns = [int(x) for x in args.ns.split(",")]
        sides = {"1 process": (), f"{args.ranks} ranks": ("--ranks", str(args.ranks))}
        stacks = {}
        try:
            for name, extra in sides.items():
                progress(f"starting launch-stack ({name}) on {model.name} …")
                stacks[name] = StackProcess(str(model), 0, extra_args=("--cache-bytes", "0", *extra),
                                            echo=args.stack_output).start()
            runs = _alternate(stacks, ns, args)
        finally:
            for s in stacks.values():
                s.stop()
        probes = {n: probe(args.ranks, hidden, n, 2 * layers) for n in ns}
    return _report(args, model.name, hidden, layers, ns, list(sides), runs, probes)


def _alternate(stacks: dict, ns: list[int], args: argparse.Namespace) -> dict:
    """{(side, n): [figures of each repeat]}, the sides' order swapped every repeat."""
    runs: dict = {}
    names = list(stacks)
    for n in ns:
        run_side(stacks[names[0]].url, n, 4)  # a first run of each shape, not measured
        run_side(stacks[names[1]].url, n, 4)
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                runs.setdefault((name, n), []).append(run_side(stacks[name].url, n, args.tokens))
                progress(f"{name}, {n} streams, repeat {r + 1}: {runs[(name, n)][-1]['tps']:.1f} tok/s "
                         f"({time.perf_counter() - t0:.1f}s)")
    return runs


def _report(args, model: str, hidden: int, layers: int, ns: list[int], sides: list[str], runs: dict,
            probes: dict) -> int:
    rows, figures = [], {"bench": "distributed", "model": model, "ranks": args.ranks, "rows": []}
    for n in ns:
        for side in sides:
            med = {k: median(f[k] for f in runs[(side, n)]) for k in ("tps", "ttft_p50", "ttft_p95")}
            rows.append((side, str(n), f"{med['tps']:.1f}", f"{med['ttft_p50'] * 1e3:.0f}", f"{med['ttft_p95'] * 1e3:.0f}"))
            figures["rows"].append({"side": side, "n": n, **med})
    base = {r["n"]: r["tps"] for r in figures["rows"] if r["side"] == sides[0]}
    group = {r["n"]: r["tps"] for r in figures["rows"] if r["side"] == sides[1]}
    figures["ratio"] = group[ns[0]] / base[ns[0]] if base[ns[0]] else float("nan")
    per_forward = 2 * layers  # an all_sum after each layer's attention and MLP
    lines = []
    for n in ns:
        p = probes[n]
        cost = per_forward * p["allsum_s"] + p["control_s"]
        step = n / group[n] if group[n] else float("nan")  # seconds a round of n tokens takes in the group
        figures.setdefault("collectives", []).append(
            {"n": n, "allsums_per_forward": per_forward, "bytes_per_forward": per_forward * n * hidden * 4,
             "allsum_s": p["allsum_s"], "control_s": p["control_s"], "seconds_per_round": cost, "round_s": step})
        lines.append(f"N={n}: {per_forward} all_sums of {n * hidden * 4:,} bytes a forward "
                     f"({per_forward * n * hidden * 4 / n:,.0f} bytes a token), {p['allsum_s'] * 1e6:.0f} µs each, "
                     f"control message {p['control_s'] * 1e6:.0f} µs: {cost * 1e3:.2f} ms of a {step * 1e3:.1f} ms round")
    print_report(f"bench distributed: {model}, 1 process vs {args.ranks} ranks (ring on 127.0.0.1), "
                 f"{args.tokens} tokens a stream, median of {args.repeats}",
                 rows, ("side", "streams", "tok/s", "ttft p50 ms", "ttft p95 ms"), figures, args.json,
                 footer="collectives per round (probe on the same ring):\n" + "\n".join(lines))
    return 0


def add_command(benches) -> None:
    p = benches.add_parser("distributed", help="one worker process vs a group of ranks: tokens/s, TTFT, collectives")
    p.add_argument("--model", default=None, help="an MLX folder whose dims divide by --ranks (default: a random ~40M llama)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ns", default="1,4", help="concurrent streams, comma-separated")
    p.add_argument("--tokens", type=int, default=48, help="tokens a stream (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each side at each N")
    p.add_argument("--stack-output", action="store_true", help="echo launch-stack's output to stderr")
    p.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    p.set_defaults(run=run_distributed)
