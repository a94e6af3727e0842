"""Grammar-constrained output (worker/grammar.py) and tool calls (worker/tools.py, gateway/tools.py)
on tiny random models: whatever garbage the model prefers, the output parses and validates, in
baseline and joint mode, and constrained joint greedy output equals constrained baseline's."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import FULL
from gateway.tools import ToolCallStream, split_whole
from joint_fixtures import load_pair
from protocol import messages as m
from protocol.schema import RequestInvalid, parse_request
from test_engine import run
from worker.engine import Engine, EngineConfig, RequestError

EXAMPLES = 40 if FULL else 4
MAX_TOKENS = 160  # every generated schema is bounded well below this


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(tmp_path_factory.mktemp("structured"), "llama+llama")


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(pair.target, EngineConfig(max_active=4, draft_budget=3), pair.drafts["perturbed"])


def request(text: str, **kw) -> m.GenerateRequest:
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    return parse_request(msgspec.json.encode(body), "chat")


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


# ---- generated schemas: objects of bounded strings, integers, booleans, enums and arrays ----

LEAVES = st.one_of(
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "integer", "minimum": -50, "maximum": 999}),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
)
VALUES = st.one_of(LEAVES, LEAVES.map(lambda s: {"type": "array", "items": s, "maxItems": 3}))
SCHEMAS = st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), VALUES, min_size=1, max_size=4).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, prompts=st.permutations(["the quick brown fox", "hello world", "a b c d e f"]))
def test_constrained_output_validates_and_joint_equals_baseline(engine, schema, prompts):
    """Two prompts at once, each in both modes: the two joint rows verify in one batched forward."""
    fmt = json_format(schema)
    reqs = {(p, mode): request(p, response_format=fmt, mode=mode) for p in prompts[:2] for mode in ("baseline", "joint")}
    out = run(engine, reqs)
    for key, o in out.items():
        assert o["finished"].finish_reason == "stop", (key, o)
        jsonschema.validate(json.loads(o["text"]), schema)
    for p in prompts[:2]:
        assert out[(p, "joint")]["tokens"] == out[(p, "baseline")]["tokens"]
        assert out[(p, "joint")]["finished"].metrics.drafted > 0  # the verify positions were masked, not skipped


def test_json_object_sampled_parses(engine):
    """Sampled at temperature 1 on random weights, a JSON object may run past max_tokens inside a
    string (the grammar allows any length): every one that ends is an object, and most end."""
    reqs = {f"r{i}": request("tell me a story", response_format={"type": "json_object"}, temperature=1.0,
                             seed=i, mode="joint" if i % 2 else "baseline") for i in range(8)}
    ended = 0
    for name, o in run(engine, reqs).items():
        assert o["finished"].finish_reason in ("stop", "length"), (name, o)
        if o["finished"].finish_reason == "stop":
            assert isinstance(json.loads(o["text"]), dict)
            ended += 1
    assert ended >= 6


def test_text_format_is_free_text(engine):
    free = run(engine, {"a": request("hello world", max_tokens=8, ignore_eos=True)})["a"]
    text = run(engine, {"a": request("hello world", max_tokens=8, ignore_eos=True, response_format={"type": "text"})})["a"]
    assert text["tokens"] == free["tokens"]


def test_unusable_schema_is_refused_by_name(engine):
    with pytest.raises(RequestError) as e:
        engine.submit("bad", request("hi", response_format=json_format({"type": "bogus"})))
    assert e.value.param == "response_format.json_schema.schema" and "bogus" in e.value.message
    with pytest.raises(RequestError) as e:  # strict: a keyword the grammar cannot enforce is refused
        engine.submit("bad", request("hi", response_format=json_format({"type": "string", "format": "weird"})))
    assert e.value.param == "response_format.json_schema.schema"
    loose = json_format({"type": "string", "format": "weird", "maxLength": 3})
    loose["json_schema"]["strict"] = False
    assert run(engine, {"ok": request("hi", response_format=loose)})["ok"]["finished"].finish_reason == "stop"


# ---- tools ----

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize("mode", ["baseline", "joint"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_and_validate(engine, mode, choice):
    reqs = {p: request(p, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, mode=mode)
            for p in ("what is the weather", "hello world")}
    for o in run(engine, reqs).values():
        content, calls = split_whole(o["text"])
        assert content is None and len(calls) == 1, o["text"]
        if isinstance(choice, dict):
            assert calls[0].name == "get_time"
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS_BY_NAME[calls[0].name])


def test_auto_tools_with_a_response_format_give_a_call_or_the_json(engine, pair):
    """The model's own first choice, and a logit_bias toward `<` (a call's first token)."""
    schema = SCHEMAS_BY_NAME["get_time"]
    lt = pair.target.tokenizer.encode("<", add_special_tokens=False)
    biases = {"own": None, "call": {str(lt[0]): 100}}
    reqs = {(p, mode, b): request(p, tools=[WEATHER], response_format=json_format(schema), mode=mode, logit_bias=bias)
            for p in ("what is the weather", "hello world") for mode in ("baseline", "joint") for b, bias in biases.items()}
    out = run(engine, reqs)
    for (p, mode, b), o in out.items():
        content, calls = split_whole(o["text"])
        assert bool(calls) == (b == "call") or b == "own", o["text"]
        if calls:
            assert content is None and all(c.name == "get_weather" for c in calls), o["text"]
            jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS_BY_NAME["get_weather"])
        else:
            jsonschema.validate(json.loads(o["text"]), schema)
        assert o["tokens"] == out[(p, "baseline", b)]["tokens"]


def test_tool_history_renders_in_the_generic_format(engine, pair):
    from worker.text import render_prompt

    req = request("weather?", tools=[WEATHER])
    req.messages += [m.Message("assistant", None, tool_calls=[m.ToolCall("c1", m.FunctionCall("get_weather", '{"city": "Paris", "days": 1}'))]),
                     m.Message("tool", "sunny", tool_call_id="c1")]
    text = pair.target.tokenizer.decode(render_prompt(pair.target.tokenizer, req))
    assert '"name": "get_weather"' in text and "<tool_call>" in text and "<tool_response>\nsunny" in text
    assert "You may call these functions" in text
    none = request("weather?", tools=[WEATHER], tool_choice="none")
    assert "You may call" not in pair.target.tokenizer.decode(render_prompt(pair.target.tokenizer, none))


def test_tool_fields_are_checked_by_name():
    cases = [({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
             ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
             ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
             ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id")]
    for extra, param in cases:
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        with pytest.raises(RequestInvalid) as e:
            parse_request(msgspec.json.encode(body), "chat")
        assert e.value.param == param, (extra, e.value.message)
    with pytest.raises(RequestInvalid) as e:
        parse_request(msgspec.json.encode({"prompt": "hi", "tools": [WEATHER]}), "completion")
    assert e.value.param == "tools"


def test_tool_call_stream_splits_at_any_chunking():
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    for size in (1, 2, 3, 7, len(text)):
        s = ToolCallStream()
        splits = [s.feed(text[i : i + size]) for i in range(0, len(text), size)] + [s.flush()]
        content = "".join(p.content or "" for p in splits)
        calls = [c for p in splits for c in p.calls]
        assert content.strip() == "Sure." and [c.name for c in calls] == ["f", "g"]
        assert [json.loads(c.arguments) for c in calls] == [{"a": 1}, {}] and [c.index for c in calls] == [0, 1]
    assert split_whole("a <tool_call> not json </tool_call>") == ("a ", [])  # markup is never content
    assert split_whole("x <tool_ca") == ("x <tool_ca", []) and split_whole("x <tool_ca", cut=True) == ("x ", [])


NATIVE_TEMPLATE = (  # Qwen-like: renders `tools` itself and calls in the json_tools format
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{% if message.tool_calls %}"
    "{% for tool_call in message.tool_calls %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}"
    "{% endif %}<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them(tiny_llama, tmp_path):
    import shutil

    from worker.loader import load_model
    from worker.text import render_prompt
    from worker.tools import native

    folder = tmp_path / "native"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NATIVE_TEMPLATE}))
    lm = load_model(str(folder))
    assert native(lm.tokenizer)
    req = request("weather?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    req.messages += [m.Message("assistant", None, tool_calls=[m.ToolCall("c1", m.FunctionCall("get_weather", '{"city": "Oslo", "days": 2}'))]),
                     m.Message("tool", "sunny", tool_call_id="c1")]
    text = lm.tokenizer.decode(render_prompt(lm.tokenizer, req))
    assert "# Tools" in text and "You may call" not in text and '"arguments": {"city": "Oslo", "days": 2}' in text
    assert "<|im_start|>tool\nsunny" in text
    out = run(Engine(lm, EngineConfig(max_active=1)), {"a": req})["a"]
    content, calls = split_whole(out["text"])
    assert content is None and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


def test_calls_cut_by_max_tokens_end_with_length(caplog):
    """A call cut by max_tokens is dropped (named in the log), never content; the whole calls
    stand. Streamed, each call's arguments come in pieces that add up to the whole call's."""
    from gateway.openai_format import Shaper

    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x}"]}}\n</tool_call><tool_call>\n{"name": "g", "argu'
    done = {r: m.Finished("x", r, m.RequestMetrics()) for r in ("stop", "length")}
    for reason, expected in (("stop", "tool_calls"), ("length", "length")):
        whole = Shaper("x", "m", True, tool_calls=True).whole(text, done[reason])["choices"][0]
        assert whole["finish_reason"] == expected and whole["message"]["content"] is None
        assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["f"]
        shaper = Shaper("x", "m", True, tool_calls=True)
        chunks = [shaper.chunk(text=text[i : i + 4]) for i in range(0, len(text), 4)] + [shaper.chunk(finished=done[reason])]
        assert chunks[-1]["choices"][0]["finish_reason"] == expected
        deltas = [c["choices"][0]["delta"] for c in chunks]
        pieces = [d for x in deltas for d in x.get("tool_calls", [])]
        assert [d["function"]["name"] for d in pieces if "name" in d["function"]] == ["f"] and pieces[0]["id"]
        assert "".join(d["function"]["arguments"] for d in pieces) == whole["message"]["tool_calls"][0]["function"]["arguments"]
        assert len(pieces) > 3 and not any("content" in x for x in deltas)
    assert "dropped a tool call of `g` cut before its end (finish_reason length)" in caplog.text


KEYWORDS = ["type", "properties", "items", "enum", "const", "required", "anyOf", "oneOf", "allOf", "not", "$ref",
            "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "minItems", "maxItems",
            "additionalProperties", "prefixItems", "$defs", "if", "then", "uniqueItems", "multipleOf"]
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(
    ["object", "string", "integer", "array", "boolean", "null", "number", "a", "^[a-z]+$", "#/$defs/x", "email"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(KEYWORDS + ["x", "y"]), inner, max_size=4)), max_leaves=12)


@settings(max_examples=200 if FULL else 40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=JSONISH, strict=st.booleans(), as_tool=st.booleans())
def test_any_schema_compiles_or_is_refused_by_name(engine, schema, strict, as_tool):
    """Whatever a client sends as a schema: a grammar whose mask allows some token, or a 400 naming it."""
    import mlx.core as mx

    if as_tool:
        kw = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}], "tool_choice": "required"}
    else:
        kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}}
    try:
        req = request("hi", **kw)
    except RequestInvalid as e:  # not an object where one is required
        assert e.param and ("parameters" in e.param or "schema" in e.param)
        return
    try:
        grammar = engine._grammar(req)
    except RequestError as e:
        assert e.code == "invalid_schema" and e.param in ("response_format.json_schema.schema", "tools[0].function.parameters", "tools")
        return
    mask = engine.grammars.processor(grammar)(mx.array([1, 2, 3]), mx.zeros((1, 384)))
    assert (mask > -mx.inf).any().item()


def test_the_draft_proposes_under_the_grammar_too(pair):
    """A draft identical to the target, masked by the same grammar, proposes what the target picks."""
    eng = Engine(pair.target, EngineConfig(max_active=1, draft_budget=3), pair.drafts["copy"])
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "tags": {
        "type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 3}}, "required": ["name", "tags"],
              "additionalProperties": False}
    o = run(eng, {"a": request("hello world", response_format=json_format(schema), mode="joint")})["a"]
    jsonschema.validate(json.loads(o["text"]), schema)
    mt = o["finished"].metrics
    assert mt.drafted > 10 and mt.accepted == mt.drafted, mt
