"""Small endpoints agents and tools use: POST /tokenize and /detokenize (vLLM's shapes; the worker
owns the tokenizer and answers over the jobs socket) and cancelling a running completion by its
id, `POST /v1/chat/completions/{id}/cancel` (the shape of OpenAI's `/v1/responses/{id}/cancel`).

The structs here validate the bodies and describe them in /openapi.json (gateway/openapi.py).
"""

from __future__ import annotations

import uuid
from typing import Callable, Literal, Optional

import msgspec
from aiohttp import web
from msgspec import Struct

from gateway.link import WorkerLink
from gateway.relay import json_error
from protocol import messages as m
from protocol.schema import RequestInvalid, check_request, decode_body

AUTH_PATHS = ("/tokenize", "/detokenize")  # outside /v1/, yet behind the API key like it
CALL_TIMEOUT_S = 30.0  # a tokenize the worker does not answer (it died, it restarts): 503


class TokenizeRequest(Struct, forbid_unknown_fields=True):
    """`prompt` as text, or `messages` through the chat template as chat completions render them
    (with `tools` and the thinking controls); exactly one of the two."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[m.Message]] = None
    add_generation_prompt: bool = True  # messages: end with the assistant turn's opening
    add_special_tokens: Optional[bool] = None  # null: true for a prompt, false for messages (the template writes them)
    tools: Optional[list[m.Tool]] = None
    thinking: Optional[bool] = None
    chat_template_kwargs: Optional[m.ChatTemplateKwargs] = None
    return_token_strs: bool = False  # each token's own text in `token_strs`


class TokenizeResponse(Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(Struct, forbid_unknown_fields=True):
    tokens: list[m.TokenId]
    model: Optional[str] = None


class DetokenizeResponse(Struct):
    prompt: str


class CancelResponse(Struct):
    """The request was running or waiting: it stops now (its stream ends, its rows are freed)."""

    id: str
    object: Literal["chat.completion", "text_completion"]
    status: Literal["cancelled"]
    choices: int  # of its choices, those that were still running or waiting


_tokenize = msgspec.json.Decoder(TokenizeRequest)
_detokenize = msgspec.json.Decoder(DetokenizeRequest)


class SmallEndpoints:
    """The routes, on the gateway's link to the worker; `names`: the model's served names."""

    def __init__(self, link: WorkerLink, names: Callable[[], tuple[str, ...]]):
        self.link, self.names = link, names

    def register(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/chat/completions/{id}/cancel", self.cancel)
        app.router.add_post("/v1/completions/{id}/cancel", self.cancel)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = decode_body(await request.read(), _tokenize)
            job = _tokenize_job(body)
        except RequestInvalid as e:
            return json_error(400, e.message, e.code, e.param)
        got = await self._ask(job, body.model)
        if not isinstance(got, m.Tokens):
            return got
        return web.json_response(msgspec.to_builtins(TokenizeResponse(
            len(got.tokens), self.link.worker.context_limit, got.tokens, got.token_strs)))

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = decode_body(await request.read(), _detokenize)
        except RequestInvalid as e:
            return json_error(400, e.message, e.code, e.param)
        got = await self._ask(m.TokenizeJob(_job_id(), tokens=body.tokens), body.model)
        if not isinstance(got, m.Tokens):
            return got
        return web.json_response(msgspec.to_builtins(DetokenizeResponse(got.text)))

    async def _ask(self, job: m.TokenizeJob, model: Optional[str]):
        """The worker's Tokens, or the error response to send."""
        if not self.link.ready:
            return json_error(503, "the worker is not ready; retry shortly", "worker_unavailable")
        if model is not None and model not in self.names():
            return json_error(404, f"model `{model}` does not exist", "model_not_found", "model")
        got = await self.link.call(job, CALL_TIMEOUT_S)
        if isinstance(got, m.Error):
            return json_error(got.status, got.message, got.code, got.param)
        return got

    async def cancel(self, request: web.Request) -> web.Response:
        """Stops a running or waiting completion (every choice of it); 404 for an id that is not
        running (unknown, or already ended)."""
        rid = request.match_info["id"]
        chat = request.path.startswith("/v1/chat/")
        prefix = "chatcmpl-" if chat else "cmpl-"
        ids = [t for t in list(self.link.requests) if rid.startswith(prefix) and (t == rid or t.startswith(rid + "-"))]
        if not ids:
            return json_error(404, f"no running {'chat completion' if chat else 'completion'} has the id `{rid}` "
                                "(unknown, or it has ended)", "not_found", "id")
        for t in ids:
            self.link.cancel(t, reason="the request was cancelled by its id")
        return web.json_response(msgspec.to_builtins(CancelResponse(
            rid, "chat.completion" if chat else "text_completion", "cancelled", len(ids))))


