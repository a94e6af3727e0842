"""The APIs `verity bench agent-loop` speaks: each renders the neutral conversation
(bench/agent_script.py) as its request, streams it, and reads back a `Turn`: the answer's text and
calls, the prompt and cached token counts of its usage, and the time to its first generated output.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional

from bench.agent_script import TOOLS, Call, Item, Turn
from cli.client import TIMEOUT_S, ServerError

APIS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def sse(url: str, body: dict) -> Iterator[tuple[float, Optional[str], dict]]:
    """(arrival time, event name, data) of each event of a streamed POST; raises ServerError."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    try:
        resp = urllib.request.urlopen(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise ServerError(f"HTTP {e.code} from {url}: {e.read()[:300].decode(errors='replace')}", status=e.code) from None
    name = None
    with resp:
        for raw in resp:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    return
                yield time.perf_counter(), name, json.loads(data)
            elif not line:
                name = None


class ChatClient:
    """Chat completions: calls as `tool_calls`, results as `tool` messages, usage's cached_tokens."""

    api = "chat"

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url.rstrip("/") + PATHS[self.api], max_tokens

    def body(self, items: list[Item], tool_choice: str) -> dict:
        return {"messages": [self.message(i) for i in items], "max_tokens": self.max_tokens, "temperature": 0,
                "tools": [{"type": "function", "function": t} for t in TOOLS], "tool_choice": tool_choice,
                "parallel_tool_calls": False, "stream": True, "stream_options": {"include_usage": True}}

    @staticmethod
    def message(i: Item) -> dict:
        if i.role == "tool":
            return {"role": "tool", "tool_call_id": i.call_id, "content": i.text}
        out: dict = {"role": i.role, "content": i.text or None if i.calls else i.text}
        if i.calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in i.calls]
        return out

    def turn(self, items: list[Item], tool_choice: str) -> Turn:
        t0, first, text, calls, usage, metrics, finish = time.perf_counter(), None, [], {}, {}, {}, ""
        for now, _, chunk in sse(self.url, self.body(items, tool_choice)):
            if "error" in chunk:
                raise ServerError.from_body(chunk)
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta", {})
                if first is None and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
                    first = now
                text.append(delta.get("content") or "")
                for piece in delta.get("tool_calls") or ():
                    c = calls.setdefault(piece["index"], Call("", "", ""))
                    c.id = piece.get("id") or c.id
                    fn = piece.get("function") or {}
                    c.name += fn.get("name") or ""
                    c.arguments += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
            usage, metrics = chunk.get("usage") or usage, chunk.get("metrics") or metrics
        return Turn(usage.get("prompt_tokens", 0), (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    (first or time.perf_counter()) - t0, "".join(text), [calls[k] for k in sorted(calls)], finish,
                    metrics.get("ttft_s"))


CLIENTS = {"chat": ChatClient}


def served(url: str, api: str) -> bool:
    """Whether the stack at `url` serves the API (its route is in /openapi.json) and the bench speaks it."""
    if api not in CLIENTS:
        return False
    with urllib.request.urlopen(url.rstrip("/") + "/openapi.json", timeout=10) as r:
        return PATHS[api] in json.load(r).get("paths", {})
