"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against a real stack on a
tiny random model, through the real `anthropic` SDK: create, stream (event order), tools with a
tool_result turn, tool_choice, count_tokens, errors in Anthropic's shape, cancel on disconnect,
joint mode. The model's text is garbage: what is proven is shape and agreement."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import aiohttp
import msgspec
import anthropic
import jsonschema
import pytest

from bench.tiny_models import build_tiny_model
from stack import Stack, until

KEY = "messages-key"
WEATHER = {"name": "weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}
CLOCK = {"name": "clock", "description": "The time now.",
         "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    draft = build_tiny_model(tmp_path_factory.mktemp("messages-draft"), "llama", seed=1, perturb_from=tiny_llama, noise=0.3)
    with Stack(str(tiny_llama), "--draft", str(draft), "--draft-budget", "3", "--max-tokens-cap", "256",
               "--api-key", KEY) as s:
        yield s
    assert s.exit_code == 0, s.log()


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(stack):
    return stack.health()[1]["model"]


def test_create_with_system_blocks(client, model):
    msg = client.messages.create(model=model, max_tokens=12, messages=ASK,  # this SDK dropped the sampling arguments
                                 system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                                 metadata={"user_id": "u1"}, extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens > 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


def test_stream_events_in_order_and_equal_to_whole(client, model):
    kw = dict(model=model, max_tokens=20, messages=ASK, extra_body={"ignore_eos": True, "temperature": 0})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        events = [e.type for e in s if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                      "content_block_stop", "message_delta", "message_stop")]
        final = s.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 20


def test_stop_sequences_name_the_one_that_ended_it(client, model):
    kw = dict(model=model, max_tokens=30, messages=ASK, extra_body={"ignore_eos": True, "temperature": 0})
    text = client.messages.create(**kw).content[0].text
    stop = text[len(text) // 2:][:3]
    msg = client.messages.create(**kw, stop_sequences=["\u2603never", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == text[: text.index(stop)]
    with client.messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, msg.content[0].text)


async def test_raw_stream_has_ping_and_event_lines(stack, model):
    body = {"model": model, "max_tokens": 5, "messages": ASK, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/v1/messages?beta=true", json=body, headers={"x-api-key": KEY}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            text = (await r.read()).decode()
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert [d["type"] for d in datas] == names  # each event's name is its data's type


def test_tool_choice_any_then_a_tool_result_turn(client, model):
    tools = [WEATHER, CLOCK]
    msg = client.messages.create(model=model, max_tokens=120, messages=ASK, tools=tools,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1
    use = uses[0]
    schema = next(t["input_schema"] for t in tools if t["name"] == use.name)
    jsonschema.validate(use.input, schema)
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                                               {"type": "text", "text": "Thanks. Summarize."}]}]
    after = client.messages.create(model=model, max_tokens=10, messages=turn, tools=tools,
                                   tool_choice={"type": "none"})
    assert after.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in after.content)


def test_tool_choice_names_a_tool_streamed(client, model):
    with client.messages.stream(model=model, max_tokens=120, messages=ASK, tools=[WEATHER, CLOCK],
                                tool_choice={"type": "tool", "name": "weather"}) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert use.name == "weather" and use.id.startswith("toolu_") and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert json.loads("".join(deltas)) == use.input  # the pieces add up to the input


def test_count_tokens_equals_the_prompt_the_generation_reports(client, model):
    kw = dict(model=model, messages=ASK, system="Be brief.", tools=[WEATHER])
    counted = client.messages.count_tokens(**kw)
    msg = client.messages.create(max_tokens=3, **kw)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


def test_unknown_field_and_bad_max_tokens_are_400_in_anthropic_shape(client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=5, messages=ASK, extra_body={"frobnicate": 1})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "`frobnicate`" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=0, messages=ASK)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "bogus": True}]}])
    assert "messages[0].content[0].bogus" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-none", max_tokens=5, messages=ASK)
    assert "ANTHROPIC_MODEL" in e.value.body["error"]["message"]


