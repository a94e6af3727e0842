"""`verity bench cache`: time to first token with and without prefix reuse, over HTTP, and how often
each kind of snapshot is hit in a real multi-turn conversation.

For each model (the embedded SmolLM2, pure attention; a tiny random Qwen3.5, hybrid) it starts a
launch-stack and measures, per round (a fresh ~N-token system prompt, so the first request is cold):

- cold:    [system, question]                               nothing of it cached
- warm:    [system, question, answer, next question]         the next turn
- changed: [system, other question]                          the last message changed

then one conversation of several turns, classifying what each turn reused: the previous turn's
end-of-generation snapshot (the reply's tokens are what the template renders for it again), only a
message boundary, or nothing. Time to first token is the client's: request sent to first text.
The headline `ratio` is cold ÷ warm time to first token on the embedded model (median over rounds).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import uuid
from pathlib import Path

from bench.common import add_stack_args, median, print_report, progress, start_stack
from cli.client import ServerError, stream_chat
from cli.stack_process import StackError

GOAL = 5.0
QUESTIONS = ["What is the capital of France?", "And what is the capital of Germany?",
             "Tell me one fun fact about Paris.", "Summarize our conversation in one sentence.",
             "Thanks! What is two plus two?", "Name three colors."]
QUICK = {"prefix_tokens": 150, "turns": 3, "repeats": 1, "max_tokens": 8}
WORDS = ("river stone lamp garden violet copper window harbor pepper meadow signal lantern orbit "
         "canyon pillow thunder marble saddle falcon ribbon glacier pencil velvet anchor").split()


def system_prompt(tokens_per_char: float, n_tokens: int, rng: random.Random) -> str:
    """A unique system prompt of about n_tokens (its first words make every round's cold)."""
    lines, chars = [f"Session {uuid.uuid4().hex}. Follow these house rules."], 0
    while chars * tokens_per_char < n_tokens:
        line = f"Rule {len(lines)}: keep the {rng.choice(WORDS)} near the {rng.choice(WORDS)} and the {rng.choice(WORDS)}."
        lines.append(line)
        chars += len(line) + 1
    return "\n".join(lines)


class Client:
    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens

    def ask(self, messages: list[dict]) -> dict:
        r = stream_chat(self.url, {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0})
        mx = r.metrics
        return {"ttft_s": r.t_first - r.t_sent, "text": r.text, "prompt": mx["prompt_tokens"],
                "completion": mx["completion_tokens"], "reused": mx["reused_tokens"]}


def measure(url: str, prefix_tokens: int, turns: int, repeats: int, max_tokens: int) -> dict:
    c, rng = Client(url, max_tokens), random.Random(0)
    sample = system_prompt(1.0, 400, random.Random(1))  # ~400 characters of the same kind of text
    bare = c.ask([{"role": "user", "content": "hi"}])["prompt"]
    tokens_per_char = (c.ask([{"role": "system", "content": sample}, {"role": "user", "content": "hi"}])["prompt"]
                       - bare) / len(sample)
    rounds = []
    for i in range(repeats):
        system = {"role": "system", "content": system_prompt(tokens_per_char, prefix_tokens, rng)}
        first = [system, {"role": "user", "content": QUESTIONS[0]}]
        cold = c.ask(first)
        warm = c.ask(first + [{"role": "assistant", "content": cold["text"]}, {"role": "user", "content": QUESTIONS[1]}])
        changed = c.ask([system, {"role": "user", "content": QUESTIONS[2]}])
        rounds.append({"cold": cold, "warm": warm, "changed": changed})
        progress(f"  round {i + 1}/{repeats}: cold {cold['ttft_s'] * 1000:.0f} ms ({cold['prompt']} prompt tokens), "
                 f"warm {warm['ttft_s'] * 1000:.0f} ms ({warm['reused']} reused), "
                 f"changed {changed['ttft_s'] * 1000:.0f} ms ({changed['reused']} reused)")
    out = {"prompt_tokens": median(r["cold"]["prompt"] for r in rounds)}
    for kind in ("cold", "warm", "changed"):
        out[f"{kind}_ttft_s"] = median(r[kind]["ttft_s"] for r in rounds)
        out[f"{kind}_reused"] = median(r[kind]["reused"] for r in rounds)
    out["ratio"] = out["cold_ttft_s"] / out["warm_ttft_s"]
    out["changed_ratio"] = out["cold_ttft_s"] / out["changed_ttft_s"]
    out["conversation"] = conversation(c, turns)
    return out


def conversation(c: Client, turns: int) -> dict:
    """One conversation; each turn after the first is classified by what it reused."""
    messages, log = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. You are a concise assistant."}], []
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        r = c.ask(messages)
        messages.append({"role": "assistant", "content": r["text"]})
        if log:
            prev = log[-1]
            r["hit"] = ("generation" if r["reused"] > prev["prompt"] else "boundary" if r["reused"] else "miss")
            r["whole_reply"] = r["reused"] >= prev["prompt"] + prev["completion"] - 1
        log.append(r)
    later = log[1:]
    counts = {k: sum(r["hit"] == k for r in later) for k in ("generation", "boundary", "miss")}
    return {"turns": [{k: r.get(k) for k in ("prompt", "completion", "reused", "hit", "whole_reply", "ttft_s")}
                      for r in log],
            **{f"{k}_hit_rate": n / len(later) if later else 0.0 for k, n in counts.items()},
            "whole_reply_rate": sum(r["whole_reply"] for r in later) / len(later) if later else 0.0}


def run_cache(args: argparse.Namespace) -> int:
    settings = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK[k] if args.quick else default)
                for k, default in (("prefix_tokens", 1000), ("turns", 5), ("repeats", 3), ("max_tokens", 48))}
    hybrid = args.hybrid
    if hybrid is None:
        from bench.tiny_models import build_tiny_model  # only to write the model's files

        hybrid = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="verity-bench-")) / "qwen3_5", "qwen3_5", seed=0))
    results, exit_codes = {}, {}
    for label, model in (("embedded", args.model), ("hybrid", hybrid)):
        progress(f"{label}: {model}")
        try:
            with start_stack(argparse.Namespace(**{**vars(args), "model": model})) as stack:
                results[label] = measure(stack.url, **settings)
        except (StackError, ServerError) as e:
            progress(f"{label}: {e}")
            return 1
        exit_codes[label] = stack.exit_code
    figures = {"bench": "cache", **settings, "goal": GOAL, "ratio": results["embedded"]["ratio"],
               "goal_met": results["embedded"]["ratio"] >= GOAL, "models": results, "stack_exit_codes": exit_codes}
    rows = []
    for label, r in results.items():
        conv = r["conversation"]
        rows.append((label, f"{r['cold_ttft_s'] * 1000:.0f}", f"{r['warm_ttft_s'] * 1000:.0f}",
                     f"{r['changed_ttft_s'] * 1000:.0f}", f"{r['ratio']:.1f}×",
                     f"{conv['generation_hit_rate']:.0%} ({conv['whole_reply_rate']:.0%})", f"{conv['boundary_hit_rate']:.0%}"))
    verdict = "goal met" if figures["goal_met"] else "goal missed"
    footer = "\n".join([
        f"ratio cold ÷ warm, embedded: {figures['ratio']:.1f}× ({verdict}: ≥ {GOAL:.0f}×); cold ÷ changed: "
        + ", ".join(f"{k} {r['changed_ratio']:.1f}×" for k, r in results.items()),
        "prompt tokens: " + ", ".join(f"{k} {r['prompt_tokens']:.0f}" for k, r in results.items()),
        f"hits over turns 2..{settings['turns']} of one conversation: gen = the previous turn's end-of-generation "
        "snapshot (in brackets: the whole reply reused), bnd = only a message boundary"])
    print_report(f"bench cache: time to first token (ms), ~{settings['prefix_tokens']}-token shared prefix, "
                 f"median of {settings['repeats']}", rows,
                 ("model", "cold", "warm", "changed", "cold÷warm", "gen hits", "bnd hits"), figures, args.json, footer)
    return 0 if all(code == 0 for code in exit_codes.values()) else 1


def add_command(benches) -> None:
    p = benches.add_parser("cache", help="time to first token cold and warm (prefix reuse), and snapshot hit rates")
    add_stack_args(p)
    p.add_argument("--hybrid", default=None, help="the hybrid model (default: a tiny random Qwen3.5 built for the run)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="shared system prompt, about (default 1000)")
    p.add_argument("--turns", type=int, default=None, help="turns of the multi-turn conversation (default 5)")
    p.add_argument("--repeats", type=int, default=None, help="cold/warm rounds, each with a fresh prefix (default 3)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 48)")
    p.add_argument("--quick", action="store_true", help=f"small settings for a test: {QUICK}")
    p.add_argument("--json", action="store_true", help="also print all figures as one JSON line (last on stdout)")
    p.set_defaults(run=run_cache)
