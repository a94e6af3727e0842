"""A thinking model's output split into its reasoning and its answer, as the text streams.

The worker says, per request (protocol.messages.Queued.thinking), whether the generation starts
inside the template's think block (Qwen3.5 opens `<think>\\n` in the generation prompt). Either
way a `<think>` at the very start of the output (after whitespace) opens one too (Qwen3 writes it
itself). Everything up to `</think>` is reasoning; what follows, less its leading whitespace (the
template's separator), is the answer. A block that never closes (max_tokens) is all reasoning. A
tag split across chunks is held back until it is whole; nothing else is held.

Every entrance (chat completions, Messages, Responses) uses this one splitter:

    split = ReasoningSplit(started_inside)
    for text in deltas:
        parts = split.feed(text)   # Parts(reasoning, content): either may be ""
    parts = split.finish()
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tools import partial_marker

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Parts:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: "Parts") -> "Parts":
        return Parts(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSplit:
    """Streams text into (reasoning, content); `started_inside`: the prompt left a think block open."""

    def __init__(self, started_inside: bool):
        # "start": a `<think>` may still open the output; "opened": whitespace after it skipped;
        # "inside": reasoning; "after": the separator after `</think>` skipped; "answer": content
        self.state = "inside" if started_inside else "start"
        self.pending = ""
        self.thought = started_inside  # a think block was opened (an answer follows it)

    def feed(self, text: str) -> Parts:
        buf, self.pending = self.pending + text, ""
        out = Parts()
        while buf:
            buf = getattr(self, f"_{self.state}")(buf, out)
        return out

    def finish(self) -> Parts:
        """What was held back: an unclosed block's tail is reasoning, a partial `<think>` content."""
        rest, self.pending = self.pending, ""
        if self.state == "inside":
            return Parts(reasoning=rest)
        return Parts(content=rest if self.state in ("start", "answer") else "")

    def _start(self, buf: str, out: Parts) -> str:
        head = buf.lstrip()
        if head.startswith(THINK_OPEN):
            self.state, self.thought = "opened", True
            return head[len(THINK_OPEN):]
        if THINK_OPEN.startswith(head):  # whitespace, or a tag not whole yet
            self.pending = buf
            return ""
        self.state = "answer"
        return buf

    def _inside(self, buf: str, out: Parts) -> str:
        end = buf.find(THINK_CLOSE)
        if end >= 0:
            out.reasoning += buf[:end]
            self.state = "after"
            return buf[end + len(THINK_CLOSE):]
        keep = partial_marker(buf, THINK_CLOSE)
        out.reasoning += buf[: len(buf) - keep]
        self.pending = buf[len(buf) - keep:]
        return ""

    def _opened(self, buf: str, out: Parts) -> str:
        """Whitespace after a `<think>` the model wrote is skipped."""
        rest = buf.lstrip()
        if rest:
            self.state = "inside"
        return rest

    def _after(self, buf: str, out: Parts) -> str:
        rest = buf.lstrip()
        if rest:
            self.state = "answer"
        return rest

    def _answer(self, buf: str, out: Parts) -> str:
        out.content += buf
        return ""


def split(text: str, started_inside: bool) -> Parts:
    """A whole output's reasoning and answer (the same as streaming it)."""
    s = ReasoningSplit(started_inside)
    return s.feed(text) + s.finish()
