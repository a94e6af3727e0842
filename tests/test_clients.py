"""The clients people point at a local server, run against a real stack on a tiny random model:
the openai SDK, langchain-openai, litellm, the `llm` CLI and the OpenAI Agents SDK (over
/v1/responses). The model's text is garbage, so
what is proven is shape: structured output that parses and validates, tool calls that parse
into their schemas, streamed tool-call deltas that add up to whole calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from bench.tiny_models import build_tiny_model
from stack import Stack

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise
MAX_TOKENS = 200


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: no free-form keys to ramble in
    name: str = Field(max_length=6)  # bounded: a random model may never close an open string
    age: int = Field(ge=0, le=120)
    member: bool
    tier: Literal["gold", "plain"]


class Weather(BaseModel):
    """Looks up the weather of a city."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=5)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    draft = build_tiny_model(tmp_path_factory.mktemp("clients-draft"), "llama", seed=1, perturb_from=tiny_llama, noise=0.3)
    with Stack(str(tiny_llama), "--draft", str(draft), "--draft-budget", "3", "--max-tokens-cap", "256") as s:
        yield s
    assert s.exit_code == 0, s.log()


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- the openai SDK ----


@pytest.mark.parametrize("mode", ["baseline", "joint"])
def test_sdk_parse_with_a_pydantic_model(client, model, mode):
    done = client.chat.completions.parse(model=model, messages=ask("who is it?"), response_format=Person,
                                         temperature=0, max_tokens=MAX_TOKENS, extra_body={"mode": mode})
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person), msg.content


def test_sdk_tools_round_trip(client, model):
    tools = [openai.pydantic_function_tool(Weather)]
    first = client.chat.completions.create(model=model, messages=ask("weather in Paris?"), tools=tools,
                                           tool_choice="required", temperature=0, max_tokens=MAX_TOKENS)
    choice = first.choices[0]
    # a random model may call again and again until max_tokens ("length"): the whole calls stand, no markup
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "Weather" and c.id for c in calls)
    Weather.model_validate_json(calls[0].function.arguments)
    history = ask("weather in Paris?") + [choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"sky": "clear"}'} for c in calls]
    again = client.chat.completions.create(model=model, messages=history, tools=tools, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length") and again.choices[0].message.tool_calls is None
    named = client.chat.completions.parse(model=model, messages=ask("weather?"), tools=tools, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "Weather"}},
                                          max_tokens=MAX_TOKENS)
    call = named.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)


def test_sdk_two_choices_each_call(client, model):
    done = client.chat.completions.create(model=model, messages=ask("weather?"), n=2, seed=3, temperature=1.0,
                                          tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=MAX_TOKENS)
    assert sorted(c.index for c in done.choices) == [0, 1]
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls"
        Weather.model_validate_json(choice.message.tool_calls[0].function.arguments)


def test_sdk_streamed_tool_call_deltas(client, model):
    stream = client.chat.completions.create(model=model, messages=ask("weather in Oslo?"), stream=True,
                                            tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS,
                                            extra_body={"mode": "joint"})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "Weather" and calls[0]["id"]
    Weather.model_validate_json(calls[0]["arguments"])


def test_tool_responses_fit_the_openapi_shapes(stack, model):
    import httpx
    import msgspec

    from gateway import openapi as shapes

    body = {"model": model, "messages": ask("weather?"), "tools": [openai.pydantic_function_tool(Weather)],
            "tool_choice": "required", "temperature": 0, "max_tokens": MAX_TOKENS}
    url = stack.url + "/v1/chat/completions"
    whole = msgspec.convert(httpx.post(url, json=body, timeout=60).json(), shapes.ChatCompletion)
    assert whole.choices[0].message.content is None and whole.choices[0].message.tool_calls
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        chunks = [msgspec.convert(json.loads(line[6:]), shapes.ChatCompletionChunk)
                  for line in r.iter_lines() if line.startswith("data: {")]
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason  # a random model may repeat to "length"
    pieces = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert sum(d.id is not None for d in pieces) == len(whole.choices[0].message.tool_calls)


