"""`verity bench batch`: N concurrent streams through launch-stack's HTTP API against mlx-lm's
BatchGenerator in-process, on the same model, prompts and token counts, alternated in one run;
and joint (adaptive, with the model's draft) against verity's batched baseline at each N.

Per side and N: aggregate decode tokens/s (every stream's tokens after its first, over the span
from the first stream's first token to the last stream's last), time to first token and the gap
between a stream's tokens (p50, p95). Goals: HTTP ≥ 0.95 × BatchGenerator at every N; joint ≥
0.97 × baseline at every N. With --json the headline `ratio` is the smallest HTTP ÷ BatchGenerator.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field

from bench.common import add_stack_args, median, print_report, progress, start_stack
from cli.blas import reexec_with_blas
from cli.client import stream_chat

GOAL_HTTP = 1.0  # HTTP ÷ BatchGenerator at every N (#56)
GOAL_JOINT = {1: 1.2}  # joint ÷ baseline at N (#53); GOAL_JOINT_REST at every other N
GOAL_JOINT_REST = 0.97
TOPICS = ["the sea", "a robot who paints", "the history of bread", "a city at night", "learning to swim",
          "a lighthouse keeper", "mountains in winter", "an old library", "the first day of school",
          "a garden in spring", "a long train journey", "the moon landing", "a lost cat", "a jazz club",
          "the desert", "a small bakery"]


@dataclass
class Streams:
    """Token arrival times of N streams started together."""

    start: float
    times: list[list[float]] = field(default_factory=list)

    def figures(self) -> dict:
        firsts = [t[0] for t in self.times if t]
        lasts = [t[-1] for t in self.times if t]
        decoded = sum(len(t) - 1 for t in self.times if t)
        span = max(lasts) - min(firsts) if firsts else 0.0
        gaps = [b - a for t in self.times for a, b in zip(t, t[1:])]
        ttfts = [f - self.start for f in firsts]
        return {"tps": decoded / span if span > 0 else 0.0, "ttft_p50": _pct(ttfts, 50), "ttft_p95": _pct(ttfts, 95),
                "itl_p50": _pct(gaps, 50), "itl_p95": _pct(gaps, 95), "tokens": decoded + len(firsts)}


def _pct(xs: list[float], p: int) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


def run_inprocess(lm, n: int, tokens: int, prefill_step: int) -> Streams:
    """n streams through mlx-lm's BatchGenerator, greedy, every prompt submitted at once."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generation_stream

    from protocol.messages import GenerateRequest, Message
    from worker.text import render_prompt

    prompts = [render_prompt(lm.tokenizer, GenerateRequest(messages=[Message(**m) for m in messages(i)]))
               for i in range(n)]
    gen = BatchGenerator(lm.model, max_tokens=tokens, completion_batch_size=n, prefill_batch_size=n,
                         prefill_step_size=prefill_step)
    s = Streams(time.perf_counter(), [[] for _ in range(n)])
    uids = gen.insert(prompts)
    row = {u: i for i, u in enumerate(uids)}
    with mx.stream(generation_stream):
        while any(len(t) < tokens for t in s.times):
            _, generated = gen.next()
            now = time.perf_counter()
            for r in generated:
                s.times[row[r.uid]].append(now)
    gen.close()
    return s


