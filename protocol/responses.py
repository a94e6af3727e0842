"""POST /v1/responses (OpenAI's Responses API): the request as strict msgspec structs, and its
conversion to the one internal GenerateRequest (protocol/messages.py) that every route sends.

Items of `input` and `tools` are decoded by their `type` (a message may omit it), each against its
struct, so an error names the field (`input[2].content[0].foo`). Unknown fields are refused by name;
OpenAI fields verity does not implement are refused unless null (UNSUPPORTED). Fields clients send
that change nothing here are accepted and documented (docs/api.md): `include`, `prompt_cache_key`,
`client_metadata`, `text.verbosity`, `reasoning.summary`, `stream_options`, `truncation`, `user`.
Tools of OpenAI's hosted types (web_search, …) are accepted and not offered to the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta, Struct

from protocol import messages as m
from protocol.schema import RequestInvalid, check_request, decode_body, validation_error

Role = Literal["user", "assistant", "system", "developer"]
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
# OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]], Meta(max_length=16)]
# OpenAI fields verity does not implement: accepted only as null (top_logprobs: also 0)
UNSUPPORTED = frozenset({"conversation", "prompt", "context_management", "max_tool_calls", "top_logprobs",
                         "moderation", "image", "background_options", "prompt_cache_options", "access_programs"})
# hosted tools run by OpenAI's servers: accepted (clients such as Codex send them) and not offered
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "file_search",
                          "code_interpreter", "image_generation", "computer_use_preview", "computer", "mcp",
                          "local_shell", "shell", "apply_patch", "custom", "namespace", "tool_search"})
# input items that only OpenAI's tools produce: refused by name
UNSERVED_ITEMS = frozenset({"item_reference", "web_search_call", "file_search_call", "computer_call",
                            "computer_call_output", "image_generation_call", "code_interpreter_call",
                            "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
                            "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                            "custom_tool_call", "custom_tool_call_output", "apply_patch_call",
                            "apply_patch_call_output", "compaction", "tool_search_call", "tool_search_output"})
TEXT_PARTS = ("input_text", "output_text", "refusal")
Includable = Literal["reasoning.encrypted_content", "message.output_text.logprobs", "message.input_image.image_url",
                     "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "code_interpreter_call.outputs", "computer_call_output.output.image_url"]


# fields of image, file and audio parts: decoded only so that such a part is refused by its type
REFUSED_PART_FIELDS = ("image_url", "file_id", "file_data", "file_url", "filename", "detail", "input_audio")
_RefusedParts = msgspec.defstruct("_RefusedParts", [(n, Any, None) for n in REFUSED_PART_FIELDS])


class InputContentPart(_RefusedParts, forbid_unknown_fields=True, kw_only=True):
    """A part of a message's content: text parts are served; image, file and audio parts are
    decoded only to be refused by name."""

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None  # an output_text's, replayed: ignored
    logprobs: Optional[list[Any]] = None


class MessageItem(Struct, forbid_unknown_fields=True):
    role: Role
    content: Union[str, list[InputContentPart]]
    type: Literal["message"] = "message"
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None  # commentary / final_answer (Codex replays it): ignored


class FunctionCallItem(Struct, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    id: Optional[str] = None
    status: Optional[str] = None
    namespace: Optional[str] = None


class FunctionCallOutputItem(Struct, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class InputReasoningText(Struct, forbid_unknown_fields=True):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Struct, forbid_unknown_fields=True):
    """A reasoning item replayed from an earlier output: read, and left out of the prompt (chat
    templates drop earlier turns' thinking too)."""

    type: Literal["reasoning"]
    summary: list[InputReasoningText] = []
    content: Optional[list[InputReasoningText]] = None
    encrypted_content: Optional[str] = None
    id: Optional[str] = None
    status: Optional[str] = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


class FunctionTool(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: Name
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None
    description: Optional[str] = None
    defer_loading: Optional[bool] = None  # accepted, ignored: every tool is always offered


class HostedTool(Struct):
    """A tool OpenAI's servers run (its other fields are not read): accepted, never offered."""

    type: str


class ToolChoiceFunction(Struct, forbid_unknown_fields=True):
    """Forces a call of the function named (other kinds of OpenAI's tool_choice are refused)."""

    type: Literal["function"]
    name: str


ToolChoice = Union[Literal["none", "auto", "required"], ToolChoiceFunction]


class TextFormat(Struct, forbid_unknown_fields=True, omit_defaults=True, rename={"schema_": "schema"}):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]] = None
    schema_: Optional[dict[str, Any]] = None
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Struct, forbid_unknown_fields=True):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted, ignored


