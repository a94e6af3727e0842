"""GET /openapi.json: the HTTP API, described from the msgspec structs that validate and shape it.

Requests: protocol.messages.GenerateRequest is the one request schema; the chat and completion
operations each take it with the rules protocol.schema.check_request adds (which of `messages`
and `prompt`, the neutral-only OpenAI fields, stop strings) and the rules of this server (its
model, its max_tokens cap, whether joint mode is available). Responses: the structs below are the
shapes gateway/openai_format.py and gateway/app.py build (the tests convert real responses into
them, so the description and the server cannot drift apart unnoticed).

Rules no JSON Schema can state are named in the operation's description: a prompt over the
model's context limit (counted in tokens) is refused with 400 `context_length_exceeded`;
`max_tokens` and `max_completion_tokens`, when both are given, must be equal; a JSON schema the
grammar cannot enforce is refused with 400 `invalid_schema`, and tool fields that do not agree
(a `tool_choice` naming no tool in `tools`, two tools of one name, a tool message without its
`tool_call_id`) with 400 `invalid_tools`.
"""

from __future__ import annotations

import copy
from typing import Literal, Optional

import msgspec
from msgspec import Struct

from gateway import messages_openapi, small
from gateway.openapi_refs import REF, error_response
from gateway.responses_openapi import add_responses
from protocol import messages as m
from protocol.schema import MAX_STOP_STRINGS, NULL_ONLY, UNSUPPORTED_FIELDS

FinishReason = Literal["stop", "length", "tool_calls"]


class ErrorDetail(Struct):
    message: str
    type: str
    param: Optional[str]
    code: str


class ErrorResponse(Struct):
    """Every refusal and failure: an OpenAI error object (also the one `data:` event of a stream
    that fails after it started, followed by `data: [DONE]`)."""

    error: ErrorDetail


class PromptTokensDetails(Struct):
    cached_tokens: int


class CompletionTokensDetails(Struct):
    reasoning_tokens: int  # inside a thinking model's think block (0 for the others)


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class AssistantMessage(Struct, omit_defaults=True):
    """`content` is null when the reply is only tool calls (`finish_reason` "tool_calls"). A
    thinking model's think block is in both `reasoning_content` and `reasoning` (the two names
    clients read), never in `content`; they are absent for a model that does not think."""

    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[m.ToolCall]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatLogprobs(Struct):
    """With `logprobs`: each emitted token's log-probability under the target (after penalties
    and logit_bias, before temperature and truncation) and `top_logprobs` alternatives."""

    content: list[m.TokenLogprob]
    refusal: Optional[str] = None


class CompletionLogprobs(Struct):
    """The legacy shape: with `logprobs: N`, N alternatives per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletion(Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: m.RequestMetrics


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: Optional[CompletionLogprobs] = None


class Completion(Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: m.RequestMetrics


class ChunkFunction(Struct, omit_defaults=True):
    name: Optional[str] = None  # in a call's first piece
    arguments: str = ""  # a piece of the arguments' JSON text; the pieces add up to it


class ChunkToolCall(Struct, omit_defaults=True):
    """A piece of a streamed tool call: its first carries `id`, `type` and the function's name
    (arguments ""), the next ones pieces of its arguments as they are generated."""

    index: int
    function: ChunkFunction
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None


class ChunkDelta(Struct, omit_defaults=True):
    """A thinking model streams its think block as `reasoning_content` and `reasoning` (the same
    text), then its answer as `content`."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ChunkToolCall]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    finish_reason: Optional[FinishReason]
    logprobs: Optional[ChatLogprobs] = None


class TokenOrigin(Struct):
    """verity's extension of a joint request's stream chunks (OpenAI clients ignore it): one entry
    per token of the chunk, true where the draft proposed it and the target accepted it, false
    where the target chose it (a correction, or a cycle that drafted nothing)."""

    drafted: list[bool]


