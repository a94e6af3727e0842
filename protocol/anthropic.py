"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens): its request as
strict msgspec Structs, converted to the one internal GenerateRequest the other entrances build.

Unknown fields are refused by name. Fields that clients such as Claude Code send but that mean
nothing to a local server (`cache_control`, `context_management`, `output_config.effort`, ...)
are accepted and ignored: ACCEPTED_IGNORED lists them (docs/api.md too). Nothing here imports
MLX or aiohttp.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta, Struct

from protocol import messages as m
from protocol.schema import MAX_STOP_STRINGS, RequestInvalid, check_request, decode_body

# what a client may send that verity takes and does nothing with (prefix reuse is automatic;
# one local model has no tiers, regions, containers or server-side context edits)
ACCEPTED_IGNORED = ("cache_control", "citations", "context_management", "container", "diagnostics",
                    "inference_geo", "service_tier", "speed", "output_config.effort", "user_profile_id",
                    "workspace_id", "metadata.user_id", "thinking.display", "tools[].strict",
                    "tools[].eager_input_streaming", "tools[].defer_loading", "tools[].input_examples",
                    "tools[].allowed_callers", "tool_use.caller", "thinking.signature", "tool_result.is_error")
UNSERVED_BLOCKS = ("image", "document")  # refused by name: the model reads text


class TextBlock(Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: str
    cache_control: Any = None
    citations: Any = None


class TextPart(Struct, forbid_unknown_fields=True):
    """A text block where only text may stand (`system`, a tool result's content): `type` required."""

    type: Literal["text"]
    text: str
    cache_control: Any = None
    citations: Any = None


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", forbid_unknown_fields=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", forbid_unknown_fields=True):
    tool_use_id: str
    content: Union[str, list[TextPart]] = ""
    is_error: Optional[bool] = None
    cache_control: Any = None


class ThinkingBlock(Struct, tag="thinking", tag_field="type", forbid_unknown_fields=True):
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type", forbid_unknown_fields=True):
    data: str


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]


class MessageParam(Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation reminders
    content: Union[str, list[Block]]


class ToolParam(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]  # Anthropic's length (MCP tools' names are long)
    input_schema: dict[str, Any]
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None  # server tools (web search, code execution) are not served
    cache_control: Any = None
    strict: Optional[bool] = None
    eager_input_streaming: Optional[bool] = None
    defer_loading: Optional[bool] = None
    input_examples: Any = None
    allowed_callers: Any = None


class ToolChoiceAuto(Struct, tag="auto", tag_field="type", forbid_unknown_fields=True):
    disable_parallel_tool_use: Optional[bool] = None


class ToolChoiceAny(Struct, tag="any", tag_field="type", forbid_unknown_fields=True):
    disable_parallel_tool_use: Optional[bool] = None


class ToolChoiceTool(Struct, tag="tool", tag_field="type", forbid_unknown_fields=True):
    name: str
    disable_parallel_tool_use: Optional[bool] = None


class ToolChoiceNone(Struct, tag="none", tag_field="type", forbid_unknown_fields=True):
    pass


ToolChoice = Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone]


class ThinkingEnabled(Struct, tag="enabled", tag_field="type", forbid_unknown_fields=True):
    budget_tokens: Annotated[int, Meta(ge=1)]
    display: Optional[str] = None


class ThinkingDisabled(Struct, tag="disabled", tag_field="type", forbid_unknown_fields=True):
    pass


class ThinkingAdaptive(Struct, tag="adaptive", tag_field="type", forbid_unknown_fields=True):
    """The model decides: the chat template's default."""

    display: Optional[str] = None


Thinking = Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive]


class JsonOutputFormat(Struct, forbid_unknown_fields=True, rename={"schema_": "schema"}):
    type: Literal["json_schema"]
    schema_: dict[str, Any]


class OutputConfig(Struct, forbid_unknown_fields=True):
    effort: Optional[str] = None  # accepted, ignored
    format: Optional[JsonOutputFormat] = None  # grammar-constrained, as chat's response_format


class Metadata(Struct, forbid_unknown_fields=True):
    user_id: Optional[str] = None


class CountTokensRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: list[MessageParam]
    system: Union[str, list[TextPart], None] = None
    tools: Optional[list[ToolParam]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Any = None
    context_management: Any = None
    speed: Optional[str] = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages, with verity's own fields (`mode`, `ignore_eos`, `seed`) as chat takes them."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = None
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Meta(ge=0)]] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    container: Any = None
    inference_geo: Optional[str] = None
    diagnostics: Any = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    mode: Optional[m.Mode] = None
    ignore_eos: Optional[bool] = None
    seed: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None


_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


def parse_messages(body: bytes) -> MessagesRequest:
    return _checked(_decoded(body, _messages_decoder))


def parse_count(body: bytes) -> CountTokensRequest:
    return _checked(_decoded(body, _count_decoder))


def _decoded(body: bytes, decoder: msgspec.json.Decoder):
    """The body decoded; a block type the model cannot read is refused by name."""
    try:
        return decode_body(body, decoder)
    except RequestInvalid as e:
        kind = next((k for k in UNSERVED_BLOCKS if f"Invalid value '{k}'" in e.message), None)
        if kind is None or not (e.param or "").endswith(".type"):
            raise
        raise RequestInvalid(f"`{e.param[:-5]}`: content blocks of type `{kind}` are not supported: this server's "
                             "model reads text only", e.param, "unsupported_content") from None


