"""The agent loop `verity bench agent-loop` replays: a system prompt, three function tools, and 12
requests of a coding agent (a user message or the tool results of the previous answer's calls, then
the model's answer: tool calls where the step asks for them, else text). Every request resends the
whole conversation so far, the model's own answers included, as an agent does.

The conversation is kept in one neutral form (`Item`s); each API's client (bench/agent_apis.py)
renders it as that API's request.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Optional

from bench.cache import system_prompt

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": [
         "src/parser.py", "src/lexer.py", "tests/test_parser.py", "README.md"]}},
         "required": ["path"], "additionalProperties": False}},
    {"name": "run_tests", "description": "Run a test file and return its output.",
     "parameters": {"type": "object", "properties": {"target": {"type": "string", "enum": [
         "tests/test_parser.py", "tests/test_lexer.py", "all"]}},
         "required": ["target"], "additionalProperties": False}},
    {"name": "grep", "description": "Search the repository for a word.",
     "parameters": {"type": "object", "properties": {"word": {"type": "string", "enum": [
         "parse", "token", "error", "number"]}},
         "required": ["word"], "additionalProperties": False}},
]
# (what the step adds, tool_choice): "user" adds the next user message, "tool" the results of the
# previous answer's calls; "required": the answer is a call, "auto": the model's choice (text here)
STEPS = [("user", "required"), ("tool", "required"), ("tool", "auto")] * 4
USER = ["The parser test fails on negative numbers. Find out why.",
        "Good. Now check the lexer handles exponents too.",
        "Run every test and tell me what still fails.",
        "Summarize the changes you would make, file by file."]
CODE_WORDS = "token number parse error value index stream buffer state symbol lexer reader".split()


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class Item:
    """One message of the conversation: system, user, assistant (text and/or calls) or tool."""

    role: str
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    call_id: Optional[str] = None  # a tool result's call
    name: Optional[str] = None  # a tool result's function


@dataclass
class Turn:
    """One request's figures and its answer."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # the client's: request sent to its first generated output (text, thinking or a call)
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    finish: str = ""
    server_ttft_s: Optional[float] = None  # the worker's, where the API carries verity's metrics
    logprobs: list = field(default_factory=list)  # chat's per-token entries, when asked for (tests: near ties)


def tool_result(call: Call, rng: random.Random) -> str:
    """A tool's output: a few lines of code or log text, fixed by the call and `rng`."""
    lines = [f"$ {call.name} {call.arguments}"]
    for i in range(rng.randint(2, 4)):
        words = " ".join(rng.choice(CODE_WORDS) for _ in range(rng.randint(3, 6)))
        lines.append(f"{i + 1:3d}  def {rng.choice(CODE_WORDS)}_{i}(self): return {words}")
    return "\n".join(lines)


def opening(prefix_tokens: int, tokens_per_char: float, seed: int = 0) -> list[Item]:
    """The conversation's start: a fresh system prompt of about `prefix_tokens` (nothing cached)."""
    rules = system_prompt(tokens_per_char, prefix_tokens, random.Random(seed))
    return [Item("system", "You are a coding agent working in a Python repository. Use the tools.\n" + rules)]


def next_items(step: int, answer: Optional[Turn], rng: random.Random) -> list[Item]:
    """What step `step` adds after the previous answer: a user message, or its calls' results."""
    kind, _ = STEPS[step]
    if kind == "user" or answer is None or not answer.calls:
        return [Item("user", USER[(step // 3) % len(USER)] if kind == "user" else "Go on.")]
    return [Item("tool", tool_result(c, rng), call_id=c.id, name=c.name) for c in answer.calls]


def answer_item(t: Turn) -> Item:
    return Item("assistant", t.text, list(t.calls))


def arguments_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
