"""/openapi.json's part for POST /v1/messages and /v1/messages/count_tokens: the request schemas
from protocol/anthropic.py's structs (narrowed to this server as chat's are), and the response
shapes gateway/anthropic_format.py builds, as structs the tests convert real responses into."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import Struct

from protocol import anthropic as a, messages as m
from protocol.schema import MAX_STOP_STRINGS


class TextContent(Struct, tag="text", tag_field="type"):
    text: str


class ThinkingContent(Struct, tag="thinking", tag_field="type"):
    """A thinking model's think block (the template's; `signature` is empty: nothing to verify)."""

    thinking: str
    signature: str


class ToolUseContent(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[TextContent, ThinkingContent, ToolUseContent]
StopReason = Literal["end_turn", "max_tokens", "tool_use", "stop_sequence"]


class MessageUsage(Struct):
    """`input_tokens` are the prompt's tokens prefilled; those reused from the cache are
    `cache_read_input_tokens` (the two add up to the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class AnthropicMessage(Struct, omit_defaults=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Optional[StopReason]
    stop_sequence: Optional[str]
    usage: MessageUsage
    metrics: Optional[m.RequestMetrics] = None  # verity's extension


class AnthropicErrorDetail(Struct):
    """`code` and `param` (the field at fault) are verity's, beside Anthropic's `type` and `message`."""

    type: str
    message: str
    code: Optional[str] = None
    param: Optional[str] = None


class AnthropicError(Struct, tag="error", tag_field="type", omit_defaults=True):
    """Every refusal on these paths (503 goes out as 529 overloaded_error), and a stream's `error` event."""

    error: AnthropicErrorDetail
    request_id: Optional[str] = None


class CountTokensResponse(Struct):
    input_tokens: int


class MessageStart(Struct, tag="message_start", tag_field="type"):
    message: AnthropicMessage


class Ping(Struct, tag="ping", tag_field="type"):
    pass


class ContentBlockStart(Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class TextDelta(Struct, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str  # the pieces of a block add up to its input's JSON


class ThinkingDelta(Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class ContentBlockDelta(Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: Union[TextDelta, InputJsonDelta, ThinkingDelta]


class ContentBlockStop(Struct, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDeltaBody(Struct):
    stop_reason: StopReason
    stop_sequence: Optional[str]


class MessageDelta(Struct, tag="message_delta", tag_field="type"):
    delta: MessageDeltaBody
    usage: MessageUsage
    metrics: m.RequestMetrics


class MessageStop(Struct, tag="message_stop", tag_field="type"):
    pass


StreamEvent = Union[MessageStart, Ping, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta,
                    MessageStop, AnthropicError]
STRUCTS = (a.MessagesRequest, a.CountTokensRequest, AnthropicMessage, AnthropicError, CountTokensResponse,
           MessageStart, Ping, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta, MessageStop)
ERRORS = {"400": "the request is invalid; `error.param` names the field", "401": "missing or invalid API key",
          "403": "refused `Host` or `Origin`", "404": "`model` names a model this server does not serve",
          "413": "the body is over the size limit", "429": "the admission queue is full; retry after `Retry-After`",
          "529": "overloaded: the worker is restarting or the server is shutting down (Anthropic's status)",
          "504": "the request reached the server's time limit"}


def add(doc: dict, names: tuple[str, ...], joint: bool, auth: bool, ref: str) -> None:
    """Adds the routes, their components and the x-api-key scheme to the OpenAPI document."""
    _, comps = msgspec.json.schema_components(STRUCTS, ref_template=ref)
    schemas = doc["components"]["schemas"]
    clash = sorted(k for k in comps if k in schemas and schemas[k] != comps[k])
    assert not clash, f"component names taken: {clash}"
    schemas.update(comps)
    schemas["MessageStreamEvent"] = {"anyOf": [{"$ref": ref.format(name=s.__name__)} for s in StreamEvent.__args__]}
    for name in ("MessagesRequest", "CountTokensRequest"):
        _narrow(schemas[name], names, joint)
    security = [{"bearer": []}, {"apiKey": []}] if auth else []
    if auth:
        doc["components"].setdefault("securitySchemes", {})["apiKey"] = {"type": "apiKey", "in": "header",
                                                                         "name": "x-api-key"}
    doc["paths"]["/v1/messages"] = _op("createMessage", "Generate the next assistant message (Anthropic's Messages API)",
                                       "MessagesRequest", "AnthropicMessage", security, ref, stream=True)
    doc["paths"]["/v1/messages/count_tokens"] = _op(
        "countMessageTokens", "The prompt's tokens as a message request would render them", "CountTokensRequest",
        "CountTokensResponse", security, ref, stream=False)


def _narrow(s: dict, names: tuple[str, ...], joint: bool) -> None:
    p = s["properties"]
    if names:
        p["model"] = {"enum": list(names), "description": "the model's id or one of its --served-model-name aliases"}
    p["messages"] = {**p["messages"], "minItems": 1}
    if "mode" in p and not joint:
        p["mode"] = {"enum": ["baseline", None], "default": None, "description": "\"joint\" needs a server started with --draft"}
    if "stop_sequences" in p:
        p["stop_sequences"] = {"anyOf": [{"type": "array", "maxItems": MAX_STOP_STRINGS,
                                          "items": {"type": "string", "minLength": 1}}, {"type": "null"}], "default": None}
    s["description"] = (
        "Anthropic's request as verity takes it. Unknown fields are refused by name; these are accepted and "
        f"ignored: {', '.join(a.ACCEPTED_IGNORED)}. `max_tokens` over the server's cap is lowered to it. A last "
        "assistant message (prefill) is refused (400 `prefill_unsupported`); image and document blocks too.")


def _op(op_id: str, summary: str, body: str, answer: str, security: list, ref: str, stream: bool) -> dict:
    error = {"application/json": {"schema": {"$ref": ref.format(name="AnthropicError")}}}
    content = {"application/json": {"schema": {"$ref": ref.format(name=answer)}}}
    if stream:
        content["text/event-stream"] = {"itemSchema": {
            "type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": {
                "type": "string", "contentMediaType": "application/json",
                "contentSchema": {"$ref": ref.format(name="MessageStreamEvent")}}}}}
    codes = {k: v for k, v in ERRORS.items() if stream or k not in ("429", "504")}
    return {"post": {
        "operationId": op_id, "summary": summary, "security": security,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": ref.format(name=body)}}}},
        "responses": {"200": {"description": summary + (" (with `stream: true`: the event stream)" if stream else ""),
                              "headers": {"X-Request-Id": {"schema": {"type": "string"}}}, "content": content},
                      **{k: {"description": v, "content": error} for k, v in codes.items()}},
    }}