def test_key_as_x_api_key_or_bearer(stack, model):
    bearer = anthropic.Anthropic(base_url=stack.url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model=model, max_tokens=2, messages=ASK).usage.output_tokens > 0
    for kw in ({"api_key": "wrong"}, {"auth_token": "wrong", "api_key": None}):
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=stack.url, max_retries=0, **kw).messages.create(
                model=model, max_tokens=2, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"


async def test_client_disconnect_cancels(stack, model):
    body = {"model": model, "max_tokens": 256, "messages": ASK, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        r = await http.post(stack.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
        async for line in r.content:
            if line.startswith(b"event: content_block_delta"):
                break
        rid = r.headers["X-Request-Id"]
        r.close()
    await until(stack.idle, 30, "the worker to drop the cancelled request")
    assert f"[{rid}] client went away: cancelling" in stack.log()


def test_joint_mode_equals_baseline_greedy(client, model):
    kw = dict(model=model, max_tokens=24, messages=ASK)
    base = client.messages.create(**kw, extra_body={"ignore_eos": True, "temperature": 0})
    joint = client.messages.create(**kw, extra_body={"ignore_eos": True, "temperature": 0, "mode": "joint"})
    assert joint.content[0].text == base.content[0].text
    assert joint.model_extra["metrics"]["mode"] == "joint" and joint.model_extra["metrics"]["drafted"] > 0


async def test_responses_fit_the_openapi_shapes(stack, model):
    """Real answers convert into the structs /openapi.json describes (gateway/messages_openapi.py)."""
    from gateway import messages_openapi as shapes

    body = {"model": model, "max_tokens": 40, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as http:
        async with http.get(stack.url + "/openapi.json") as r:
            doc = await r.json()
        assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(doc["paths"])
        assert doc["components"]["schemas"]["MessagesRequest"]["properties"]["model"]["enum"] == [model]
        async with http.post(stack.url + "/v1/messages", json=body) as r:
            msgspec.convert(await r.json(), shapes.AnthropicMessage)
        async with http.post(stack.url + "/v1/messages", json={**body, "stream": True}) as r:
            events = [msgspec.json.decode(line[6:], type=shapes.StreamEvent)
                      for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert {type(e).__name__ for e in events} >= {"MessageStart", "ContentBlockDelta", "MessageDelta", "MessageStop"}
        async with http.post(stack.url + "/v1/messages/count_tokens", json={"model": model, "messages": ASK}) as r:
            msgspec.convert(await r.json(), shapes.CountTokensResponse)
        async with http.post(stack.url + "/v1/messages", json={"model": model, "messages": ASK}) as r:
            assert r.status == 400
            err = msgspec.convert(await r.json(), shapes.AnthropicError)
        assert "max_tokens" in err.error.message and err.error.type == "invalid_request_error"


def test_metrics_and_monitor_show_the_messages_kind(stack, client, model):
    """/metrics counts answered requests by kind; `verity monitor` shows the same counts."""
    from rich.console import Console

    from cli.monitor import Monitor, fetch_stats, render

    client.messages.create(model=model, max_tokens=2, messages=ASK)
    metrics = urllib.request.urlopen(stack.url + "/metrics").read().decode()
    counts = dict(re.findall(r'^verity:requests_by_kind_total\{kind="(\w+)"\} (\d+)', metrics, re.M))
    assert int(counts["messages"]) > 0 and "chat" in counts and "completion" in counts
    stats = fetch_stats(stack.url, KEY)
    assert stats["totals"]["kinds"]["messages"] == int(counts["messages"])
    mon = Monitor(stack.url)
    mon.update(stats)
    console = Console(width=120, record=True)
    console.print(render(mon))
    text = console.export_text()
    kinds = stats["totals"]["kinds"]  # the monitor's row: the kinds, then their counts in that order
    names = sorted(kinds)
    assert " · ".join(names) in text and " · ".join(str(kinds[k]) for k in names) in text, text


@pytest.fixture(scope="module")
def limited(tiny_llama):
    with Stack(str(tiny_llama), "--request-timeout-s", "1", "--max-tokens-cap", "2000", "--max-active", "1",
               "--queue-size", "1",
               env={"VERITY_FAULT_STEP_DELAY_S": "0.005"}) as s:
        yield s


async def test_time_limit_ends_whole_and_streamed_messages(limited):
    body = {"model": limited.health()[1]["model"], "max_tokens": 2000, "messages": ASK, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(limited.url + "/v1/messages", json=body) as r:
            assert r.status == 504
            assert (await r.json())["error"] == {"type": "timeout_error", "code": "request_timeout", "param": None,
                                                 "message": "the request did not end within this server's time limit "
                                                            "of 1 s (--request-timeout-s)"}
        async with http.post(limited.url + "/v1/messages", json={**body, "stream": True}) as r:
            text = (await r.read()).decode()
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    assert json.loads(text.splitlines()[-2][6:])["error"]["type"] == "timeout_error"
    await until(limited.idle, 30, "the cancelled requests to leave the worker")


async def test_a_full_queue_is_a_rate_limit_error(limited):
    """Two requests fill --max-active 1 + --queue-size 1: the third is Anthropic's 429, with Retry-After."""
    model = limited.health()[1]["model"]
    body = {"model": model, "max_tokens": 2000, "messages": ASK, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        held = [await http.post(limited.url + "/v1/messages", json=body) for _ in range(2)]
        client = anthropic.AsyncAnthropic(base_url=limited.url, api_key="none", max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as e:
            await client.messages.create(model=model, max_tokens=5, messages=ASK)
        assert e.value.body["error"]["type"] == "rate_limit_error" and e.value.response.headers["Retry-After"]
        for r in held:
            r.close()
    await until(limited.idle, 30, "the held requests to end")


async def test_disconnect_while_waiting_for_a_whole_message(limited):
    body = {"model": limited.health()[1]["model"], "max_tokens": 2000, "messages": ASK, "ignore_eos": True}
    went = limited.log().count("client went away: cancelling")
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(limited.url + "/v1/messages", json=body))
        await until(lambda: limited.health()[1].get("admitted") == 1, 10, "admission")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await until(limited.idle, 30, "the worker to drop the cancelled request")
    assert limited.log().count("client went away: cancelling") == went + 1
