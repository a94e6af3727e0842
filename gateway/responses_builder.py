"""The builder that turns a Responses request's worker events into its output items and stream
events (gateway/responses_format.py).

One builder serves a stream and a whole response alike: the whole one is the stream's last
state. Output items come in the order the text makes them: reasoning (the thinking, apart from
the answer), a message (the answer's text), function calls (gateway/tools.py finds them).
Every event carries its `sequence_number`, from 0.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, Optional

import msgspec
from msgspec import Struct

from gateway.responses_format import (
    ArgumentsDelta, ArgumentsDone, ContentPartAdded, ContentPartDone, ErrorEvent, IncompleteDetails, InputTokensDetails,
    ItemStatus, OutputFunctionCall, OutputItem, OutputItemAdded, OutputItemDone, OutputMessage, OutputReasoning,
    OutputReasoningText, OutputText, OutputTextDelta, OutputTextDone, OutputTokensDetails, ReasoningTextDelta,
    ReasoningTextDone, ResponseCompleted, ResponseCreated, ResponseError, ResponseFailed, ResponseInProgress,
    ResponseIncomplete, ResponseObject, ResponseQueued, ResponseUsage, Status)
from gateway.reasoning import Parts, ReasoningSplit
from gateway.tools import CallPiece, ParsedCall, ToolCallStream
from protocol import messages as m
from protocol.responses import Converted, ResponsesRequest


@dataclass
class _Item:
    """An output item being written."""

    kind: Literal["message", "function_call", "reasoning"]
    id: str
    index: int  # its output_index
    text: list[str] = field(default_factory=list)  # a message's or reasoning's text, or a call's arguments
    call_id: str = ""
    name: str = ""
    status: ItemStatus = "in_progress"

    def shape(self) -> OutputItem:
        text = "".join(self.text)
        if self.kind == "message":
            return OutputMessage(self.id, self.status, [OutputText(text)] if self.status != "in_progress" else [])
        if self.kind == "reasoning":
            return OutputReasoning(self.id, self.status, [OutputReasoningText(text)] if self.status != "in_progress" else [])
        return OutputFunctionCall(self.id, self.call_id, self.name, text, self.status)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseBuilder:
    """One response's state, advanced by its worker events; each step returns its stream events."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, conv: Converted, tool_calls: bool,
                 thinks: bool = False, defaults: Optional[m.SamplingDefaults] = None):
        """`thinks`: the model's template thinks (its think block becomes a reasoning item)."""
        self.id, self.model, self.req, self.conv = rid, model, req, conv
        self.created_at = int(time.time())
        self.defaults = defaults
        self.thinks, self.inside = thinks, False  # inside: the worker's Queued says generation starts in the block
        self.split: Optional[ReasoningSplit] = None  # made at the first text
        self.calls = ToolCallStream() if tool_calls else None
        self.items: list[_Item] = []
        self.open: Optional[_Item] = None  # the message or reasoning item text goes to
        self.call_items: dict[int, _Item] = {}  # by the call's index in the text
        self.seq = 0
        self.status: Status = "in_progress"
        self.finished: Optional[m.Finished] = None
        self.error: Optional[ResponseError] = None
        self.error_status = 500  # the HTTP status of the error a whole response answers

    # ---- the response object ----

    def response(self) -> ResponseObject:
        r, f = self.req, self.finished
        sampling = self.defaults or m.SamplingDefaults()
        text_format = r.text.format if r.text and r.text.format else {"type": "text"}
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=self.status, model=self.model,
            output=[i.shape() for i in self.items], parallel_tool_calls=r.parallel_tool_calls is not False,
            tool_choice=r.tool_choice or "auto", tools=r.tools or [], text={"format": text_format},
            store=r.store is not False, background=bool(r.background),
            completed_at=int(time.time()) if self.status == "completed" else None, error=self.error,
            incomplete_details=IncompleteDetails("max_output_tokens") if f and f.finish_reason == "length" else None,
            instructions=r.instructions, max_output_tokens=r.max_output_tokens,
            previous_response_id=r.previous_response_id,
            reasoning={"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            temperature=r.temperature if r.temperature is not None else sampling.temperature,
            top_p=r.top_p if r.top_p is not None else sampling.top_p, usage=self._usage(), user=r.user,
            metadata=r.metadata or {}, metrics=f.metrics if f else None)

    def _usage(self) -> Optional[ResponseUsage]:
        if self.finished is None:
            return None
        mx = self.finished.metrics
        return ResponseUsage(mx.prompt_tokens, InputTokensDetails(mx.reused_tokens), mx.completion_tokens,
                             OutputTokensDetails(mx.reasoning_tokens),
                             mx.prompt_tokens + mx.completion_tokens)

    def as_dict(self) -> dict:
        return msgspec.to_builtins(self.response())

    def context(self) -> list[m.Message]:
        """The conversation through this response: its input, then its answer and calls."""
        text = "".join("".join(i.text) for i in self.items if i.kind == "message")
        calls = [m.ToolCall(i.call_id, m.FunctionCall(i.name, "".join(i.text)))
                 for i in self.items if i.kind == "function_call" and i.status == "completed"]
        return self.conv.turn + [m.Message("assistant", text or None, tool_calls=calls or None)]

    # ---- events ----

    def _ev(self, cls, **fields) -> Struct:
        ev = cls(sequence_number=self.seq, **fields)
        self.seq += 1
        return ev

    def start(self, queued: bool = False) -> list[Struct]:
        out = [self._ev(ResponseCreated, response=self.response())]
        return out + [self._ev(ResponseQueued if queued else ResponseInProgress, response=self.response())]

    def on_event(self, ev) -> list[Struct]:
        """A worker event's stream events (Queued and Started give none)."""
        if self.status == "queued" and isinstance(ev, (m.Started, m.TextDelta)):
            self.status = "in_progress"
        if isinstance(ev, m.Queued):
            self.inside = ev.thinking
        if isinstance(ev, m.TextDelta):
            return self.delta(ev)
        if isinstance(ev, m.Finished):
            return self.finish(ev)
        if isinstance(ev, m.Error):
            return self.fail(ev.code, ev.message, ev.param, ev.status)
        return []

    def delta(self, ev: m.TextDelta) -> list[Struct]:
        if not self.thinks:
            return self._parts(Parts(content=ev.text))
        if self.split is None:
            self.split = ReasoningSplit(self.inside)
        return self._parts(self.split.feed(ev.text))

    def _parts(self, parts: Parts) -> list[Struct]:
        out = self._text("reasoning", parts.reasoning) if parts.reasoning else []
        if parts.content:
            out += self._answer(parts.content)
        return out

    def _answer(self, text: str) -> list[Struct]:
        if self.calls is None:
            return self._text("message", text)
        split = self.calls.feed(text)
        return self._split(split)

    def _split(self, split) -> list[Struct]:
        out = self._text("message", split.content) if split.content else []
        for piece in split.pieces:
            out += self._piece(piece)
        for call in split.calls:
            out += self._call_done(call)
        return out

    def _text(self, kind: str, text: str) -> list[Struct]:
        out = []
        if self.open is not None and self.open.kind != kind:
            out += self._close_open()
        if self.open is None:
            self.open = self._add(kind, "msg_" if kind == "message" else "rs_")
            part = OutputText("") if kind == "message" else OutputReasoningText("")
            out += [self._ev(OutputItemAdded, output_index=self.open.index, item=self.open.shape()),
                    self._ev(ContentPartAdded, item_id=self.open.id, output_index=self.open.index, part=part)]
        self.open.text.append(text)
        delta = OutputTextDelta if kind == "message" else ReasoningTextDelta
        return out + [self._ev(delta, item_id=self.open.id, output_index=self.open.index, delta=text)]

    def _add(self, kind: str, prefix: str) -> _Item:
        item = _Item(kind, _new_id(prefix), len(self.items))
        self.items.append(item)
        return item

    def _close_open(self, status: ItemStatus = "completed") -> list[Struct]:
        item, self.open = self.open, None
        if item is None:
            return []
        text = "".join(item.text)
        item.status = status
        message = item.kind == "message"
        done, part = (OutputTextDone, OutputText(text)) if message else (ReasoningTextDone, OutputReasoningText(text))
        return [self._ev(done, item_id=item.id, output_index=item.index, text=text),
                self._ev(ContentPartDone, item_id=item.id, output_index=item.index, part=part),
                self._ev(OutputItemDone, output_index=item.index, item=item.shape())]

    def _piece(self, piece: CallPiece) -> list[Struct]:
        out = []
        if piece.id is not None:  # a call begins
            out += self._close_open()
            item = self._add("function_call", "fc_")
            item.call_id, item.name = piece.id, piece.name or ""
            self.call_items[piece.index] = item
            out.append(self._ev(OutputItemAdded, output_index=item.index, item=item.shape()))
        item = self.call_items[piece.index]
        if piece.arguments:
            item.text.append(piece.arguments)
            out.append(self._ev(ArgumentsDelta, item_id=item.id, output_index=item.index, delta=piece.arguments))
        return out

    def _call_done(self, call: ParsedCall) -> list[Struct]:
        item = self.call_items[call.index]
        item.text, item.status = [call.arguments], "completed"
        return [self._ev(ArgumentsDone, item_id=item.id, output_index=item.index, name=item.name,
                         arguments=call.arguments),
                self._ev(OutputItemDone, output_index=item.index, item=item.shape())]

    def _flush(self, cut: bool) -> list[Struct]:
        """The text held back (a partial marker, an open block) at the end."""
        out = self._parts(self.split.finish()) if self.split is not None else []
        if self.calls is not None:
            out += self._split(self.calls.flush(cut))
        return out

    def _close_all(self, status: ItemStatus) -> list[Struct]:
        out = self._close_open(status)
        for item in self.call_items.values():
            if item.status == "in_progress":  # a block that was never a whole call
                item.status = "incomplete"
                out.append(self._ev(OutputItemDone, output_index=item.index, item=item.shape()))
        return out

    def finish(self, ev: m.Finished) -> list[Struct]:
        cut = ev.finish_reason == "length"
        out = self._flush(cut)
        self.finished = ev
        self.status = {"length": "incomplete", "cancelled": "cancelled"}.get(ev.finish_reason, "completed")
        out += self._close_all("completed" if self.status == "completed" else "incomplete")
        end = ResponseCompleted if self.status == "completed" else ResponseIncomplete
        return out + [self._ev(end, response=self.response())]

    def fail(self, code: str, message: str, param: Optional[str] = None, status: int = 500) -> list[Struct]:
        out = self._close_all("incomplete")
        self.status, self.error, self.error_status = "failed", ResponseError(code, message), status
        return out + [self._ev(ErrorEvent, code=code, message=message, param=param),
                      self._ev(ResponseFailed, response=self.response())]

    def abandon(self) -> None:
        """Its client left before the end: cancelled, with the output so far."""
        self._close_all("incomplete")
        self.status = "cancelled"

    @property
    def ended(self) -> bool:
        return self.status not in ("in_progress", "queued")
