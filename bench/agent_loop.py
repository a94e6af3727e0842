"""`verity bench agent-loop`: prefix reuse in an agent's loop, over HTTP.

For each model (the embedded SmolLM2, pure attention; a tiny random Qwen3.5, hybrid, built for the
run) it starts two launch-stacks, one with reuse on and one with the cache off (`--cache-bytes 0`),
and for each API asked for plays the 12-request tool-using conversation of bench/agent_script.py
(each request resends everything: the system prompt, every answer with its tool calls, every tool
result, the new message), each request to both stacks in turn, the answer of the one with reuse
going into the next request. Per request it prints the prompt tokens, the tokens reused (usage's
cached tokens), the first token's time in both stacks and their ratio, the client's time to first
output, and whether the two answers are the same (greedy: they must be).

Goal, from the third request on: ≥ 90% of the prompt reused and the first token ≥ 5× sooner than
with the cache off.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from bench.agent_apis import APIS, CLIENTS, served
from bench.agent_script import STEPS, Item, Turn, answer_item, next_items, opening
from bench.cache import system_prompt
from bench.common import add_stack_args, median, print_report, progress, start_stack
from cli.client import ServerError, complete
from cli.stack_process import StackError

REUSE_GOAL, TTFT_GOAL, FROM_TURN = 0.90, 5.0, 3
QUICK = {"prefix_tokens": 600, "max_tokens": 24}


def tokens_per_char(url: str) -> float:
    """Prompt tokens per character of the system prompt's kind of text, on this model."""
    sample = system_prompt(0.25, 400, random.Random(1))

    def prompt_tokens(messages: list[dict]) -> int:
        return complete(url, {"messages": messages, "max_tokens": 1})["usage"]["prompt_tokens"]

    bare = prompt_tokens([{"role": "user", "content": "hi"}])
    return (prompt_tokens([{"role": "system", "content": sample}, {"role": "user", "content": "hi"}]) - bare) / len(sample)


Sent = list[tuple[list[Item], str]]  # each request: its conversation and its tool_choice


def loop(warm, cold, start: list[Item]) -> tuple[Sent, list[Turn], list[Turn]]:
    """The loop, a request at a time: to the stack with reuse on (its answer goes into the next
    request), then the very same request to the one with the cache off (the two alternate, so a
    shared machine's drift spreads over both)."""
    items, rng, sent, live, off = list(start), random.Random(7), [], [], []
    for step, (_, tool_choice) in enumerate(STEPS):
        items += next_items(step, live[-1] if live else None, rng)
        if live and not live[-1].calls and STEPS[step][0] == "tool":
            tool_choice = "required"  # the previous answer called nothing: ask again
        sent.append((list(items), tool_choice))
        live.append(warm.turn(items, tool_choice))
        off.append(cold.turn(items, tool_choice))
        items.append(answer_item(live[-1]))
        w, c = live[-1], off[-1]
        progress(f"  {warm.api} turn {step + 1:2d}: {w.prompt_tokens} prompt tokens, {w.cached_tokens} reused; first "
                 f"token {_first(w) * 1000:.0f} ms, cache off {_first(c) * 1000:.0f} ms ({len(w.calls)} calls, {w.finish})")
    return sent, live, off


def measure(args: argparse.Namespace, model: str, apis: list[str], settings: dict) -> dict:
    """Every API's loop on one model, reuse on against the cache off: {api: summary}."""
    results: dict = {}
    stack_args = argparse.Namespace(**{**vars(args), "model": model})
    with start_stack(stack_args) as stack, start_stack(stack_args, ("--cache-bytes", "0")) as cold_stack:
        tpc = tokens_per_char(stack.url)
        for i, api in enumerate(apis):
            if not served(stack.url, api):
                progress(f"  {api}: not served by this build")
                results[api] = {"served": False}
                continue
            clients = [CLIENTS[api](url, settings["max_tokens"]) for url in (stack.url, cold_stack.url)]
            _, live, cold = loop(*clients, opening(settings["prefix_tokens"], tpc, seed=i))
            results[api] = summary(live, cold)
    results["exit_codes"] = [stack.exit_code, cold_stack.exit_code]
    return results


def summary(live: list[Turn], cold: list[Turn]) -> dict:
    rows = []
    for i, (w, c) in enumerate(zip(live, cold)):
        rows.append({"turn": i + 1, "prompt": w.prompt_tokens, "reused": w.cached_tokens,
                     "reused_share": w.cached_tokens / w.prompt_tokens if w.prompt_tokens else 0.0,
                     "ttft_s": _first(w), "cold_ttft_s": _first(c), "ratio": _first(c) / _first(w) if _first(w) else 0.0,
                     "client_ttft_s": w.ttft_s, "cold_client_ttft_s": c.ttft_s,
                     "cold_reused": c.cached_tokens, "same_answer": (w.text, _calls(w)) == (c.text, _calls(c)),
                     "calls": len(w.calls)})
    later = rows[FROM_TURN - 1:]
    return {"served": True, "turns": rows, "min_reused_share": min(r["reused_share"] for r in later),
            "min_ratio": min(r["ratio"] for r in later), "median_ratio": median(r["ratio"] for r in later),
            "goal_met": all(r["reused_share"] >= REUSE_GOAL and r["ratio"] >= TTFT_GOAL for r in later),
            "same_answers": all(r["same_answer"] for r in rows)}


