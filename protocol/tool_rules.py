"""Rules of the tool and structured-output fields that their types cannot say (errors name the
field, with code `invalid_tools`: /openapi.json can state them only in words)."""

from __future__ import annotations

from protocol.messages import GenerateRequest, NamedToolChoice

CODE = "invalid_tools"


def check_tools(req: GenerateRequest, chat: bool, invalid) -> None:
    """Raises `invalid(message, param, CODE)` for a tool or response_format field that cannot be served."""
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                raise invalid(f"`{name}` belongs to /v1/chat/completions", name, CODE)
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
        raise invalid("`response_format` of type `json_schema` needs its `json_schema` object", "response_format.json_schema", CODE)
    if req.tools is not None and not req.tools:
        raise invalid("`tools` must not be empty (as in OpenAI's API; omit it for no tools)", "tools", CODE)
    names = [t.function.name for t in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tool `{name}` is defined twice", f"tools[{i}].function.name", CODE)
    choice = req.tool_choice
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        if not names:
            raise invalid("`tool_choice` that forces a call needs `tools`", "tool_choice", CODE)
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid(f"`tool_choice` names `{choice.function.name}`, which is not in `tools`", "tool_choice.function.name", CODE)
    for i, msg in enumerate(req.messages or []):
        if msg.tool_calls is not None and msg.role != "assistant":
            raise invalid("`tool_calls` belong to an assistant message", f"messages[{i}].tool_calls", CODE)
        if msg.role == "tool" and not msg.tool_call_id:
            raise invalid("a tool message needs the `tool_call_id` of the call it answers", f"messages[{i}].tool_call_id", CODE)
        if msg.tool_call_id is not None and msg.role != "tool":
            raise invalid("`tool_call_id` belongs to a tool message", f"messages[{i}].tool_call_id", CODE)


def tools_offered(req: GenerateRequest) -> bool:
    """The model is told of the request's tools, and calls in its output are parsed."""
    return bool(req.tools) and req.tool_choice != "none"


def needs_grammar(req: GenerateRequest) -> bool:
    """The request's output is grammar-constrained: a response_format other than text, or tools
    with a forced call (the worker compiles its grammar before it answers Queued)."""
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
    formatted = req.response_format is not None and req.response_format.type != "text"
    return formatted or (forced and tools_offered(req))
