"""Decoding and checking of the one request schema, with errors that name the field."""

from __future__ import annotations

import itertools
import re
from typing import Literal, Optional

import msgspec

from protocol.messages import THINKING_OFF_EFFORTS, GenerateRequest
from protocol.tool_rules import check_tools

# OpenAI fields verity does not implement: null (or the neutral value) is accepted, anything else
# refused by name, never silently ignored.
NULL_ONLY = {"audio": None, "modalities": None, "prediction": None,
             "web_search_options": None, "best_of": 1, "store": False, "service_tier": "auto", "suffix": "",
             "functions": None, "function_call": None, "verbosity": None}
UNSUPPORTED_FIELDS = frozenset(NULL_ONLY)
SERVED_PARTS = ("text", "refusal")  # content part types; image, audio and file parts are refused by name
MAX_STOP_STRINGS = 4
# JSON nesting read at most: checked on the raw bytes before anything recursive runs (msgspec's
# decoder and every later walk recurse: 3,000 levels overflowed Python's stack, a 500). A schema's
# level takes two (an object, its `properties`), so 128 leaves some 60 schema levels.
MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the four, to delete

Endpoint = Literal["chat", "completion"]
_decoder = msgspec.json.Decoder(GenerateRequest)
_PATH_RE = re.compile(r" - at `(?:key` in `)?\$\.?([^`]*)`$")  # "key in": a dict's key
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]*)`")


class RequestInvalid(Exception):
    """A request the schema refuses; maps to an OpenAI error object with HTTP 400."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def parse_request(body: bytes, endpoint: Endpoint) -> GenerateRequest:
    """JSON bytes -> a checked, normalized GenerateRequest, or RequestInvalid."""
    return check_request(decode_body(body, _decoder), endpoint)


def decode_body(body: bytes, decoder: msgspec.json.Decoder, unsupported: frozenset = UNSUPPORTED_FIELDS):
    """JSON bytes -> the decoder's struct, or RequestInvalid naming the field (every route's;
    `unsupported`: the top-level fields refused as not supported rather than unknown)."""
    try:
        body.decode("utf-8")  # msgspec versions report bad UTF-8 differently: check it first
    except UnicodeDecodeError as e:
        raise RequestInvalid(f"request body is not valid UTF-8: {e.reason} at byte {e.start}", code="invalid_json") from None
    check_depth(body)
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as e:
        raise validation_error(str(e), unsupported) from None
    except msgspec.DecodeError as e:
        raise RequestInvalid(f"request body is not valid JSON: {e}", code="invalid_json") from None
    try:  # free-form JSON (a tool's schema, an ignored part's field) may hold what the wire cannot carry
        msgspec.msgpack.encode(req)
    except OverflowError:
        raise RequestInvalid("the request holds an integer beyond 64 bits", code="integer_out_of_range") from None
    return req


def json_depth(body: bytes) -> int:
    """How deep a JSON text nests (its strings skipped), without recursion: its brackets as +1
    and -1, summed as they come, at C speed."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _BRACKETS)
    steps = brackets.translate(bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff"))
    return max(itertools.accumulate(memoryview(steps).cast("b")), default=0)


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """A 400 naming the limit for a body nested deeper than `limit` (few brackets: nothing to scan)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    depth = json_depth(body)
    if depth > limit:
        raise RequestInvalid(f"the request body nests {depth} levels deep; this server reads JSON nested at most "
                             f"{limit} levels", code="json_too_deep")


def validation_error(text: str, unsupported: frozenset = UNSUPPORTED_FIELDS, prefix: str = "") -> RequestInvalid:
    """msgspec's message -> a RequestInvalid naming the field; `prefix`: where the value checked sits."""
    path = _PATH_RE.search(text)
    param = (path.group(1).replace("[...]", "") if path else None) or None  # "[...]": a dict's value
    if prefix:
        param = prefix + ("" if not param else param if param.startswith("[") else "." + param)
    unknown = _UNKNOWN_RE.match(text)
    if unknown:
        name = unknown.group(1)
        full = f"{param}.{name}" if param else name
        if not param and name in unsupported:
            return RequestInvalid(f"`{name}` is not supported by verity", full, "unsupported_parameter")
        return RequestInvalid(f"unknown field `{full}`", full, "unknown_parameter")
    rule = _PATH_RE.sub("", text)
    return RequestInvalid(f"invalid `{param or 'body'}`: {rule}", param)


def check_request(req: GenerateRequest, endpoint: Endpoint) -> GenerateRequest:
    """Rules that span fields or that types cannot say; normalizes max_tokens and stop."""
    _check_endpoint(req, endpoint)
    _normalize_nulls(req)
    a, b = req.max_tokens, req.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise RequestInvalid(
            f"`max_tokens` ({a}) and its alias `max_completion_tokens` ({b}) differ", "max_completion_tokens"
        )
    req.max_tokens, req.max_completion_tokens = (a if a is not None else b), None
    _check_logprobs(req, endpoint)
    resolve_thinking(req)
    check_tools(req, endpoint == "chat", RequestInvalid)
    if isinstance(req.stop, str):
        req.stop = [req.stop]
    if req.stop is not None:
        if len(req.stop) > MAX_STOP_STRINGS:
            raise RequestInvalid(f"`stop` takes at most {MAX_STOP_STRINGS} strings", "stop")
        if any(s == "" for s in req.stop):
            raise RequestInvalid("`stop` strings must not be empty", "stop")
    if req.stream_options is not None and not req.stream:
        raise RequestInvalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    return req


def _check_endpoint(req: GenerateRequest, endpoint: Endpoint) -> None:
    if endpoint == "chat":
        if req.prompt is not None:
            raise RequestInvalid("`prompt` belongs to /v1/completions; chat takes `messages`", "prompt")
        if not req.messages:
            raise RequestInvalid("`messages` is required and must not be empty", "messages")
        for i, msg in enumerate(req.messages):
            _check_message(msg, i)
        if req.echo:
            raise RequestInvalid("`echo` belongs to /v1/completions", "echo")
    else:
        if req.messages is not None:
            raise RequestInvalid("`messages` belongs to /v1/chat/completions; completions take `prompt`", "messages")
        if req.prompt is None:
            raise RequestInvalid("`prompt` is required", "prompt")
        split_prompts(req.prompt)  # checks the list's shape
    for name, neutral in NULL_ONLY.items():
        value = getattr(req, name)
        if value is not None and value != neutral:
            raise RequestInvalid(f"`{name}` is not supported by verity (only null{'' if neutral is None else f' or {neutral!r}'})",
                                 name, "unsupported_parameter")


def _check_message(msg, i: int) -> None:
    """Content parts: text and refusal only (a refusal part reads as text). A null content reads
    as empty text (an assistant turn of tool calls or a refusal has none)."""
    for name in ("reasoning_content", "reasoning"):
        if getattr(msg, name) is not None and msg.role != "assistant":
            raise RequestInvalid(f"`messages[{i}].{name}`: only an assistant turn carries thinking", f"messages[{i}].{name}")
    if msg.content is None or isinstance(msg.content, str):
        return
    where = f"messages[{i}].content"
    for j, part in enumerate(msg.content):
        if part.type not in SERVED_PARTS:
            raise RequestInvalid(f"`{where}[{j}]`: content parts of type `{part.type}` are not supported: this "
                                 "server's model reads text only", f"{where}[{j}].type", "unsupported_content")
        stray = next((k for k in ("image_url", "input_audio", "file") if getattr(part, k) is not None), None)
        if stray:
            raise RequestInvalid(f"`{where}[{j}]`: `{stray}` belongs to a part of type `{stray}`, not `{part.type}`",
                                 f"{where}[{j}].{stray}")
        value = part.text if part.type == "text" else part.refusal
        if value is None:
            raise RequestInvalid(f"`{where}[{j}]`: a `{part.type}` part needs its `{part.type}` string",
                                 f"{where}[{j}].{part.type}")


def resolve_thinking(req: GenerateRequest) -> None:
    """`thinking`, `chat_template_kwargs.enable_thinking` and `reasoning_effort` (none/minimal: off,
    the others on) into `thinking` alone; two that disagree are refused by name."""
    kwargs = req.chat_template_kwargs
    said = [("thinking", req.thinking),
            ("chat_template_kwargs.enable_thinking", kwargs.enable_thinking if kwargs else None),
            ("reasoning_effort", None if req.reasoning_effort is None else req.reasoning_effort not in THINKING_OFF_EFFORTS)]
    given = [(name, v) for name, v in said if v is not None]
    for name, v in given[1:]:
        if v != given[0][1]:
            raise RequestInvalid(f"`{name}` ({'on' if v else 'off'}) contradicts `{given[0][0]}` "
                                 f"({'on' if given[0][1] else 'off'})", name, "conflicting_thinking_controls")
    req.thinking = given[0][1] if given else None
    req.chat_template_kwargs = None


def _normalize_nulls(req: GenerateRequest) -> None:
    """A null for a field with a fixed default means that default."""
    req.n = 1 if req.n is None else req.n
    req.stream, req.echo, req.ignore_eos = bool(req.stream), bool(req.echo), bool(req.ignore_eos)
    req.mode = req.mode or "baseline"


def _check_logprobs(req: GenerateRequest, endpoint: Endpoint) -> None:
    lp = req.logprobs
    if endpoint == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise RequestInvalid("`logprobs` of a chat request is true or false (alternatives: `top_logprobs`)", "logprobs")
        if req.top_logprobs is not None and not lp:
            raise RequestInvalid("`top_logprobs` needs `logprobs`: true", "top_logprobs")
    else:
        if isinstance(lp, bool):
            raise RequestInvalid("`logprobs` of a completion request is an integer 0-5 (alternatives per token)", "logprobs")
        if req.top_logprobs is not None:
            raise RequestInvalid("`top_logprobs` belongs to chat; completions take `logprobs`: N", "top_logprobs")
        if lp is not None and req.echo:
            raise RequestInvalid("`logprobs` with `echo` (the prompt's log-probabilities) is not supported by verity",
                                 "echo", "unsupported_parameter")


def top_logprobs(req: GenerateRequest) -> Optional[int]:
    """Alternatives wanted per emitted token; None when no log-probabilities are asked for."""
    if req.logprobs is None or req.logprobs is False:
        return None
    if req.logprobs is True:
        return req.top_logprobs or 0
    return req.logprobs


def split_prompts(prompt) -> list:
    """A completion's prompts: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestInvalid("`prompt` must not be an empty list", "prompt")
    kinds = {type(p) for p in prompt}
    if kinds == {int}:
        return [list(prompt)]
    if len(kinds) > 1:
        raise RequestInvalid("`prompt` mixes strings, token ids and lists of token ids", "prompt")
    if kinds == {list} and not all(prompt):
        raise RequestInvalid("`prompt` holds an empty list of token ids", "prompt")
    return list(prompt)


def resolve_max_tokens(req: GenerateRequest, cap: int, default: Optional[int] = None) -> GenerateRequest:
    """Applies the server's cap: a larger explicit value is refused; an omitted one gets the
    server's default (launch-stack --max-tokens), else the cap. Either way generation also ends
    where the model's context is full."""
    if req.max_tokens is None:
        req.max_tokens = min(default or cap, cap)
    elif req.max_tokens > cap:
        raise RequestInvalid(f"`max_tokens` ({req.max_tokens}) exceeds this server's cap of {cap}", "max_tokens")
    return req


def message_text(msg) -> str:
    """A message's text: its string, its text parts joined by newlines, or an assistant's refusal."""
    if msg.content is None:
        return msg.refusal or ""
    if isinstance(msg.content, str):
        return msg.content
    return "\n".join(p.text if p.type == "text" else (p.refusal or "") for p in msg.content)