def run_http(url: str, n: int, tokens: int, mode: str) -> Streams:
    """n streams through the stack's HTTP API at once (EOS ignored); token times as they arrive."""
    s = Streams(time.perf_counter(), [[] for _ in range(n)])
    errors: list[Exception] = []

    def one(i: int) -> None:
        body = {"messages": messages(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "mode": mode}
        try:
            stream_chat(url, body, on_text=lambda _: s.times[i].append(time.perf_counter()))
        except Exception as e:  # reported after the run
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return s


def run_long_prompt(url: str, n: int, tokens: int, long_tokens: int, mode: str = "baseline") -> dict:
    """n streams decode; once each has a few tokens, a prompt of about `long_tokens` tokens
    arrives (in `mode`). The gaps between the n streams' tokens while it is prefilled, and its
    first token."""
    s = Streams(time.perf_counter(), [[] for _ in range(n)])
    threads = [threading.Thread(target=lambda i=i: stream_chat(url, {
        "messages": messages(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
        on_text=lambda _: s.times[i].append(time.perf_counter()))) for i in range(n)]
    for t in threads:
        t.start()
    while min(len(t) for t in s.times) < 8:
        time.sleep(0.01)  # polls the streams' progress (the bench's own clock, not a test)
    words = " ".join(TOPICS) + " "
    nonce = f"{time.time_ns()}"  # a new prompt each run: no prefix of it is reused
    long = {"messages": [{"role": "user", "content": f"Note {nonce}. Summarise: " + words * (long_tokens // 60)}],
            "max_tokens": 4, "temperature": 0, "mode": mode}
    sent = time.perf_counter()
    r = stream_chat(url, long)
    first = r.t_first
    for t in threads:
        t.join()
    gaps = [b - a for t in s.times for a, b in zip(t, t[1:]) if b > sent and a < first]  # any part in the window
    return {"prompt_tokens": int(r.metrics.get("prompt_tokens", 0)), "ttft_s": first - sent,
            "itl_p50": _pct(gaps, 50), "itl_p95": _pct(gaps, 95), "itl_max": max(gaps, default=float("nan")),
            "gaps": len(gaps)}


def spec_counts(url: str) -> tuple[int, int]:
    """The stack's draft tokens proposed and accepted so far (its /metrics counters)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}
    return (int(values.get("verity:spec_decode_num_draft_tokens_total", 0)),
            int(values.get("verity:spec_decode_num_accepted_tokens_total", 0)))


def run_batch(args: argparse.Namespace) -> int:
    reexec_with_blas()  # the in-process side gets the same BLAS as launch-stack's worker
    if args.long_prompt:
        return _report_long_prompt(args)
    from worker.loader import load_model

    ns = [int(x) for x in args.ns.split(",")]
    lm = load_model(args.model)
    extra = ("--max-active", str(max(ns)), "--queue-size", str(max(ns)))
    extra += ("--decision-log", args.decision_log) if args.decision_log else ()
    sides = ["batchgenerator", "http"] + ([] if args.no_joint else ["joint"])
    runs: dict[tuple[str, int], list[dict]] = {(side, n): [] for side in sides for n in ns}
    with start_stack(args, extra + (() if args.no_joint else ("--draft", args.draft))) as stack:
        for n in ns:  # a warm-up of every shape
            run_inprocess(lm, n, 8, args.prefill_step)
            for mode in sides[1:]:
                run_http(stack.url, n, 8, "joint" if mode == "joint" else "baseline")
        for rep in range(args.repeats):
            for n in ns:
                order = sides if rep % 2 == 0 else sides[::-1]
                for side in order:
                    if side == "batchgenerator":
                        s = run_inprocess(lm, n, args.tokens, args.prefill_step)
                    else:
                        before = spec_counts(stack.url)
                        s = run_http(stack.url, n, args.tokens, "joint" if side == "joint" else "baseline")
                        spent = [b - a for a, b in zip(before, spec_counts(stack.url))]
                    figures = s.figures()
                    if side == "joint":
                        figures["drafted"], figures["accepted"] = spent
                    runs[(side, n)].append(figures)
                    shown = f"; drafted/accepted {spent[0]}/{spent[1]}" if side == "joint" else ""
                    progress(f"repeat {rep + 1}, N = {n}, {side}: {figures['tps']:.1f} tok/s{shown}")
    return _report(args, ns, sides, runs)


def _report(args: argparse.Namespace, ns: list[int], sides: list[str], runs: dict) -> int:
    rows, per_n = [], {}
    for n in ns:
        med = {side: {k: median(r[k] for r in runs[(side, n)]) for k in runs[(side, n)][0]} for side in sides}
        pairs = [h["tps"] / b["tps"] for h, b in zip(runs[("http", n)], runs[("batchgenerator", n)]) if b["tps"]]
        fig = {"sides": med, "http_vs_batchgenerator": med["http"]["tps"] / med["batchgenerator"]["tps"],
               "http_vs_batchgenerator_pairs": pairs}
        if "joint" in sides:
            fig["joint_vs_baseline"] = med["joint"]["tps"] / med["http"]["tps"]
            fig["joint_vs_baseline_pairs"] = [j["tps"] / h["tps"] for j, h in zip(runs[("joint", n)], runs[("http", n)])]
            fig["joint_drafted_accepted"] = [f"{j['drafted']}/{j['accepted']}" for j in runs[("joint", n)]]
        per_n[str(n)] = fig
        for side in sides:
            m = med[side]
            rows.append((f"N={n} {side}", f"{m['tps']:.1f}", f"{m['ttft_p50'] * 1000:.0f}", f"{m['ttft_p95'] * 1000:.0f}",
                         f"{m['itl_p50'] * 1000:.1f}", f"{m['itl_p95'] * 1000:.1f}",
                         " ".join(fig["joint_drafted_accepted"]) if side == "joint" else ""))
    ratio = min(f["http_vs_batchgenerator"] for f in per_n.values())
    joint = min((f["joint_vs_baseline"] for f in per_n.values() if "joint_vs_baseline" in f), default=None)
    missed = [f"joint N={n} {f['joint_vs_baseline']:.2f} < {GOAL_JOINT.get(int(n), GOAL_JOINT_REST)}"
              for n, f in per_n.items() if f.get("joint_vs_baseline", 9) < GOAL_JOINT.get(int(n), GOAL_JOINT_REST)]
    met = ratio >= GOAL_HTTP and not missed
    footer = (f"HTTP ÷ BatchGenerator, smallest over N: {ratio:.3f} (goal ≥ {GOAL_HTTP})"
              + (f"; joint ÷ baseline, smallest: {joint:.3f} (goals ≥ {GOAL_JOINT[1]} at N = 1, "
                 f"≥ {GOAL_JOINT_REST} elsewhere)" if joint is not None else "")
              + f"; goals {'met' if met else 'missed'}" + (f" ({', '.join(missed)})" if missed else ""))
    figures = {"bench": "batch", "model": args.model, "tokens": args.tokens, "repeats": args.repeats, "ns": ns,
               "per_n": per_n, "ratio": ratio, "joint_ratio": joint, "goals_met": met}
    print_report(f"bench batch: {args.model}, {args.tokens} tokens a stream, median of {args.repeats} alternated runs",
                 rows, ("side", "tok/s", "ttft p50 ms", "ttft p95 ms", "itl p50 ms", "itl p95 ms", "drafted/accepted"), figures, args.json,
                 footer)
    return 0


def _report_long_prompt(args: argparse.Namespace) -> int:
    runs = []
    for rep in range(args.repeats):
        if args.url:
            runs.append(run_long_prompt(args.url, 4, args.tokens, args.long_prompt, args.long_mode))
        else:
            draft = ("--draft", args.draft) if args.long_mode == "joint" else ()
            with start_stack(args, ("--max-active", "8", *draft)) as stack:
                runs.append(run_long_prompt(stack.url, 4, args.tokens, args.long_prompt, args.long_mode))
        progress(f"repeat {rep + 1}: gap p95 {runs[-1]['itl_p95'] * 1000:.0f} ms, first token {runs[-1]['ttft_s']:.2f} s")
    med = {k: median(r[k] for r in runs) for k in runs[0]}
    rows = [("4 streams while the prompt is prefilled", f"{med['itl_p50'] * 1000:.0f}", f"{med['itl_p95'] * 1000:.0f}",
             f"{med['itl_max'] * 1000:.0f}", f"{med['ttft_s']:.2f}")]
    print_report(f"bench batch --long-prompt: a {med['prompt_tokens']:.0f}-token prompt arrives, median of {args.repeats}",
                 rows, ("", "gap p50 ms", "gap p95 ms", "gap max ms", "its first token s"),
                 {"bench": "batch-long-prompt", "runs": runs, **med}, args.json)
    return 0


def add_command(benches) -> None:
    p = benches.add_parser("batch", help="N concurrent streams: HTTP vs in-process BatchGenerator, joint vs baseline")
    add_stack_args(p)
    p.add_argument("--draft", default="embedded", help="the stack's draft for the joint rows")
    p.add_argument("--ns", default="1,4,8,16", help="concurrent streams, comma-separated")
    p.add_argument("--tokens", type=int, default=64, help="tokens a stream (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of every side at every N")
    p.add_argument("--prefill-step", type=int, default=512, help="BatchGenerator's prefill chunk (the worker's)")
    p.add_argument("--no-joint", action="store_true", help="leave out the joint rows")
    p.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                   help="instead: 4 streams decode while a prompt of about TOKENS tokens arrives; their gaps")
    p.add_argument("--long-mode", choices=("baseline", "joint"), default="baseline",
                   help="with --long-prompt: the arriving prompt's mode (joint: the stack's draft)")
    p.add_argument("--url", default=None, help="with --long-prompt: a running stack's URL instead of starting one")
    p.add_argument("--decision-log", metavar="FILE", default=None,
                   help="the stack's scheduler decisions, as JSON lines (verity replay FILE)")
    p.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    p.set_defaults(run=run_batch)
