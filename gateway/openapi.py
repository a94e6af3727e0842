"""GET /openapi.json: the HTTP API, described from the msgspec structs that validate and shape it.

Requests: protocol.messages.GenerateRequest is the one request schema; the chat and completion
operations each take it with the rules protocol.schema.check_request adds (which of `messages`
and `prompt`, the neutral-only OpenAI fields, stop strings) and the rules of this server (its
model, its max_tokens cap, whether joint mode is available). Responses: the structs below are the
shapes gateway/openai_format.py and gateway/app.py build (the tests convert real responses into
them, so the description and the server cannot drift apart unnoticed).

Rules no JSON Schema can state are named in the operation's description: a prompt over the
model's context limit (counted in tokens) is refused with 400 `context_length_exceeded`, and
`max_tokens` and `max_completion_tokens`, when both are given, must be equal.
"""

from __future__ import annotations

import copy
from typing import Literal, Optional

import msgspec
from msgspec import Struct

from protocol import messages as m
from protocol.schema import MAX_STOP_STRINGS, UNSUPPORTED_FIELDS

REF = "#/components/schemas/{name}"
FinishReason = Literal["stop", "length"]


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


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason


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


class Completion(Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: m.RequestMetrics


class ChunkDelta(Struct, omit_defaults=True):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    finish_reason: Optional[FinishReason]


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


class CompletionChunkChoice(Struct):
    index: int
    text: str
    finish_reason: Optional[FinishReason]


class CompletionChunk(Struct, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Optional[Usage] = None
    metrics: Optional[m.RequestMetrics] = None


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


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}


def _sse_event(chunk: str) -> dict:
    """One event of a stream: `data: <chunk or error object>`, the last one `data: [DONE]`."""
    payload = {"anyOf": [{"$ref": REF.format(name=chunk)}, {"$ref": REF.format(name="ErrorResponse")}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": payload}}}}


def _request_schema(base: dict, chat: bool, cap: int, model: Optional[str], joint: bool) -> dict:
    """GenerateRequest's schema narrowed to one endpoint and this server (check_request's rules)."""
    s = copy.deepcopy(base)
    p = s["properties"]
    if chat:
        del p["prompt"]
        p["messages"] = {"type": "array", "minItems": 1, "items": {"$ref": REF.format(name="Message")}}
        s["required"] = ["messages"]
    else:
        del p["messages"]
        p["prompt"] = {"type": "string"}
        s["required"] = ["prompt"]
    for name in ("max_tokens", "max_completion_tokens"):
        p[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": cap}, {"type": "null"}], "default": None}
    if model is not None:
        p["model"] = {"anyOf": [{"enum": [model]}, {"type": "null"}], "default": None}
    if not joint:
        p["mode"] = {"enum": ["baseline"], "default": "baseline",
                     "description": "\"joint\" needs a server started with --draft"}
    p["n"] = {"enum": [1], "default": 1}
    for name in ("presence_penalty", "frequency_penalty"):
        p[name] = {"enum": [0], "default": 0, "description": "accepted at its neutral value only"}
    stop = {"type": "string", "minLength": 1}
    p["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}], "default": None}
    # stream_options only with stream: true
    s["if"] = {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]}
    s["then"] = {"properties": {"stream": {"const": True}}, "required": ["stream"]}
    s["title"] = "ChatCompletionRequest" if chat else "CompletionRequest"
    s["description"] = (
        ("OpenAI chat completion request" if chat else "OpenAI (legacy) completion request")
        + f" as verity takes it. Refused by name: {', '.join(sorted(UNSUPPORTED_FIELDS))}. "
        "Unknown fields are refused too.")
    return s


def describe(cap: int, model: Optional[str], joint: bool, auth: bool, context_limit: Optional[int],
             max_body_bytes: int, request_timeout_s: Optional[float]) -> dict:
    """The OpenAPI 3.1 document of this server."""
    _, components = msgspec.json.schema_components([m.GenerateRequest, *RESPONSE_STRUCTS], ref_template=REF)
    base = components.pop("GenerateRequest")
    components["ChatCompletionRequest"] = _request_schema(base, True, cap, model, joint)
    components["CompletionRequest"] = _request_schema(base, False, cap, model, joint)
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
            "400": _error("the request is invalid; `error.param` names the field"),
            "401": _error("missing or invalid API key"),
            "403": _error("refused `Host` or `Origin` (DNS-rebinding and cross-site protection)"),
            "404": _error("`model` names a model this server does not serve"),
            "413": _error("the body is over the size limit"),
            "429": {**_error("the admission queue is full; retry after `Retry-After` seconds"),
                    "headers": {"Retry-After": {"schema": {"type": "string"}}}},
            "503": _error("the worker is restarting or the server is shutting down"),
            "504": _error("the request reached the server's time limit (--request-timeout-s)"),
        },
    }}


def _get_op(op: str, summary: str, ref: str, errors: dict, sec: list) -> dict:
    return {"get": {"operationId": op, "summary": summary, "security": sec,
                    "responses": {"200": {"description": summary, "content": {
                        "application/json": {"schema": {"$ref": REF.format(name=ref)}}}},
                        **{code: _error(text) for code, text in errors.items()}}}}