class ChatCompletionChunk(Struct, omit_defaults=True):
    """One `data:` event of a chat stream; the last one before `[DONE]` carries `usage` when
    `stream_options.include_usage` is set (with empty `choices`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    metrics: Optional[m.RequestMetrics] = None
    verity: Optional[TokenOrigin] = None


class CompletionChunkChoice(Struct):
    index: int
    text: str
    finish_reason: Optional[FinishReason]
    logprobs: Optional[CompletionLogprobs] = None


class CompletionChunk(Struct, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Optional[Usage] = None
    metrics: Optional[m.RequestMetrics] = None
    verity: Optional[TokenOrigin] = None


class ModelCard(Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Struct):
    object: Literal["list"]
    data: list[ModelCard]


class WorkerHealth(Struct):
    active: int
    queue_depth: int
    tokens_per_s: float
    time: float
    requests_total: int
    requests_finished: int


class Health(Struct):
    status: Literal["ok", "draining", "unavailable"]
    model: Optional[str]
    worker_pid: Optional[int]
    worker_restarts: int
    admitted: int
    waiting: int
    worker: Optional[WorkerHealth]


RESPONSE_STRUCTS = (ErrorResponse, ChatCompletion, Completion, ChatCompletionChunk, CompletionChunk,
                    ModelList, ModelCard, Health)


def _sse_event(chunk: str) -> dict:
    """One event of a stream: `data: <chunk or error object>`, the last one `data: [DONE]`."""
    payload = {"anyOf": [{"$ref": REF.format(name=chunk)}, {"$ref": REF.format(name="ErrorResponse")}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": payload}}}}


_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_PROMPT = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                     _IDS, {"type": "array", "minItems": 1, "items": _IDS}],
           "description": "a string, strings, token ids or lists of token ids (each prompt its choices; "
                          "token ids within the model's vocabulary)"}
_PART = {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["text", "refusal"]}, "text": {"type": ["string", "null"]},
                        "refusal": {"type": ["string", "null"]}, "image_url": {"type": "null"},
                        "input_audio": {"type": "null"}, "file": {"type": "null"}},
         "allOf": [{"if": {"properties": {"type": {"const": kind}}},
                    "then": {"properties": {kind: {"type": "string"}}, "required": [kind]}} for kind in ("text", "refusal")],
         "description": "a text part (or a refusal, read as text); image, audio and file parts are refused by name"}


# what protocol/tool_rules.py checks of a message: tool_call_id on tool messages only, tool_calls on assistant ones
_MESSAGE_RULES = [
    {"if": {"properties": {"role": {"const": "tool"}}},
     "then": {"properties": {"tool_call_id": {"type": "string"}}, "required": ["tool_call_id"]},
     "else": {"properties": {"tool_call_id": {"type": "null"}}}},
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
     "then": {"properties": {"tool_calls": {"type": "null"}, "reasoning_content": {"type": "null"},
                             "reasoning": {"type": "null"}}}},
]


def _nullable(schema: dict, description: str = "") -> dict:
    return {"anyOf": [schema, {"type": "null"}], "default": None, **({"description": description} if description else {})}


def _sampling_fields(p: dict, chat: bool) -> list[dict]:
    """Fields whose JSON Schema msgspec cannot narrow to what this endpoint takes; returns the
    rules between fields."""
    p["n"] = _nullable({"type": "integer", "minimum": 1, "maximum": m.MAX_N},
                       "choices per prompt (prompts × n within what the server admits at once)")
    if chat:
        p["logprobs"] = _nullable({"type": "boolean"})
        p["echo"] = _nullable({"const": False}, "completions only")
    else:
        p["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": 5}, "alternatives per token")
        p["top_logprobs"] = {"type": "null", "default": None, "description": "chat only; completions take logprobs: N"}
        p["echo"] = _nullable({"type": "boolean"})
    for name, neutral in NULL_ONLY.items():
        p[name] = _nullable({"const": neutral}, "accepted at its neutral value only") if neutral is not None else {
            "type": "null", "default": None, "description": "not supported: null only"}
    # stream_options only with stream: true; top_logprobs only with logprobs: true
    rules = [{"if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
              "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]}}]
    if chat:
        rules.append({"if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
                      "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})
    else:
        rules.append({"if": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
                      "then": {"properties": {"logprobs": {"type": "null"}}}})
    return rules


def _request_schema(base: dict, chat: bool, cap: int, model: tuple[str, ...], joint: bool) -> dict:
    """GenerateRequest's schema narrowed to one endpoint and this server (check_request's rules)."""
    s = copy.deepcopy(base)
    p = s["properties"]
    if chat:
        del p["prompt"]
        p["messages"] = {"type": "array", "minItems": 1, "items": {"$ref": REF.format(name="Message")}}
        s["required"] = ["messages"]
    else:
        del p["messages"]
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            p[name] = {"type": "null", "default": None, "description": "chat completions only"}
        p["prompt"] = _PROMPT
        s["required"] = ["prompt"]
    for name in ("max_tokens", "max_completion_tokens"):
        p[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": cap}, {"type": "null"}], "default": None}
    if model:
        p["model"] = {"anyOf": [{"enum": list(model)}, {"type": "null"}], "default": None,
                      "description": "the model's id or one of its --served-model-name aliases"}
    if not joint:
        p["mode"] = {"enum": ["baseline", None], "default": "baseline",
                     "description": "\"joint\" needs a server started with --draft"}
    if chat:
        p["tools"] = {"anyOf": [{"type": "array", "minItems": 1, "items": {"$ref": REF.format(name="Tool")}},
                                {"type": "null"}], "default": None}
    rules = _sampling_fields(p, chat)
    stop = {"type": "string", "minLength": 1}
    p["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}], "default": None}
    s["allOf"] = rules
    s["title"] = "ChatCompletionRequest" if chat else "CompletionRequest"
    s["description"] = (
        ("OpenAI chat completion request" if chat else "OpenAI (legacy) completion request")
        + f" as verity takes it. Refused by name unless null (or neutral): {', '.join(sorted(UNSUPPORTED_FIELDS))}. "
        "Unknown fields are refused too.")
    return s


def describe(cap: int, model: Optional[str], joint: bool, auth: bool, context_limit: Optional[int],
             max_body_bytes: int, request_timeout_s: Optional[float], aliases: tuple[str, ...] = ()) -> dict:
    """The OpenAPI 3.1 document of this server."""
    names = (model, *aliases) if model else ()
    _, components = msgspec.json.schema_components([m.GenerateRequest, *RESPONSE_STRUCTS, *small.STRUCTS],
                                                   ref_template=REF)
    base = components.pop("GenerateRequest")
    components["ContentPart"] = _PART
    components["Message"]["allOf"] = _MESSAGE_RULES
    components["ChatCompletionRequest"] = _request_schema(base, True, cap, names, joint)
    components["CompletionRequest"] = _request_schema(base, False, cap, names, joint)
    small.narrow(components, components["ChatCompletionRequest"]["properties"]["model"] if names else None, REF)
    limits = _limits(context_limit, max_body_bytes, request_timeout_s)
    security = [{"bearer": []}] if auth else []
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "verity", "version": str(m.PROTOCOL_VERSION),
                 "description": "A local OpenAI-compatible server for one MLX model. " + limits},
        "paths": _paths(limits, security, auth),
        "components": {"schemas": components},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    messages_openapi.add(doc, names, joint, auth, REF)  # Anthropic's Messages API
    add_responses(doc, cap, names, joint, limits, security)
    return doc


def _limits(context_limit: Optional[int], max_body_bytes: int, request_timeout_s: Optional[float]) -> str:
    limits = ("Integers are written as integers (5, not 5.0). "
              f"Bodies over {max_body_bytes} bytes are refused with 413. Prompts over the model's context "
              f"limit ({context_limit if context_limit else 'per model'} tokens) are refused with 400 "
              "`context_length_exceeded`. When both `max_tokens` and `max_completion_tokens` are "
              "given they must be equal.")
    if request_timeout_s:
        limits += (f" A request that has not ended {request_timeout_s:g} s after admission is cancelled "
                   "and answered with 504 `request_timeout` (in a stream: an error event).")
    return limits


def _paths(limits: str, security: list, auth: bool) -> dict:
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    auth_errors = {"401": "missing or invalid API key"} if auth else {}
    paths = {
        "/v1/chat/completions": _generate_op(True, limits, security),
        "/v1/completions": _generate_op(False, limits, security),
        "/v1/models": _get_op("listModels", "The model this server serves", "ModelList",
                              {**auth_errors, "403": "refused Host or Origin", "503": "the worker is not ready"}, security),
        "/v1/models/{model}": _get_op("retrieveModel", "One model", "ModelCard",
                                      {**auth_errors, "403": "refused Host or Origin", "404": "no such model",
                                       "503": "the worker is not ready"}, security),
        "/health": _get_op("health", "Liveness and load; 503 while the worker is down or the server drains",
                           "Health", {"403": "refused Host or Origin", "503": "not ready (the body says why)"}, []),
    }
    paths["/v1/models/{model}"]["get"]["parameters"] = [model_param]
    paths.update(small.openapi_paths(REF, error_response, security))
    paths["/health"]["get"]["responses"]["503"] = {
        "description": "not serving now", "content": {"application/json": {"schema": {"$ref": REF.format(name="Health")}}}}
    return paths


def _generate_op(chat: bool, limits: str, security: list) -> dict:
    whole, chunk = ("ChatCompletion", "ChatCompletionChunk") if chat else ("Completion", "CompletionChunk")
    return {"post": {
        "operationId": "createChatCompletion" if chat else "createCompletion",
        "summary": "Generate a chat reply" if chat else "Continue a prompt",
        "description": limits,
        "security": security,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "$ref": REF.format(name="ChatCompletionRequest" if chat else "CompletionRequest")}}}},
        "responses": {
            "200": {"description": f"The whole {whole} object, or with `stream: true` a server-sent "
                                   f"event stream of `data: <{chunk}>` lines ended by `data: [DONE]`",
                    "headers": {"X-Request-Id": {"schema": {"type": "string"},
                                                 "description": "the request id, also in the logs"}},
                    "content": {"application/json": {"schema": {"$ref": REF.format(name=whole)}},
                                "text/event-stream": {"itemSchema": _sse_event(chunk)}}},
            "400": error_response("the request is invalid; `error.param` names the field"),
            "401": error_response("missing or invalid API key"),
            "403": error_response("refused `Host` or `Origin` (DNS-rebinding and cross-site protection)"),
            "404": error_response("`model` names a model this server does not serve"),
            "413": error_response("the body is over the size limit"),
            "429": {**error_response("the admission queue is full; retry after `Retry-After` seconds"),
                    "headers": {"Retry-After": {"schema": {"type": "string"}}}},
            "503": error_response("the worker is restarting or the server is shutting down"),
            "504": error_response("the request reached the server's time limit (--request-timeout-s)"),
        },
    }}


def _get_op(op: str, summary: str, ref: str, errors: dict, sec: list) -> dict:
    return {"get": {"operationId": op, "summary": summary, "security": sec,
                    "responses": {"200": {"description": summary, "content": {
                        "application/json": {"schema": {"$ref": REF.format(name=ref)}}}},
                        **{code: error_response(text) for code, text in errors.items()}}}}
