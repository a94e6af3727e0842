"""Tools in the prompt, and the grammar of a call the request forces.

A chat template that renders tools itself and whose model calls them as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (mlx-lm's json_tools format: Qwen 2.5
and 3, Hermes) gets them through `apply_chat_template(tools=...)`. Any other model gets a generic
system preamble that lists the functions as JSON and asks for that same format, and its past calls
and tool results are rendered as text in it. Either way the gateway parses one format
(gateway/tools.py), and `tool_choice` "required" or a named function is enforced by the grammar.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

import msgspec

from protocol import messages as m
from protocol.messages import TOOL_CALL_END, TOOL_CALL_START
from protocol.tool_rules import tools_offered

PREAMBLE = (
    "You may call these functions (JSON schemas of their arguments):\n<tools>\n{tools}\n</tools>\n"
    "To call one, reply with a block per call:\n"
    + TOOL_CALL_START + '\n{{"name": <function name>, "arguments": <arguments object>}}\n' + TOOL_CALL_END
)
# inline JSON grammars: compact, and keywords the grammar cannot enforce are ignored
INLINE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
SchemaCheck = Callable[[dict, str], None]


def native(tokenizer) -> bool:
    """The chat template renders tools and its model calls them in the parsed format."""
    return (bool(getattr(tokenizer, "has_tool_calling", False))
            and tokenizer.tool_call_start == TOOL_CALL_START and tokenizer.tool_call_end == TOOL_CALL_END)


def tool_dicts(req: m.GenerateRequest) -> list[dict]:
    return [msgspec.to_builtins(t) for t in req.tools or []]


def render(tokenizer, req: m.GenerateRequest, msgs: list[dict], originals: list[m.Message]) -> tuple[list[dict], dict]:
    """The template's messages (calls and tool results in place) and its extra arguments (tools=)."""
    is_native = native(tokenizer)
    out = [_message(d, msg, is_native) for d, msg in zip(msgs, originals)]
    if not tools_offered(req):
        return out, {}
    if is_native:
        return out, {"tools": tool_dicts(req)}
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tool_dicts(req))
    text = PREAMBLE.format(tools=listing)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{text}"}] + out[1:], {}
    return [{"role": "system", "content": text}] + out, {}


def _message(d: dict, msg: m.Message, is_native: bool) -> dict:
    d = {**d, "content": d.get("content") or ""}
    if msg.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in msg.tool_calls]
        if is_native:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": f} for c, f in zip(msg.tool_calls, calls)]
        else:
            blocks = "".join(f"{TOOL_CALL_START}\n{json.dumps(f, ensure_ascii=False)}\n{TOOL_CALL_END}" for f in calls)
            d["content"] = "\n".join(([d["content"]] if d["content"] else []) + [blocks])
    if msg.role == "tool":
        if is_native:
            d["tool_call_id"] = msg.tool_call_id
        else:
            d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
    return d


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_grammar(req: m.GenerateRequest, check: SchemaCheck, answer: Optional[dict] = None,
                 native: bool = False) -> Optional[str]:
    """A lark grammar (llguidance's, with inline %json) of the calls the request may make:
    "required" one call of any tool (several when parallel_tool_calls is not false), a named
    function exactly one call of it; "auto" with an `answer` (response_format's JSON grammar
    options and schema): those calls or that answer. None when the text is free.

    After every whole call the model may end (EOS is allowed there). Calls follow each other
    with nothing between them in the generic format: a newline there, which a model that wants
    to go on talking picks first, could only open another call (the embedded model then repeated
    its call until max_tokens); a `native` template's model writes its calls a line each."""
    choice = req.tool_choice
    forced = choice == "required" or isinstance(choice, m.NamedToolChoice)
    if not tools_offered(req) or not (forced or answer is not None):
        return None
    named = isinstance(choice, m.NamedToolChoice)
    schemas = []
    for i, tool in enumerate(req.tools):
        if named and tool.function.name != choice.function.name:
            continue
        params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
        check(params, f"tools[{i}].function.parameters")
        schemas.append({"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = json.dumps({**schema, "x-guidance": INLINE_OPTIONS})
    between = '"\\n" ' if native else ""
    calls = f"calls: call ({between}call)*" if not named and req.parallel_tool_calls is not False else "calls: call"
    start = "start: calls" if forced else f"start: calls | answer\nanswer: %json {json.dumps(answer)}"
    return f'{start}\n{calls}\ncall: "{TOOL_CALL_START}\\n" %json {body} "\\n{TOOL_CALL_END}"\n'