def _checked(req):
    """Rules in Anthropic's terms (so the 400 names Anthropic's field)."""
    if not req.messages:
        raise RequestInvalid("`messages` must not be empty", "messages")
    for i, msg in enumerate(req.messages):
        for j, block in enumerate([] if isinstance(msg.content, str) else msg.content):
            owner = "assistant" if isinstance(block, ToolUseBlock) else "user" if isinstance(block, ToolResultBlock) else None
            if owner and msg.role != owner:
                raise RequestInvalid(f"`{block.__struct_config__.tag}` blocks belong to {owner} messages",
                                     f"messages[{i}].content[{j}]", "invalid_tools")
    if req.messages[-1].role == "assistant":
        raise RequestInvalid("a last `assistant` message (prefill) is not supported by verity: end with a user turn",
                             f"messages[{len(req.messages) - 1}].role", "prefill_unsupported")
    stops = getattr(req, "stop_sequences", None)
    if stops is not None and (len(stops) > MAX_STOP_STRINGS or "" in stops):
        raise RequestInvalid(f"`stop_sequences` takes at most {MAX_STOP_STRINGS} non-empty strings", "stop_sequences")
    names = [t.name for t in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RequestInvalid(f"tool `{name}` is defined twice", f"tools[{i}].name", "invalid_tools")
    if isinstance(req.tool_choice, ToolChoiceTool) and req.tool_choice.name not in names:
        raise RequestInvalid(f"`tool_choice` names `{req.tool_choice.name}`, which is not in `tools`",
                             "tool_choice.name", "invalid_tools")
    if isinstance(req.tool_choice, (ToolChoiceAny, ToolChoiceTool)) and not names:
        raise RequestInvalid("`tool_choice` that forces a call needs `tools`", "tool_choice", "invalid_tools")
    return req


def _text(blocks: Union[str, list]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks if isinstance(b, (TextBlock, TextPart)))


def _turns(req: CountTokensRequest) -> list[m.Message]:
    """Anthropic's turns as chat messages: system first, each tool_result a tool message (before
    its turn's text), tool_use blocks an assistant's tool_calls, thinking blocks its
    reasoning_content (the template decides whether to render it). Consecutive turns of one role
    merge into one, as Anthropic says; a system message after the first turn reads as user text."""
    system = [_text(req.system)] if req.system else []
    out: list[m.Message] = []
    for msg in req.messages:
        if msg.role == "system" and not out:
            system.append(_text(msg.content))
            continue
        role = "user" if msg.role == "system" else msg.role
        blocks = [TextBlock(msg.content)] if isinstance(msg.content, str) else msg.content
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                out.append(m.Message("tool", _text(b.content), tool_call_id=b.tool_use_id))
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        thought = "\n".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock)) or None
        calls = [m.ToolCall(b.id, m.FunctionCall(b.name, json.dumps(b.input, ensure_ascii=False)))
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if not texts and not calls and any(isinstance(b, ToolResultBlock) for b in blocks):
            continue
        _append(out, m.Message(role, "\n".join(texts), tool_calls=calls or None,
                               reasoning_content=thought if role == "assistant" else None))
    lead = [m.Message("system", "\n".join(system))] if system else []
    return lead + out


def _append(out: list[m.Message], msg: m.Message) -> None:
    last = out[-1] if out else None
    if last is None or last.role != msg.role or last.tool_calls:
        out.append(msg)
        return
    text = "\n".join(t for t in (last.content, msg.content) if t)
    out[-1] = m.Message(msg.role, text, tool_calls=msg.tool_calls,
                        reasoning_content=last.reasoning_content or msg.reasoning_content)


def _tool_fields(req: CountTokensRequest) -> dict:
    tools = [m.Tool("function", m.FunctionDef(t.name, t.description, t.input_schema)) for t in req.tools or []] or None
    c = req.tool_choice
    choice = ("auto" if isinstance(c, ToolChoiceAuto) else "required" if isinstance(c, ToolChoiceAny)
              else "none" if isinstance(c, ToolChoiceNone)
              else m.NamedToolChoice("function", m.FunctionName(c.name)) if isinstance(c, ToolChoiceTool) else None)
    parallel = False if getattr(c, "disable_parallel_tool_use", None) else None
    return {"tools": tools, "tool_choice": choice if tools else None, "parallel_tool_calls": parallel if tools else None}


def thinking_flag(req: CountTokensRequest) -> Optional[bool]:
    """enabled: on; disabled: off; adaptive or absent: the chat template's default."""
    t = req.thinking
    return True if isinstance(t, ThinkingEnabled) else False if isinstance(t, ThinkingDisabled) else None


def to_generate(req: CountTokensRequest, max_tokens: int) -> m.GenerateRequest:
    """The internal request (chat), checked as chat completions are."""
    fmt = req.output_config.format if req.output_config else None
    fields: dict = {}
    if isinstance(req, MessagesRequest):
        fields = {"stop": req.stop_sequences, "stream": bool(req.stream), "temperature": req.temperature,
                  "top_p": req.top_p, "top_k": req.top_k, "user": req.metadata.user_id if req.metadata else None,
                  "mode": req.mode, "ignore_eos": req.ignore_eos, "seed": req.seed}
    budget = req.thinking.budget_tokens if isinstance(req.thinking, ThinkingEnabled) else None
    out = m.GenerateRequest(
        model=req.model, messages=_turns(req), max_tokens=max_tokens, thinking=thinking_flag(req),
        max_thinking_tokens=budget,
        response_format=m.ResponseFormat("json_schema", m.JsonSchemaFormat("output", schema_=fmt.schema_)) if fmt else None,
        **_tool_fields(req), **fields)
    return check_request(out, "chat")
