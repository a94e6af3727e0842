"""Tool calls out of a chat's generated text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks (the format worker/tools.py renders and constrains) become OpenAI `tool_calls`; the text
around them stays the message's content. Streamed text is split as it comes: content flows on,
holding back only what may begin a call, and each call is sent whole once its block closes."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional

from protocol.messages import TOOL_CALL_END, TOOL_CALL_START


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_dict(self, streamed: bool = False) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **out} if streamed else out


@dataclass
class Split:
    """What a piece of text gave: content to pass on (None: nothing yet) and finished calls."""

    content: Optional[str]
    calls: list[ParsedCall]


def parse_call(block: str, index: int) -> Optional[ParsedCall]:
    """One block's JSON, or None when it is not a call (it then stays content)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json_or_text(args)
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedCall(index, "call_" + uuid.uuid4().hex[:24], obj["name"], arguments)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class ToolCallStream:
    """Splits streamed text into content and tool calls."""

    def __init__(self):
        self.buffer = ""  # text not passed on yet: a possible start marker, or an open block
        self.held_space = ""  # whitespace-only content, sent only when more content follows
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> Split:
        self.buffer += text
        content, found = "", []
        while True:
            start = self.buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_marker(self.buffer)
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            end = self.buffer.find(TOOL_CALL_END, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                break
            content += self.buffer[:start]
            block = self.buffer[start + len(TOOL_CALL_START) : end]
            self.buffer = self.buffer[end + len(TOOL_CALL_END) :]
            call = parse_call(block, len(self.calls))
            if call is None:
                content += TOOL_CALL_START + block + TOOL_CALL_END
            else:
                self.calls.append(call)
                found.append(call)
        return Split(self._content(content), found)

    def flush(self) -> Split:
        """At the end: an unclosed block is parsed if it can be, else it is content."""
        rest, self.buffer = self.buffer, ""
        found = []
        if rest.startswith(TOOL_CALL_START):
            call = parse_call(rest[len(TOOL_CALL_START) :], len(self.calls))
            if call is not None:
                self.calls.append(call)
                found, rest = [call], ""
        content = self._content(rest)
        if not self.calls and self.held_space:
            content, self.held_space = (content or "") + self.held_space, ""
        return Split(content, found)

    def _content(self, text: str) -> Optional[str]:
        if not text:
            return None
        if not text.strip():
            self.held_space += text
            return None
        out, self.held_space = self.held_space + text, ""
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the start marker."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:n]):
            return n
    return 0


def split_whole(text: str) -> tuple[Optional[str], list[ParsedCall]]:
    """A whole response's content (None when it is only calls) and its calls."""
    s = ToolCallStream()
    a, b = s.feed(text), s.flush()
    content = (a.content or "") + (b.content or "")
    if s.calls:
        content = content.strip() or None
    return content, s.calls