def _job_id() -> str:
    return "tok-" + uuid.uuid4().hex


def _tokenize_job(body: TokenizeRequest) -> m.TokenizeJob:
    """The checked job: messages go through the chat request's rules (roles, parts, tools, thinking)."""
    if (body.prompt is None) == (body.messages is None):
        raise RequestInvalid("give exactly one of `prompt` (text) and `messages` (a chat)",
                             "messages" if body.messages is not None else "prompt", "prompt_or_messages")
    if body.messages is not None:
        req = check_request(m.GenerateRequest(messages=body.messages, tools=body.tools, thinking=body.thinking,
                                              chat_template_kwargs=body.chat_template_kwargs), "chat")
        special = bool(body.add_special_tokens)
    else:
        stray = next((k for k in ("tools", "thinking", "chat_template_kwargs") if getattr(body, k) is not None), None)
        if stray:
            raise RequestInvalid(f"`{stray}` applies to `messages` only", stray, "prompt_or_messages")
        req, special = m.GenerateRequest(prompt=body.prompt), body.add_special_tokens is not False
    return m.TokenizeJob(_job_id(), req, body.add_generation_prompt, special, token_strs=body.return_token_strs)


STRUCTS = (TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, CancelResponse)


def narrow(components: dict, model: Optional[dict], ref: str) -> None:
    """The request schemas as the handlers check them: `model` this server's names; exactly one
    of `prompt` and `messages` (a non-empty list); tools and thinking with messages only."""
    t, d = components["TokenizeRequest"], components["DetokenizeRequest"]
    if model is not None:
        t["properties"]["model"] = d["properties"]["model"] = model
    t["properties"]["messages"] = {"anyOf": [{"type": "array", "minItems": 1, "items": {"$ref": ref.format(name="Message")}},
                                             {"type": "null"}], "default": None}
    given = lambda name: {"required": [name], "properties": {name: {"not": {"type": "null"}}}}  # noqa: E731
    t["oneOf"] = [{**given("prompt"), "not": given("messages")}, {**given("messages"), "not": given("prompt")}]
    t["allOf"] = [{"if": given("prompt"), "then": {"properties": {k: {"type": "null"} for k in
                                                                   ("tools", "thinking", "chat_template_kwargs")}}}]


def openapi_paths(ref: str, error: Callable[[str], dict], security: list) -> dict:
    """These routes' OpenAPI operations (`ref`: the components' $ref template; `error`: an error
    response described)."""
    def op(op_id: str, summary: str, body: Optional[str], answer: str, errors: dict) -> dict:
        out = {"operationId": op_id, "summary": summary, "security": security, "responses": {
            "200": {"description": summary, "content": {"application/json": {"schema": {"$ref": ref.format(name=answer)}}}},
            **{code: error(text) for code, text in errors.items()}}}
        if body:
            out["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": ref.format(name=body)}}}}
        return {"post": out}

    common = {"401": "missing or invalid API key", "404": "`model` names a model this server does not serve",
              "503": "the worker is not ready"}
    cancel = op("cancelCompletion", "Stop a running completion by its id (every choice of it)", None, "CancelResponse",
                {"401": "missing or invalid API key", "404": "no running completion has this id"})
    cancel["post"]["parameters"] = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    completion_cancel = {"post": {**cancel["post"], "operationId": "cancelLegacyCompletion"}}
    return {
        "/tokenize": op("tokenize", "Token ids of a prompt, or of messages through the chat template",
                        "TokenizeRequest", "TokenizeResponse", {"400": "the request is invalid", **common}),
        "/detokenize": op("detokenize", "The text of token ids", "DetokenizeRequest", "DetokenizeResponse",
                          {"400": "a token id outside the vocabulary", **common}),
        "/v1/chat/completions/{id}/cancel": cancel,
        "/v1/completions/{id}/cancel": completion_cancel,
    }
