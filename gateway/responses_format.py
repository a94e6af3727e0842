"""The Responses API's wire shapes: the response object, its output items and the typed stream
events (gateway/responses_builder.py builds them; /openapi.json describes them from here)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from msgspec import Struct

from protocol import messages as m

Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(Struct, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class OutputFunctionCall(Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(Struct, tag_field="type", tag="reasoning"):
    """The model's thinking as text (`content`); verity writes no summary and encrypts nothing."""

    id: str
    status: ItemStatus
    content: list[OutputReasoningText]
    summary: list[Any] = []
    encrypted_content: Optional[str] = None


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputReasoning]


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(Struct):
    code: str
    message: str


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens"]


class ResponseObject(Struct):
    """A response: as created (status in_progress, no output), as it ended, or as stored."""

    id: str
    created_at: int
    status: Status
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[Any]
    text: Any
    store: bool
    background: bool
    object: Literal["response"] = "response"
    completed_at: Optional[int] = None
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    reasoning: Any = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    truncation: Literal["disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: dict[str, str] = {}
    metrics: Optional[m.RequestMetrics] = None  # verity's extension, as in chat completions


class _Event(Struct, tag_field="type", kw_only=True):
    sequence_number: int


class _Lifecycle(_Event, kw_only=True):
    response: ResponseObject


class ResponseQueued(_Lifecycle, tag="response.queued"): ...
class ResponseCreated(_Lifecycle, tag="response.created"): ...
class ResponseInProgress(_Lifecycle, tag="response.in_progress"): ...
class ResponseCompleted(_Lifecycle, tag="response.completed"): ...
class ResponseIncomplete(_Lifecycle, tag="response.incomplete"): ...
class ResponseFailed(_Lifecycle, tag="response.failed"): ...


class _ItemEvent(_Event, kw_only=True):
    output_index: int
    item: OutputItem


class OutputItemAdded(_ItemEvent, tag="response.output_item.added"): ...
class OutputItemDone(_ItemEvent, tag="response.output_item.done"): ...


class _PartEvent(_Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0


class _PartChange(_PartEvent, kw_only=True):
    part: Union[OutputText, OutputReasoningText]


class ContentPartAdded(_PartChange, tag="response.content_part.added"): ...
class ContentPartDone(_PartChange, tag="response.content_part.done"): ...


class OutputTextDelta(_PartEvent, tag="response.output_text.delta", kw_only=True):
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_PartEvent, tag="response.output_text.done", kw_only=True):
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_PartEvent, tag="response.reasoning_text.delta", kw_only=True):
    delta: str


class ReasoningTextDone(_PartEvent, tag="response.reasoning_text.done", kw_only=True):
    text: str


class ArgumentsDelta(_Event, tag="response.function_call_arguments.delta", kw_only=True):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(_Event, tag="response.function_call_arguments.done", kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, tag="error", kw_only=True):
    """A failure after the stream began (then `response.failed`)."""

    code: str
    message: str
    param: Optional[str] = None


StreamEvent = Union[ResponseQueued, ResponseCreated, ResponseInProgress, ResponseCompleted, ResponseIncomplete,
                    ResponseFailed, OutputItemAdded, OutputItemDone, ContentPartAdded, ContentPartDone,
                    OutputTextDelta, OutputTextDone, ReasoningTextDelta, ReasoningTextDone, ArgumentsDelta,
                    ArgumentsDone, ErrorEvent]


def event_type(ev: Struct) -> str:
    return ev.__struct_config__.tag