def _first(t: Turn) -> float:
    """Time to first token: the worker's (queued to first token) where the API carries verity's
    metrics, else the client's (sent to first output: a call's first piece waits for its name)."""
    return t.server_ttft_s if t.server_ttft_s is not None else t.ttft_s


def _calls(t: Turn) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in t.calls]


def report(results: dict, settings: dict, as_json: bool) -> None:
    rows, lines = [], []
    for label, per_api in results.items():
        for api, r in per_api.items():
            if api == "exit_codes":
                continue
            if not r["served"]:
                lines.append(f"{label} {api}: not served by this build")
                continue
            for t in r["turns"]:
                rows.append((f"{label} {api}", str(t["turn"]), str(t["prompt"]), f"{t['reused']} ({t['reused_share']:.0%})",
                             f"{t['ttft_s'] * 1000:.0f}", f"{t['cold_ttft_s'] * 1000:.0f}", f"{t['ratio']:.1f}×",
                             f"{t['client_ttft_s'] * 1000:.0f} / {t['cold_client_ttft_s'] * 1000:.0f}",
                             str(t["calls"]), "yes" if t["same_answer"] else "NO"))
            verdict = "goal met" if r["goal_met"] else "goal missed"
            lines.append(f"{label} {api}: from turn {FROM_TURN}: reused ≥ {r['min_reused_share']:.0%}, "
                         f"cold ÷ warm ≥ {r['min_ratio']:.1f}× (median {r['median_ratio']:.1f}×; "
                         f"{verdict}: ≥ {REUSE_GOAL:.0%} and ≥ {TTFT_GOAL:.0f}×); "
                         f"answers {'identical' if r['same_answers'] else 'DIFFER'} with the cache off")
    figures = {"bench": "agent-loop", **settings, "reuse_goal": REUSE_GOAL, "ttft_goal": TTFT_GOAL,
               "from_turn": FROM_TURN, "models": results}
    print_report(f"bench agent-loop: {len(STEPS)} requests of a tool-using agent, ~{settings['prefix_tokens']}-token "
                 "system prompt; first token (ms) with reuse (warm) and with the cache off (cold); client: "
                 "sent to first output, warm / cold", rows,
                 ("model api", "turn", "prompt", "reused", "warm", "cold", "cold÷warm", "client", "calls", "same"),
                 figures, as_json, "\n".join(lines))


def run_agent_loop(args: argparse.Namespace) -> int:
    settings = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK[k] if args.quick else default)
                for k, default in (("prefix_tokens", 1500), ("max_tokens", 64))}
    apis = list(APIS) if args.api == "all" else [args.api]
    hybrid = args.hybrid
    if hybrid is None and "hybrid" in args.models:
        from bench.tiny_models import build_tiny_model  # only to write the model's files

        hybrid = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="verity-bench-")) / "qwen3_5", "qwen3_5", seed=0,
                                          max_position_embeddings=32768))
    results = {}
    for label, model in [(k, v) for k, v in (("embedded", args.model), ("hybrid", hybrid)) if k in args.models]:
        progress(f"{label}: {model}")
        try:
            results[label] = measure(args, model, apis, settings)
        except (StackError, ServerError) as e:
            progress(f"{label}: {e}")
            return 1
    report(results, settings, args.json)
    return 0 if all(c == 0 for r in results.values() for c in r["exit_codes"]) else 1


def add_command(benches) -> None:
    p = benches.add_parser("agent-loop", help="prefix reuse in a 12-request tool-using agent loop, against the cache off")
    add_stack_args(p)
    p.add_argument("--api", choices=(*APIS, "all"), default="chat", help="the API the loop speaks (default chat)")
    p.add_argument("--models", nargs="+", choices=("embedded", "hybrid"), default=["embedded", "hybrid"],
                   help="which of the two models to run (default both; embedded: --model)")
    p.add_argument("--hybrid", default=None, help="the hybrid model (default: a tiny random Qwen3.5 built for the run)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="the system prompt, about (default 1500)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer at most (default 64)")
    p.add_argument("--quick", action="store_true", help=f"small settings for a test: {QUICK}")
    p.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    p.set_defaults(run=run_agent_loop)
