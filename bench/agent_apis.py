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

from bench.agent_script import TOOLS, Call, Item, Turn, arguments_dict
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

    def __init__(self, url: str, max_tokens: int, top_logprobs: int = 0):
        """`top_logprobs`: each token's log-probability and its best alternatives (chat only)."""
        self.url, self.max_tokens, self.top_logprobs = url.rstrip("/") + PATHS[self.api], max_tokens, top_logprobs
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as r:
            self.model = json.load(r)["data"][0]["id"]  # the name the stack serves

    def body(self, items: list[Item], tool_choice: str) -> dict:
        return {"messages": [self.message(i) for i in items], "max_tokens": self.max_tokens, "temperature": 0,
                "tools": [{"type": "function", "function": t} for t in TOOLS], "tool_choice": tool_choice,
                "parallel_tool_calls": False, "stream": True, "stream_options": {"include_usage": True},
                **({"logprobs": True, "top_logprobs": self.top_logprobs} if self.top_logprobs else {})}

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
        lps: list = []
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
                lps += (choice.get("logprobs") or {}).get("content") or []
            usage, metrics = chunk.get("usage") or usage, chunk.get("metrics") or metrics
        return Turn(usage.get("prompt_tokens", 0), (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    (first or time.perf_counter()) - t0, "".join(text), [calls[k] for k in sorted(calls)], finish,
                    metrics.get("ttft_s"), lps)


class MessagesClient(ChatClient):
    """Anthropic's Messages: calls as `tool_use` blocks, results as `tool_result` blocks of a user
    turn, usage's input tokens plus cache reads."""

    api = "messages"

    def body(self, items: list[Item], tool_choice: str) -> dict:
        choice = {"type": "any" if tool_choice == "required" else tool_choice, "disable_parallel_tool_use": True}
        return {"model": self.model, "system": items[0].text, "messages": self.turns(items[1:]),
                "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                          for t in TOOLS],
                "tool_choice": choice, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}

    @staticmethod
    def turns(items: list[Item]) -> list[dict]:
        out: list[dict] = []
        for i in items:
            if i.role == "assistant":
                blocks = ([{"type": "text", "text": i.text}] if i.text else []) + [
                    {"type": "tool_use", "id": c.id, "name": c.name, "input": arguments_dict(c.arguments)} for c in i.calls]
                out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
            elif i.role == "tool":
                block = {"type": "tool_result", "tool_use_id": i.call_id, "content": i.text}
                if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                    out[-1]["content"].append(block)
                else:
                    out.append({"role": "user", "content": [block]})
            else:
                out.append({"role": "user", "content": i.text})
        return out

    def turn(self, items: list[Item], tool_choice: str) -> Turn:
        t0, first, text, calls, use, metrics, finish = time.perf_counter(), None, [], [], {}, {}, ""
        for now, _, ev in sse(self.url, self.body(items, tool_choice)):
            kind = ev.get("type")
            if kind == "error":
                raise ServerError(str(ev.get("error")))
            if kind == "content_block_start" and ev["content_block"]["type"] == "tool_use":
                block = ev["content_block"]
                calls.append(Call(block["id"], block["name"], ""))
                first = first or now
            elif kind == "content_block_delta":
                d = ev["delta"]
                first = first or now
                if d["type"] == "text_delta":
                    text.append(d["text"])
                elif d["type"] == "input_json_delta":
                    calls[-1].arguments += d["partial_json"]
            elif kind == "message_delta":
                use, metrics, finish = ev.get("usage") or {}, ev.get("metrics") or {}, ev["delta"].get("stop_reason") or ""
        cached = use.get("cache_read_input_tokens", 0)
        return Turn(use.get("input_tokens", 0) + cached, cached, (first or time.perf_counter()) - t0, "".join(text),
                    calls, finish, metrics.get("ttft_s"))


class ResponsesClient(ChatClient):
    """OpenAI's Responses: `instructions`, calls as `function_call` items, results as
    `function_call_output` items, usage's input tokens and their cached part; nothing stored."""

    api = "responses"

    def body(self, items: list[Item], tool_choice: str) -> dict:
        return {"model": self.model, "instructions": items[0].text, "input": self.input(items[1:]),
                "tools": [{"type": "function", **t} for t in TOOLS], "tool_choice": tool_choice,
                "parallel_tool_calls": False, "max_output_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "store": False}

    @staticmethod
    def input(items: list[Item]) -> list[dict]:
        out: list[dict] = []
        for i in items:
            if i.role == "tool":
                out.append({"type": "function_call_output", "call_id": i.call_id, "output": i.text})
                continue
            if i.text or not i.calls:
                out.append({"role": i.role, "content": i.text})
            out += [{"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments} for c in i.calls]
        return out

    def turn(self, items: list[Item], tool_choice: str) -> Turn:
        t0, first, text, calls, done = time.perf_counter(), None, [], [], {}
        for now, _, ev in sse(self.url, self.body(items, tool_choice)):
            kind = ev.get("type", "")
            if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
                first = first or now
                text += [ev["delta"]] if kind == "response.output_text.delta" else []
            elif kind == "response.output_item.added" and ev["item"]["type"] == "function_call":
                first = first or now
            elif kind == "response.output_item.done" and ev["item"]["type"] == "function_call":
                calls.append(Call(ev["item"]["call_id"], ev["item"]["name"], ev["item"]["arguments"]))
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                done = ev["response"]
        if done.get("status") == "failed":
            raise ServerError(str(done.get("error")))
        use, metrics = done.get("usage") or {}, done.get("metrics") or {}
        return Turn(use.get("input_tokens", 0), (use.get("input_tokens_details") or {}).get("cached_tokens", 0),
                    (first or time.perf_counter()) - t0, "".join(text), calls, done.get("status", ""),
                    metrics.get("ttft_s"))


CLIENTS = {"chat": ChatClient, "messages": MessagesClient, "responses": ResponsesClient}


def served(url: str, api: str) -> bool:
    """Whether the stack at `url` serves the API (its route is in /openapi.json) and the bench speaks it."""
    if api not in CLIENTS:
        return False
    with urllib.request.urlopen(url.rstrip("/") + "/openapi.json", timeout=10) as r:
        return PATHS[api] in json.load(r).get("paths", {})