class ReasoningConfig(Struct, forbid_unknown_fields=True):
    """`effort` none or minimal switches a thinking template's thinking off, the others on."""

    effort: Optional[m.ReasoningEffort] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # accepted: verity gives the text, no summary
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesStreamOptions(Struct, forbid_unknown_fields=True):
    include_obfuscation: Optional[bool] = None  # accepted: no obfuscation is added


_NullOnly = msgspec.defstruct("_NullOnly", [(n, Any, None) for n in sorted(UNSUPPORTED)])


class ResponsesRequest(_NullOnly, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI Responses fields verity implements, plus its own (`mode`, `thinking`, sampling)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]], None] = None  # a string (a user message) or items
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None  # FunctionTool or HostedTool
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[Annotated[int, Meta(ge=1)]] = None
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[ResponsesStreamOptions] = None
    store: Optional[bool] = None  # null: true, as OpenAI
    background: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[Metadata] = None
    include: Optional[list[Includable]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # prefix reuse is automatic
    prompt_cache_retention: Optional[str] = None
    client_metadata: Optional[dict[str, str]] = None  # Codex's
    service_tier: Optional[Literal["auto", "default"]] = None
    truncation: Optional[Literal["disabled"]] = None  # "auto" would drop input: a long one is refused instead
    # and UNSUPPORTED's fields, null only (top_logprobs: also 0)
    # verity's own
    mode: Optional[m.Mode] = "baseline"
    thinking: Optional[bool] = None
    max_thinking_tokens: Optional[Annotated[int, Meta(ge=0)]] = None
    ignore_eos: Optional[bool] = False
    top_k: Optional[Annotated[int, Meta(ge=0)]] = None
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    seed: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None


@dataclass
class Converted:
    """A Responses request as the worker takes it, and what the gateway keeps of it."""

    request: m.GenerateRequest  # checked and normalized (protocol.schema.check_request)
    turn: list[m.Message]  # this request's input as messages (no instructions): stored for continuations
    tool_positions: list[int] = field(default_factory=list)  # index in `tools` of each function tool offered
    hosted_tools: list[str] = field(default_factory=list)  # types of the tools accepted and not offered


_decoder = msgspec.json.Decoder(ResponsesRequest)


def parse_responses(body: bytes) -> ResponsesRequest:
    """JSON bytes -> a ResponsesRequest whose whole-request rules hold, or RequestInvalid."""
    req = decode_body(body, _decoder, UNSUPPORTED)
    for name in sorted(UNSUPPORTED):
        value = getattr(req, name)
        if value is not None and not (name == "top_logprobs" and type(value) is int and value == 0):
            raise RequestInvalid(f"`{name}` is not supported by verity (only null)", name, "unsupported_parameter")
    if req.input is None or req.input == [] or req.input == "":
        raise RequestInvalid("`input` is required and must not be empty", "input")
    if req.background and req.store is False:
        raise RequestInvalid("`background` needs `store` (a background response is read back by its id)", "store")
    return req


def convert(req: ResponsesRequest, history: list[m.Message]) -> Converted:
    """The GenerateRequest of `req` continuing `history` (a stored conversation; [] for none)."""
    turn = input_messages(req.input)
    tools, positions, hosted = convert_tools(req.tools)
    if not history and not turn:
        raise RequestInvalid("`input` holds no message, function call or function call output (reasoning items are "
                             "left out of the prompt)", "input")
    system = [m.Message("system", req.instructions)] if req.instructions else []
    gen = m.GenerateRequest(
        model=req.model, messages=system + history + turn, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        stream=req.stream, user=req.user, tools=tools, tool_choice=_tool_choice(req.tool_choice, bool(tools)),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_format(req.text),
        mode=req.mode, thinking=req.thinking, reasoning_effort=req.reasoning.effort if req.reasoning else None,
        max_thinking_tokens=req.max_thinking_tokens, ignore_eos=req.ignore_eos)
    try:
        check_request(gen, "chat")
    except RequestInvalid as e:
        raise RequestInvalid(e.message, responses_param(e.param, positions), e.code) from None
    return Converted(gen, turn, positions, hosted)


def _convert(obj: Any, typ: type, where: str):
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise validation_error(str(e), frozenset(), where) from None


def input_messages(value: Union[str, list[dict[str, Any]]]) -> list[m.Message]:
    """`input` as chat messages: a function call joins the assistant turn before it; a call's
    output is a tool message; reasoning items are left out."""
    if isinstance(value, str):
        return [m.Message("user", value)]
    out: list[m.Message] = []
    for i, raw in enumerate(value):
        item = _item(raw, i)
        if isinstance(item, MessageItem):
            out.append(m.Message(item.role, _text(item.content, f"input[{i}].content")))
        elif isinstance(item, FunctionCallItem):
            call = m.ToolCall(item.call_id, m.FunctionCall(item.name, item.arguments))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
            else:
                out.append(m.Message("assistant", None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(m.Message("tool", _text(item.output, f"input[{i}].output"), tool_call_id=item.call_id))
    return out


def _item(raw: Any, i: int) -> InputItem:
    where = f"input[{i}]"
    if not isinstance(raw, dict):
        raise RequestInvalid(f"`{where}` must be an object (an input item)", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    if not isinstance(kind, (str, type(None))):
        raise RequestInvalid(f"`{where}.type` must be a string", f"{where}.type")
    if kind in ITEMS:
        return _convert(raw, ITEMS[kind], where)
    if kind in UNSERVED_ITEMS:
        raise RequestInvalid(f"`{where}`: items of type `{kind}` are not supported by verity", f"{where}.type",
                             "unsupported_content")
    raise RequestInvalid(f"`{where}` has no known `type` (message, function_call, function_call_output, reasoning)",
                         f"{where}.type")


def _text(content: Union[str, list[InputContentPart]], where: str) -> str:
    """Text parts joined by newlines; other parts refused by name."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise RequestInvalid(f"`{where}[{j}]`: content parts of type `{part.type}` are not supported: this "
                                 "server's model reads text only", f"{where}[{j}].type", "unsupported_content")
        value = part.refusal if part.type == "refusal" else part.text
        if value is None:
            key = "refusal" if part.type == "refusal" else "text"
            raise RequestInvalid(f"`{where}[{j}]`: a `{part.type}` part needs its `{key}` string", f"{where}[{j}].{key}")
        texts.append(value)
    return "\n".join(texts)


def convert_tools(raw: Optional[list[dict[str, Any]]]) -> tuple[Optional[list[m.Tool]], list[int], list[str]]:
    """Function tools as chat tools (and their positions in `tools`); hosted tools' types."""
    tools, positions, hosted = [], [], []
    for i, t in enumerate(raw or []):
        kind = t.get("type")
        if not isinstance(kind, str):
            raise RequestInvalid(f"`tools[{i}].type` must be a string", f"tools[{i}].type", "invalid_tools")
        if kind == "function":
            f = _convert(t, FunctionTool, f"tools[{i}]")
            tools.append(m.Tool("function", m.FunctionDef(f.name, f.description, f.parameters, f.strict)))
            positions.append(i)
        elif kind in HOSTED_TOOLS:
            hosted.append(kind)
        else:
            raise RequestInvalid(f"`tools[{i}]`: tools of type `{kind}` are unknown (verity serves `function` tools)",
                                 f"tools[{i}].type", "invalid_tools")
    return tools or None, positions, hosted


def _tool_choice(choice: Optional[ToolChoice], offered: bool) -> Optional[m.ToolChoice]:
    if choice is None or isinstance(choice, str):
        return choice if offered or choice == "required" else None
    return m.NamedToolChoice("function", m.FunctionName(choice.name))


def _format(text: Optional[TextConfig]) -> Optional[m.ResponseFormat]:
    f = text.format if text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return m.ResponseFormat("json_object")
    if not f.name:
        raise RequestInvalid("`text.format` of type `json_schema` needs its `name`", "text.format.name")
    return m.ResponseFormat("json_schema", m.JsonSchemaFormat(f.name, f.description, f.schema_, f.strict))


_RENAMES = ((re.compile(r"^max_tokens\b"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\.schema\b"), "text.format.schema"),
            (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."),
            (re.compile(r"^reasoning_effort\b"), "reasoning.effort"),
            (re.compile(r"^messages\b.*"), "input"))
_TOOL = re.compile(r"^tools\[(\d+)\]\.function\.")


def responses_param(param: Optional[str], tool_positions: list[int]) -> Optional[str]:
    """A chat request's field name (in an error from the schema or the worker) as this request names it."""
    if param is None:
        return None
    tool = _TOOL.match(param)
    if tool and int(tool.group(1)) < len(tool_positions):
        return f"tools[{tool_positions[int(tool.group(1))]}]." + param[tool.end():]
    for pattern, name in _RENAMES:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param