# ---- langchain-openai ----


@pytest.fixture(scope="module")
def chat_model(stack, model):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=stack.url + "/v1", api_key="none", model=model, temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(chat_model, method):
    out = chat_model.with_structured_output(Person, method=method).invoke("who is it?")
    assert isinstance(out, Person)


def test_langchain_json_mode(chat_model):
    schema = Person.model_json_schema()
    out = chat_model.with_structured_output(schema, method="json_mode").invoke("who is it? answer in JSON")
    assert isinstance(out, dict)  # json_object constrains to an object, not to the schema


def test_langchain_bind_tools(chat_model):
    msg = chat_model.bind_tools([Weather], tool_choice="any").invoke("weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(msg.tool_calls[0]["args"])


# ---- litellm ----


def test_litellm_top_k_tools_and_response_format(stack, model):
    import litellm

    common = dict(model=f"openai/{model}", api_base=stack.url + "/v1", api_key="none", temperature=0,
                  max_tokens=MAX_TOKENS, messages=ask("weather?"))
    plain = litellm.completion(**common, top_k=5)
    assert plain.choices[0].message.content is not None
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}]
    called = litellm.completion(**common, tools=tools, tool_choice="required")
    assert called.choices[0].finish_reason in ("tool_calls", "length")  # a random model may repeat its call
    Weather.model_validate_json(called.choices[0].message.tool_calls[0].function.arguments)
    shaped = litellm.completion(**common, response_format=Person)
    Person.model_validate_json(shaped.choices[0].message.content)


# ---- the OpenAI Agents SDK, over /v1/responses ----


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sky: Literal["sunny", "rainy"]
    degrees: int = Field(ge=-50, le=50)


@pytest.mark.parametrize("streamed", [False, True])
async def test_agents_sdk_runs_an_agent_with_a_function_tool(stack, model, streamed):
    """A forced call (a tiny model would not choose one), its output sent back as a
    function_call_output turn, and a final answer in the agent's output type (grammar-bounded, so
    the loop ends): the agent loop completes over /v1/responses."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Looks up the weather of a city."""
        asked.append(city)
        return f"sunny in {city}, 21 degrees"

    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    agent = Agent(name="weather", instructions="Use the tool, then report.", tools=[get_weather], output_type=Report,
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS,
                                               temperature=0))
    if streamed:
        run = Runner.run_streamed(agent, "weather in Paris?", max_turns=4)
        kinds = [e.type async for e in run.stream_events()]
        assert "raw_response_event" in kinds
    else:
        run = await Runner.run(agent, "weather in Paris?", max_turns=4)
    assert len(asked) == 1 and asked[0] in ("Paris", "Rome")
    assert isinstance(run.final_output, Report)
    kinds = [type(i).__name__ for i in run.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds


# ---- the llm CLI ----


def llm_cli(stack, model, tmp_path: Path, *args: str) -> str:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: verity-test\n  model_name: {model}\n  api_base: {stack.url}/v1\n  supports_schema: true\n"
        "  supports_tools: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": "", "OPENAI_API_KEY": "none"}
    llm = str(Path(sys.executable).parent / "llm")
    r = subprocess.run([llm, "-m", "verity-test", "-o", "temperature", "0", "-o", "max_tokens", str(MAX_TOKENS),
                        "--no-log", *args], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_llm_cli_schema_and_json_object(stack, model, tmp_path):
    schema = Person.model_json_schema()
    out = llm_cli(stack, model, tmp_path, "--schema", json.dumps(schema), "who is it?")
    jsonschema.validate(json.loads(out), schema)
    out = llm_cli(stack, model, tmp_path, "-o", "json_object", "1", "answer in JSON")
    assert isinstance(json.loads(out), dict)
    llm_cli(stack, model, tmp_path, "-T", "llm_version", "which version?")  # tools offered (auto): served
