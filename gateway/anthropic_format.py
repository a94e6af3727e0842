"""Anthropic wire shapes: the Message object, the stream's events and the error object.

Generated text becomes content blocks: `thinking` (when the template thinks and the split is
given), `text`, and `tool_use` (calls parsed by gateway/tools.py, the format chat completions
parse). A stream opens a block when its first piece comes and closes it when another kind
begins: text as `text_delta`, a call's arguments as `input_json_delta` pieces that add up to its
input, thinking as `thinking_delta`.
"""

from __future__ import annotations

import json
from typing import Optional

from gateway.openai_format import log_dropped, metrics_dict
from gateway.reasoning import ReasoningSplit, split
from gateway.tools import ToolCallStream, split_whole_dropping
from protocol import messages as m

# HTTP status -> (status sent, Anthropic error type). 503 (the worker restarting, the server
# draining) goes out as Anthropic's 529 overloaded_error, which its clients retry with backoff.
ERROR_TYPES = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
               403: (403, "permission_error"), 404: (404, "not_found_error"), 405: (405, "invalid_request_error"),
               408: (408, "timeout_error"), 413: (413, "request_too_large"), 429: (429, "rate_limit_error"),
               503: (529, "overloaded_error"), 504: (504, "timeout_error")}
Event = tuple[str, dict]  # an SSE event's name and data


def error_object(status: int, message: str, request_id: Optional[str] = None, code: Optional[str] = None,
                 param: Optional[str] = None) -> tuple[int, dict]:
    """An error's HTTP status and body in Anthropic's shape; verity's `code` and `param` (the
    field at fault) ride along in the error object, where Anthropic's clients ignore them."""
    sent, kind = ERROR_TYPES.get(status, (status if status >= 500 else 400, "api_error"))
    body = {"type": "error", "error": {"type": kind, "message": message, "code": code, "param": param}}
    if request_id:
        body["request_id"] = request_id
    return sent, body


def stop_reason(finished: m.Finished, calls: bool) -> str:
    if finished.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if calls else "stop_sequence" if finished.stop_sequence is not None else "end_turn"


def usage(metrics: m.RequestMetrics) -> dict:
    """Prompt tokens reused from the cache count as cache reads, as Anthropic's do."""
    return {"input_tokens": metrics.prompt_tokens - metrics.reused_tokens, "output_tokens": metrics.completion_tokens,
            "cache_read_input_tokens": metrics.reused_tokens, "cache_creation_input_tokens": 0}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageShaper:
    """The response of one /v1/messages request: whole, or as stream events."""

    def __init__(self, request_id: str, model: str, tools: bool, thinks: bool = False):
        """`tools`: the request offered tools (calls in the text become tool_use blocks);
        `thinks`: the model's template thinks (its think block becomes a thinking block)."""
        self.id, self.model, self.tools, self.thinks = request_id, model, tools, thinks
        self.inside = False  # the generation starts inside a think block (the worker's Queued says)
        self.reasoning: Optional[ReasoningSplit] = None
        self.calls = ToolCallStream() if tools else None
        self.kind: Optional[str] = None  # the open block's type
        self.index = -1

    def _message(self, content: list, reason: Optional[str], use: dict, stop: Optional[str] = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": use}

    # ---- whole ----

    def whole(self, text: str, finished: m.Finished) -> dict:
        thinking, answer = self._split_whole(text)
        content: list[dict] = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
        calls = []
        if self.tools:
            answer, calls, dropped = split_whole_dropping(answer, finished.finish_reason == "length")
            log_dropped(self.id, 0, dropped, finished.finish_reason)
        if answer:
            content.append({"type": "text", "text": answer})
        content += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": _input(c.arguments)}
                    for c in calls]
        body = self._message(content, stop_reason(finished, bool(calls)), usage(finished.metrics), finished.stop_sequence)
        body["metrics"] = metrics_dict(finished.metrics)  # verity's extension: clients ignore it
        return body

    def queued(self, ev: m.Queued) -> None:
        self.inside = ev.thinking
        self.reasoning = ReasoningSplit(ev.thinking) if self.thinks else None

    def _split_whole(self, text: str) -> tuple[str, str]:
        if not self.thinks:
            return "", text
        parts = split(text, self.inside)
        return parts.reasoning, parts.content

    # ---- stream ----

    def start(self, prompt_tokens: int) -> list[Event]:
        use = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
               "cache_creation_input_tokens": 0}
        return [("message_start", {"type": "message_start", "message": self._message([], None, use)}),
                ("ping", {"type": "ping"})]

    def delta(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.reasoning is not None:
            parts = self.reasoning.feed(text)
            self._thinking(parts.reasoning, out)
            text = parts.content or ""
        self._answer(text, out, None)
        return out

    def finish(self, finished: m.Finished) -> list[Event]:
        out: list[Event] = []
        if self.reasoning is not None:
            parts = self.reasoning.finish()
            self._thinking(parts.reasoning, out)
            self._answer(parts.content or "", out, None)
        self._answer("", out, finished)
        out += self._close()
        calls = bool(self.calls and self.calls.calls)
        if self.calls is not None:
            log_dropped(self.id, 0, self.calls.dropped, finished.finish_reason)
        use = usage(finished.metrics)
        out.append(("message_delta", {"type": "message_delta", "usage": use,
                                      "delta": {"stop_reason": stop_reason(finished, calls),
                                                "stop_sequence": finished.stop_sequence},
                                      "metrics": metrics_dict(finished.metrics)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _open(self, kind: str, block: dict) -> list[Event]:
        out = self._close()
        self.kind, self.index = kind, self.index + 1
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[Event]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block_delta(self, delta: dict) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _thinking(self, text: Optional[str], out: list[Event]) -> None:
        if not text:
            return
        if self.kind != "thinking":
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        out.append(self._block_delta({"type": "thinking_delta", "thinking": text}))

    def _text(self, text: Optional[str], out: list[Event]) -> None:
        if not text:
            return
        if self.kind != "text":
            out += self._open("text", {"type": "text", "text": ""})
        out.append(self._block_delta({"type": "text_delta", "text": text}))

    def _answer(self, text: str, out: list[Event], finished: Optional[m.Finished]) -> None:
        """Text and tool calls out of the answer's text (`finished`: the last piece, flushed)."""
        if self.calls is None:
            self._text(text, out)
            return
        splits = [self.calls.feed(text)] if text else []
        if finished is not None:
            splits.append(self.calls.flush(finished.finish_reason == "length"))
        for s in splits:
            self._text(s.content, out)
            for piece in s.pieces:
                if piece.name is not None:
                    out += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name,
                                                   "input": {}})
                if piece.arguments:
                    out.append(self._block_delta({"type": "input_json_delta", "partial_json": piece.arguments}))


def sse(event: Event) -> bytes:
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
