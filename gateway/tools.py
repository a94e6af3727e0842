"""Tool calls out of a chat's generated text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks (the format worker/tools.py renders and constrains) become OpenAI `tool_calls`; the text
around them stays the message's content, and no block's markup is ever content.

Streamed text is split as it comes: content flows on, holding back only what may begin a block. A
block that opens `{"name": "...", "arguments": {` (the grammar's form) is streamed as OpenAI does:
its id and name once the name is read, then its arguments' text in pieces as it arrives. Any
other block is sent whole when it closes. A block that never closes (max_tokens cut it) or whose
JSON does not parse is dropped and reported (`Split.dropped`) for the log; pieces of it already
streamed stand, and the choice's finish_reason ("length") says it was cut.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from protocol.messages import TOOL_CALL_END, TOOL_CALL_START

# the opening of a streamable block, up to its arguments object's first brace
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


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
class CallPiece:
    """One streamed `delta.tool_calls` entry: a call's id and name first (with `arguments` ""),
    then pieces of its arguments' text."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None

    def as_dict(self) -> dict:
        function = {"arguments": self.arguments} if self.name is None else {"name": self.name, "arguments": self.arguments}
        head = {} if self.id is None else {"id": self.id, "type": "function"}
        return {"index": self.index, **head, "function": function}


@dataclass
class Dropped:
    """A block that is not a call: cut before its end marker, or not parseable."""

    name: Optional[str]  # the function it named, when that much was written
    closed: bool  # its end marker came (its JSON was the trouble)


@dataclass
class Split:
    """What a piece of text gave: content to pass on (None: nothing yet), the calls it completed,
    the streamed pieces of calls, and the blocks dropped."""

    content: Optional[str]
    calls: list[ParsedCall]
    pieces: list[CallPiece] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(block: str, index: int, call_id: Optional[str] = None) -> Optional[ParsedCall]:
    """One block's JSON, or None when it is not a call."""
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
    return ParsedCall(index, call_id or new_call_id(), obj["name"], arguments)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class OpenBlock:
    """A block being written: once its head is read, its arguments object is scanned as it comes
    (strings, escapes, brace depth), so each feed can pass on the arguments' text written so far."""

    def __init__(self, index: int):
        self.index, self.id = index, new_call_id()
        self.name: Optional[str] = None
        self.start = 0  # where the arguments object begins in the block's text
        self.scanned = 0  # characters of it scanned (and streamed)
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def advance(self, block: str) -> list[CallPiece]:
        """The pieces the block's text so far adds."""
        out = []
        if self.name is None:
            head = _HEAD.match(block)
            if head is None:
                return out
            name = _json_or_text(f'"{head.group(1)}"')
            if not isinstance(name, str):
                return out
            self.name, self.start = name, head.end()
            out.append(CallPiece(self.index, "", self.id, self.name))
        text = block[self.start :]
        begin = self.scanned
        while self.scanned < len(text) and not self.done:
            self._scan(text[self.scanned])
            self.scanned += 1
        if self.scanned > begin:
            out.append(CallPiece(self.index, text[begin : self.scanned]))
        return out

    def _scan(self, ch: str) -> None:
        if self.in_string:
            self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0

    def close(self, block: str) -> Optional[ParsedCall]:
        """The call the whole block (advanced to its end) makes; None: not one. A streamed block's
        arguments are the text streamed, so its pieces add up to the call."""
        if self.name is None:
            return parse_call(block, self.index, self.id)
        arguments = block[self.start : self.start + self.scanned]
        if not self.done or not isinstance(_json_or_text(arguments), dict):
            return None
        return ParsedCall(self.index, self.id, self.name, arguments)


class ToolCallStream:
    """Splits streamed text into content and tool calls."""

    def __init__(self):
        self.buffer = ""  # text not passed on yet: a possible start marker, or an open block
        self.held_space = ""  # whitespace-only content, sent only when more content follows
        self.calls: list[ParsedCall] = []
        self.open: Optional[OpenBlock] = None
        self.dropped: list[Dropped] = []

    def feed(self, text: str) -> Split:
        self.buffer += text
        out = Split(None, [])
        content = ""
        while True:
            start = self.buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = partial_marker(self.buffer)
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            block_at = len(TOOL_CALL_START)
            end = self.buffer.find(TOOL_CALL_END, block_at)
            self.open = self.open or OpenBlock(len(self.calls))
            if end < 0:
                out.pieces += self.open.advance(self.buffer[block_at:])
                break
            self._close(self.buffer[block_at:end], True, out)
            self.buffer = self.buffer[end + len(TOOL_CALL_END) :]
        out.content = self._content(content)
        return out

    def flush(self, cut: bool = False) -> Split:
        """At the end: an unclosed block is a call if its JSON is whole, else it is dropped. `cut`:
        max_tokens ended the text, so a start marker it cut short is dropped too."""
        out = Split(None, [])
        rest, self.buffer = self.buffer, ""
        if rest.startswith(TOOL_CALL_START):
            self.open = self.open or OpenBlock(len(self.calls))
            self._close(rest[len(TOOL_CALL_START) :], False, out)
            rest = ""
        elif cut and rest:  # only a proper prefix of the marker is ever held back here
            out.dropped.append(Dropped(None, False))
            self.dropped.append(out.dropped[-1])
            rest = ""
        out.content = self._content(rest)
        if not self.calls and self.held_space:
            out.content, self.held_space = (out.content or "") + self.held_space, ""
        return out

    def _close(self, block: str, closed: bool, out: Split) -> None:
        pieces = self.open.advance(block)
        call = self.open.close(block)
        if call is None:
            name = self.open.name or (_json_or_text(f'"{n.group(1)}"') if (n := _NAME.search(block)) else None)
            out.dropped.append(Dropped(name if isinstance(name, str) else None, closed))
            self.dropped.append(out.dropped[-1])
        else:
            self.calls.append(call)
            out.calls.append(call)
            out.pieces += pieces if self.open.name is not None else [CallPiece(call.index, call.arguments, call.id, call.name)]
        self.open = None

    def _content(self, text: str) -> Optional[str]:
        if not text:
            return None
        if not text.strip():
            self.held_space += text
            return None
        out, self.held_space = self.held_space + text, ""
        return out


def partial_marker(text: str, marker: str = TOOL_CALL_START) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_whole(text: str, cut: bool = False) -> tuple[Optional[str], list[ParsedCall]]:
    """A whole response's content (None when it is only calls) and its calls; `cut`: max_tokens
    ended it."""
    content, calls, _ = split_whole_dropping(text, cut)
    return content, calls


def split_whole_dropping(text: str, cut: bool = False) -> tuple[Optional[str], list[ParsedCall], list[Dropped]]:
    """split_whole, and the blocks it dropped (for the log)."""
    s = ToolCallStream()
    a, b = s.feed(text), s.flush(cut)
    content = (a.content or "") + (b.content or "")
    if s.calls:
        content = content.strip() or None
    return content, s.calls, s.dropped
