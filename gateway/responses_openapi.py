"""The Responses routes in /openapi.json, from the structs that validate the request
(protocol/responses.py) and shape the answers (gateway/responses_format.py)."""

from __future__ import annotations

from typing import Literal, Optional

import msgspec
from msgspec import Struct

from gateway import responses_format as f
from gateway.openapi_refs import REF, error_response
from protocol import responses as r

ITEMS = (r.MessageItem, r.FunctionCallItem, r.FunctionCallOutputItem, r.ReasoningItem)


class DeletedResponse(Struct):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


def _json(name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _request(s: dict, cap: int, names: tuple[str, ...], joint: bool) -> dict:
    """ResponsesRequest narrowed: its items by type, this server's cap, model and modes."""
    p = s["properties"]
    items = {"anyOf": [_ref(t.__name__) for t in ITEMS]}
    p["input"] = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": items}],
                  "description": "a user message, or input items (a message may omit `type`)"}
    hosted = {"type": "object", "required": ["type"], "properties": {"type": {"enum": sorted(r.HOSTED_TOOLS)}},
              "description": "a tool OpenAI's servers run: accepted, not offered to the model"}
    p["tools"] = {"anyOf": [{"type": "array", "items": {"anyOf": [_ref("FunctionTool"), hosted]}}, {"type": "null"}],
                  "default": None}
    p["max_output_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": cap}, {"type": "null"}],
                              "default": None}
    for name in r.UNSUPPORTED:
        p[name] = {"type": "null", "default": None, "description": "not supported: null only"}
    p["top_logprobs"] = {"enum": [0, None], "default": None, "description": "not supported: null or 0"}
    if names:
        p["model"] = {"anyOf": [{"enum": list(names)}, {"type": "null"}], "default": None}
    if not joint:
        p["mode"] = {"enum": ["baseline", None], "default": "baseline",
                     "description": "\"joint\" needs a server started with --draft"}
    s["required"] = ["input"]
    not_reasoning = {"not": {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}}
    s["allOf"] = [{"if": {"properties": {"background": {"const": True}}, "required": ["background"]},
                   "then": {"properties": {"store": {"enum": [True, None]}}}},
                  {"if": {"properties": {"previous_response_id": {"type": "null"}}},  # absent or null
                   "then": {"properties": {"input": {"anyOf": [{"type": "string"},
                                                               {"type": "array", "contains": not_reasoning}]}}}}]
    s["description"] = ("OpenAI Responses request as verity takes it. Unknown fields are refused by name; so are "
                        f"these unless null: {', '.join(sorted(r.UNSUPPORTED))}.")
    return s


def _part(s: dict) -> dict:
    """Content parts as served: text parts with their text (image, file and audio parts are refused by name)."""
    p = s["properties"]
    p["type"] = {"enum": list(r.TEXT_PARTS)}
    for name in r.REFUSED_PART_FIELDS:
        p[name] = {"type": "null", "default": None}
    s["allOf"] = [{"if": {"properties": {"type": {"const": "refusal"}}},
                   "then": {"required": ["refusal"], "properties": {"refusal": {"type": "string"}}},
                   "else": {"required": ["text"], "properties": {"text": {"type": "string"}}}}]
    s["description"] = "a text part; image, file and audio parts are refused with 400 `unsupported_content`"
    return s


def _create_op(limits: str, security: list) -> dict:
    events = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string", "description": "the data's `type`"},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref("StreamEvent")}}}
    return {"post": {
        "operationId": "createResponse", "summary": "Generate a response", "security": security,
        "description": limits + " `previous_response_id` continues a stored response (404 when unknown or evicted).",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ResponsesRequest")}}},
        "responses": {
            "200": {"description": "The response object (with `background`: as queued), or with `stream`: true "
                                   "typed events, `sequence_number` from 0, ended by response.completed, "
                                   ".incomplete or .failed",
                    "links": {name: {"operationId": op, "parameters": {"id": "$response.body#/id"}}
                              for name, op in (("GetResponse", "retrieveResponse"), ("CancelResponse", "cancelResponse"),
                                               ("DeleteResponse", "deleteResponse"))},
                    "content": {"application/json": {"schema": _ref("ResponseObject")},
                                "text/event-stream": {"itemSchema": events}}},
            "400": error_response("the request is invalid; `error.param` names the field"),
            "401": error_response("missing or invalid API key"),
            "403": error_response("refused `Host` or `Origin`"),
            "404": error_response("`model` is not served, or `previous_response_id` is unknown or evicted"),
            "413": error_response("the body is over the size limit"),
            "429": error_response("the admission queue is full; retry after `Retry-After` seconds"),
            "503": error_response("the worker is restarting or the server is shutting down"),
            "504": error_response("the request reached the server's time limit"),
        }}}


def _id_op(method: str, op: str, summary: str, ok: dict, security: list, extra: Optional[dict] = None) -> dict:
    param = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {method: {"operationId": op, "summary": summary, "security": security, "parameters": [param],
                     "responses": {"200": ok, "404": error_response("unknown, deleted, not stored or evicted"),
                                   "403": error_response("refused `Host` or `Origin`"),
                                   **({"401": error_response("missing or invalid API key")} if security else {}),
                                   **(extra or {})}}}


def add_responses(doc: dict, cap: int, names: tuple[str, ...], joint: bool, limits: str, security: list) -> None:
    """Adds the Responses routes and their schemas to an OpenAPI document."""
    _, comps = msgspec.json.schema_components([r.ResponsesRequest, *ITEMS, r.FunctionTool, f.ResponseObject,
                                               f.StreamEvent, DeletedResponse], ref_template=REF)
    comps["ResponsesRequest"] = _request(comps["ResponsesRequest"], cap, names, joint)
    comps["InputContentPart"] = _part(comps["InputContentPart"])
    comps["TextFormat"]["allOf"] = [{"if": {"properties": {"type": {"const": "json_schema"}}},
                                     "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}}]
    events = msgspec.json.schema(f.StreamEvent, ref_template=REF)
    comps["StreamEvent"] = {k: v for k, v in events.items() if k != "$defs"}
    schemas = doc["components"]["schemas"]
    for name, schema in comps.items():
        schemas.setdefault(name, schema)
    paths = doc["paths"]
    paths["/v1/responses"] = _create_op(limits, security)
    paths["/v1/responses/{id}"] = {
        **_id_op("get", "retrieveResponse", "A stored (or running) response", _json("ResponseObject", "the response"),
                 security),
        **_id_op("delete", "deleteResponse", "Forget a stored response (a running one is cancelled)",
                 _json("DeletedResponse", "deleted"), security)}
    paths["/v1/responses/{id}/cancel"] = _id_op(
        "post", "cancelResponse", "Cancel a running response", _json("ResponseObject", "the response as cancelled"),
        security, {"400": error_response("the response is not running")})
