"""`verity bench overhead`: HTTP streaming through launch-stack vs in-process mlx-lm, same model."""

from __future__ import annotations

import argparse
from typing import Callable

from bench.common import DEFAULT_PROMPT, add_stack_args, decode_tps, median, print_report, progress, start_stack
from cli.blas import reexec_with_blas
from cli.client import ServerError, stream_chat
from cli.stack_process import StackError

OVERHEAD_GOAL = 0.95


def _inprocess_runner(lm, prompt_ids: list[int]) -> Callable[[int], dict]:
    from bench.inprocess import stream_greedy

    def run(n: int) -> dict:
        ids, times, t0 = stream_greedy(lm, prompt_ids, n)
        return {"tokens": len(ids), "ttft_s": times[0] - t0, "tps": decode_tps(len(ids), times[0], times[-1]),
                "ids": ids}

    return run


def _http_runner(url: str, messages: list[dict]) -> Callable[[int], dict]:
    def run(n: int) -> dict:
        body = {"messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = stream_chat(url, body)
        n_tok = int(r.metrics.get("completion_tokens", 0))
        return {"tokens": n_tok, "ttft_s": r.t_first - r.t_sent, "tps": decode_tps(n_tok, r.t_first, r.t_last),
                "text": r.text, "server_tps": float(r.metrics.get("decode_tps", 0.0)),
                "server_ttft_s": float(r.metrics.get("ttft_s", 0.0))}

    return run


def run_overhead(args: argparse.Namespace) -> int:
    reexec_with_blas()  # the in-process side gets the same BLAS as launch-stack's worker
    from protocol.messages import GenerateRequest, Message
    from worker.loader import load_model
    from worker.text import render_prompt

    n, repeats = args.tokens, args.repeats
    if n < 2 or repeats < 1:
        progress("--tokens must be ≥ 2 and --repeats ≥ 1")
        return 2
    messages = [{"role": "user", "content": args.prompt}]
    progress(f"loading {args.model} in-process …")
    lm = load_model(args.model)
    prompt_ids = render_prompt(lm.tokenizer, GenerateRequest(messages=[Message(**m) for m in messages]))
    local = _inprocess_runner(lm, prompt_ids)
    try:
        stack = start_stack(args)
    except StackError as e:
        progress(f"could not start the stack: {e}")
        return 1
    runs: dict[str, list[dict]] = {"inproc": [], "http": []}
    try:
        with stack:
            remote = _http_runner(stack.url, messages)
            progress(f"warm-up: {n} tokens each way ({len(prompt_ids)} prompt tokens)")
            warm_local, warm_http = local(n), remote(n)
            for i in range(repeats):
                runs["inproc"].append(local(n))
                runs["http"].append(remote(n))
                a, b = runs["inproc"][-1], runs["http"][-1]
                progress(f"round {i + 1}/{repeats}: in-process {a['tps']:.1f} tok/s, HTTP {b['tps']:.1f} tok/s "
                         f"({b['tps'] / a['tps']:.3f})")
    except ServerError as e:
        progress(f"the stack refused the request: {e}")
        return 1
    clean_stop = stack.exit_code == 0
    if not clean_stop:
        progress(f"launch-stack exited with code {stack.exit_code}")

    med = {side: {k: median(r[k] for r in rs) for k in ("tps", "ttft_s")} for side, rs in runs.items()}
    ratio = med["http"]["tps"] / med["inproc"]["tps"] if med["inproc"]["tps"] else 0.0
    local_text = lm.tokenizer.decode(warm_local["ids"])
    figures = {
        "bench": "overhead", "model": args.model, "prompt_tokens": len(prompt_ids), "tokens": n,
        "repeats": repeats,
        "inproc_tps": med["inproc"]["tps"], "http_tps": med["http"]["tps"],
        "inproc_ttft_s": med["inproc"]["ttft_s"], "http_ttft_s": med["http"]["ttft_s"],
        "server_tps": median(r["server_tps"] for r in runs["http"]),
        "server_ttft_s": median(r["server_ttft_s"] for r in runs["http"]),
        "ratio": ratio, "goal": OVERHEAD_GOAL,
        "ratio_paired": median(b["tps"] / a["tps"] for a, b in zip(runs["inproc"], runs["http"]) if a["tps"]), "goal_met": ratio >= OVERHEAD_GOAL,
        "inproc_tokens": [r["tokens"] for r in runs["inproc"]], "http_tokens": [r["tokens"] for r in runs["http"]],
        "same_text": local_text.strip() == warm_http["text"].strip(),
        "inproc_tps_runs": [r["tps"] for r in runs["inproc"]], "http_tps_runs": [r["tps"] for r in runs["http"]],
        "stack_exit_code": stack.exit_code,
    }
    rows = [
        ("in-process mlx-lm", f"{figures['inproc_tps']:.1f}", f"{figures['inproc_ttft_s'] * 1000:.1f}"),
        ("HTTP via launch-stack", f"{figures['http_tps']:.1f}", f"{figures['http_ttft_s'] * 1000:.1f}"),
        ("  (worker's own metrics)", f"{figures['server_tps']:.1f}", f"{figures['server_ttft_s'] * 1000:.1f}"),
    ]
    verdict = "goal met" if figures["goal_met"] else "goal missed"
    footer = (f"ratio HTTP ÷ in-process decode tok/s: {ratio:.3f} ({verdict}: ≥ {OVERHEAD_GOAL}); "
              f"median of per-round ratios {figures['ratio_paired']:.3f}"
              + ("" if figures["same_text"] else " · note: the two sides' texts differ"))
    print_report(f"bench overhead: {args.model}, {len(prompt_ids)} prompt + {n} tokens, median of {repeats}",
                 rows, ("side", "decode tok/s", "ttft ms"), figures, args.json, footer)
    return 0 if clean_stop else 1


def add_command(benches) -> None:
    o = benches.add_parser("overhead", help="HTTP streaming through launch-stack vs in-process mlx-lm")
    add_stack_args(o)
    o.add_argument("--tokens", type=int, default=128, help="tokens generated per run (EOS ignored)")
    o.add_argument("--repeats", type=int, default=5, help="alternated rounds after one warm-up each")
    o.add_argument("--prompt", default=DEFAULT_PROMPT)
    o.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    o.set_defaults(run=run_overhead)
