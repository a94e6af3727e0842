"""POST /v1/responses (OpenAI's Responses API) on a real stack, through the openai SDK's
`client.responses`: whole and streamed responses (the typed events in order), function tools
with a `function_call_output` turn, `text.format`, `previous_response_id` and the bounded
store, GET/DELETE, cancel of a running response, errors, joint mode, metrics and OpenAPI. The
tiny model's text is garbage: what is proven is shape, constraint and bookkeeping."""

from __future__ import annotations

import json
import urllib.request
from typing import Literal

import jsonschema
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from bench.tiny_models import build_tiny_model
from gateway import responses_format as shapes
from gateway.response_store import ResponseStore, size_of
from stack import Stack, wait_until

CAP = 1024
STORE_COUNT, STORE_BYTES = 6, 24_000
PAD = {f"k{i}": "x" * 512 for i in range(16)}  # metadata at its bounds: 8 KiB stored, no token
WEATHER = {"type": "function", "name": "get_weather", "description": "Looks up the weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}, "strict": True}


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: no free-form keys to ramble in
    name: str = Field(max_length=6)  # bounded: a random model may never close an open string
    age: int = Field(ge=0, le=120)
    tier: Literal["gold", "plain"]


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    draft = build_tiny_model(tmp_path_factory.mktemp("responses-draft"), "llama", seed=1, perturb_from=tiny_llama,
                             noise=0.3)
    with Stack(str(tiny_llama), "--draft", str(draft), "--draft-budget", "3", "--max-tokens-cap", str(CAP),
               "--responses-max-count", str(STORE_COUNT), "--responses-max-bytes", str(STORE_BYTES)) as s:
        yield s
    assert s.exit_code == 0 and "Traceback" not in s.log(), s.log()


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(stack.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def fits(body: dict) -> shapes.ResponseObject:
    """A response as served, read by the struct /openapi.json describes it with."""
    return msgspec.convert(body, shapes.ResponseObject)


def test_create_answers_a_response_object(stack, client, model):
    r = client.responses.create(model=model, input="hello", instructions="Be brief.", max_output_tokens=12,
                                temperature=0, metadata={"k": "v"})
    status, raw = post(stack, "/v1/responses", {"input": "hello", "instructions": "Be brief.", "max_output_tokens": 12,
                                                "temperature": 0})
    assert status == 200 and fits(raw).output[0].content[0].text == r.output_text
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # the model never stops
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0 and r.metadata == {"k": "v"}
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store is True


def _kinds(events) -> list[str]:
    """Event types with runs of deltas folded to one."""
    out = []
    for e in events:
        if not (out and e.type == out[-1] and e.type.endswith(".delta")):
            out.append(e.type)
    return out


def test_stream_sends_the_typed_events_in_order(client, model):
    with client.responses.stream(model=model, input="hello", max_output_tokens=10, temperature=0) as s:
        events = list(s)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                              "response.content_part.done", "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    whole = client.responses.create(model=model, input="hello", max_output_tokens=10, temperature=0)
    assert whole.output_text == text  # a stream and a whole response are the same response


def test_function_tools_and_a_function_call_output_turn(client, model):
    with client.responses.stream(model=model, input="weather in Paris?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=0) as s:
        events = list(s)
        first = s.get_final_response()
    assert first.status == "completed"
    [call] = [o for o in first.output if o.type == "function_call"]
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments and done.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    # the next turn by replaying the items, and by previous_response_id: the same prompt
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "sunny"})}
    replayed = client.responses.create(
        model=model, input=[{"role": "user", "content": "weather in Paris?"}, call, result],
        tools=[WEATHER], max_output_tokens=8, temperature=0)
    continued = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                        max_output_tokens=8, temperature=0)
    assert replayed.usage.input_tokens == continued.usage.input_tokens > first.usage.input_tokens
    assert continued.output_text == replayed.output_text and continued.previous_response_id == first.id


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_output_validates(client, model, stream):
    schema = Person.model_json_schema()
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    kw = dict(model=model, input="who?", text=fmt, max_output_tokens=200, temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    Person.model_validate_json(r.output_text)
    parsed = client.responses.parse(model=model, input="who?", text_format=Person, max_output_tokens=200, temperature=0)
    assert isinstance(parsed.output_parsed, Person)


def test_previous_response_id_continues_the_stored_conversation(client, model):
    first = client.responses.create(model=model, input="one", instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model=model, previous_response_id=first.id, input="two", max_output_tokens=6,
                                     temperature=0)
    explicit = client.responses.create(
        model=model, input=[{"role": "user", "content": "one"}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "two"}], max_output_tokens=6, temperature=0)
    # instructions are not carried over (as OpenAI): the continuation is the stored turns and the new one
    assert second.usage.input_tokens == explicit.usage.input_tokens and second.output_text == explicit.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0  # the stored prefix is reused
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, previous_response_id="resp_unknown", input="x")
    assert "resp_unknown" in e.value.message and e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=model, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_get_and_delete(client, model):
    r = client.responses.create(model=model, input="keep me", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call(r.id)
        assert r.id in e.value.message


def test_the_store_evicts_the_oldest_by_count_and_by_bytes(stack, client, model):
    small = [client.responses.create(model=model, input=f"n{i}", max_output_tokens=2).id for i in range(STORE_COUNT + 2)]
    for rid in small[:2]:
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(rid)
        assert "evicted" in e.value.message and "--responses-max-count" in e.value.message
    assert not any(_missing(client, rid) for rid in small[2:])
    big = [client.responses.create(model=model, input="b", metadata=PAD, max_output_tokens=2).id for _ in range(3)]
    ids = small[2:] + big
    gone = [rid for rid in ids if _missing(client, rid)]
    assert gone == ids[:len(gone)] and big[0] in gone and big[-1] not in gone  # the oldest first
    assert len(ids) - len(gone) < STORE_COUNT - 1  # bytes, not the count, made room


def test_the_store_keeps_nothing_larger_than_its_bytes():
    store = ResponseStore(max_count=10, max_bytes=2_000)
    assert store.put("a", {"k": "x" * 500}, []) and store.put("b", {"k": "x" * 500}, [])
    assert not store.put("c", {"k": "x" * 3_000}, []) and store.get("c") is None
    assert store.get("a") and store.get("b") and store.bytes == size_of({"k": "x" * 500}, []) * 2
    assert store.put("d", {"k": "x" * 1_600}, []) and store.get("a") is None and store.get("b") is None
    assert store.evicted == 2 and list(store.entries) == ["d"]


def _missing(client, rid: str) -> bool:
    try:
        client.responses.retrieve(rid)
        return False
    except openai.NotFoundError:
        return True


def test_cancel_a_streaming_response(stack, client, model):
    seen = []
    with client.responses.stream(model=model, input="go on", max_output_tokens=CAP - 100,
                                 extra_body={"ignore_eos": True}) as s:
        for e in s:
            seen.append(e)
            if e.type == "response.output_text.delta" and len(seen) == 5:
                status, body = post(stack, f"/v1/responses/{seen[0].response.id}/cancel", {})
                assert status == 200 and body["status"] == "cancelled", body
    last = seen[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert last.response.usage.output_tokens < CAP - 100
    assert client.responses.retrieve(last.response.id).status == "cancelled"
    status, body = post(stack, f"/v1/responses/{last.response.id}/cancel", {})
    assert status == 200 and body["status"] == "cancelled"  # cancelling twice answers the same


def test_background_response_runs_and_is_cancelled(stack, client, model):
    done = client.responses.create(model=model, input="bg", background=True, max_output_tokens=4, temperature=0)
    assert done.status in ("queued", "in_progress") and done.background
    wait_until(lambda: client.responses.retrieve(done.id).status not in ("queued", "in_progress"), 30,
               "the background response's end")
    assert client.responses.retrieve(done.id).status == "incomplete"
    status, body = post(stack, f"/v1/responses/{done.id}/cancel", {})
    assert status == 400 and body["error"]["code"] == "response_not_running"
    running = client.responses.create(model=model, input="bg", background=True, max_output_tokens=CAP - 100,
                                      extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < CAP - 100
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", background=True, store=False)
    assert e.value.body["param"] == "store"


@pytest.mark.parametrize("body,status,code,param", [
    ({"input": "x", "foo": 1}, 400, "unknown_parameter", "foo"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a", "x": 1}]}]}, 400,
     "unknown_parameter", "input[0].content[0].x"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://a"}]}]}, 400,
     "unsupported_content", "input[0].content[0].type"),
    ({"input": "x", "conversation": "c"}, 400, "unsupported_parameter", "conversation"),
    ({"input": []}, 400, "invalid_request", "input"),
    ({"input": "x", "max_output_tokens": CAP + 1}, 400, "invalid_request", "max_output_tokens"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "invalid_tools",
     "tool_choice.name"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}],
      "tool_choice": "required"}, 400, "invalid_schema", "tools[0].parameters"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "bogus"}}}}, 400,
     "invalid_schema", "text.format.schema"),
    ({"input": "x", "model": "gpt-9"}, 404, "model_not_found", "model"),
    ({"input": "x", "tools": [{"type": "teleport"}]}, 400, "invalid_tools", "tools[0].type"),
])
def test_errors_name_the_field_in_openai_shape(stack, body, status, code, param):
    got, err = post(stack, "/v1/responses", body)
    assert got == status and set(err) == {"error"}, err
    assert err["error"]["code"] == code and err["error"]["param"] == param, err
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_fields_real_clients_send_are_accepted(client, model):
    r = client.responses.create(
        model=model, input=[{"type": "message", "id": "msg_1", "role": "developer",
                             "content": [{"type": "input_text", "text": "rules"}]},
                            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
                            {"role": "user", "content": "hi"}],
        tools=[{"type": "web_search"}, WEATHER], include=["reasoning.encrypted_content"], store=False,
        reasoning={"summary": "auto"}, prompt_cache_key="k", parallel_tool_calls=True, max_output_tokens=3,
        extra_body={"client_metadata": {"a": "b"}})
    assert r.status == "incomplete" and r.store is False


@pytest.mark.parametrize("stream", [False, True])
def test_joint_output_equals_baseline_greedy(client, model, stream):
    def run(mode: str) -> str:
        kw = dict(model=model, input="tell me", max_output_tokens=40, temperature=0, extra_body={"mode": mode})
        if not stream:
            r = client.responses.create(**kw)
            assert r.model_extra["metrics"]["mode"] == mode
            return r.output_text
        with client.responses.stream(**kw) as s:
            return "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert run("joint") == run("baseline")


def test_metrics_and_openapi_show_responses(stack, client, model):
    client.responses.create(model=model, input="count me", max_output_tokens=2)
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
        samples = {(s.name, tuple(s.labels.items())): s.value
                   for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    assert samples[("verity:requests_by_kind_total", (("kind", "responses"),))] >= 1
    with urllib.request.urlopen(stack.url + "/v1/verity/stats", timeout=10) as r:
        assert json.loads(r.read())["totals"]["kinds"]["responses"] >= 1
    with urllib.request.urlopen(stack.url + "/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    assert {"/v1/responses", "/v1/responses/{id}", "/v1/responses/{id}/cancel"} <= set(doc["paths"])
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    from protocol.responses import ResponsesRequest
    assert set(props) == set(ResponsesRequest.__struct_fields__)
    assert props["max_output_tokens"]["anyOf"][0]["maximum"] == CAP


# ---- a thinking template: the think block is a reasoning item ----

BUDGET = 8  # --max-thinking-tokens: the random model never closes its block itself


@pytest.fixture(scope="module")
def thinking(thinking_pair):
    target, draft = thinking_pair
    with Stack(str(target), "--draft", str(draft), "--draft-budget", "2", "--max-tokens-cap", "256",
               "--max-thinking-tokens", str(BUDGET)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    assert s.exit_code == 0 and "Traceback" not in s.log(), s.log()


def test_reasoning_is_an_item_before_the_answer(thinking):
    kw = dict(model=thinking.models.list().data[0].id, input="hello", max_output_tokens=30, temperature=0)
    with thinking.responses.stream(**kw) as s:
        events = list(s)
    assert _kinds(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    final = events[-1].response
    thought, answer = final.output
    assert thought.type == "reasoning" and answer.type == "message" and final.output_text
    said = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert said and thought.content[0].text == said and "</think>" not in said + final.output_text
    assert 0 < final.usage.output_tokens_details.reasoning_tokens <= BUDGET + 1
    whole = thinking.responses.create(**kw)
    assert [o.model_dump(exclude={"id"}) for o in whole.output] == [o.model_dump(exclude={"id"}) for o in final.output]
    joint = thinking.responses.create(**kw, extra_body={"mode": "joint"})
    assert [o.model_dump(exclude={"id"}) for o in joint.output] == [o.model_dump(exclude={"id"}) for o in final.output]
    off = thinking.responses.create(**kw, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        thinking.responses.create(**kw, reasoning={"effort": "high"}, extra_body={"thinking": False})
    assert e.value.body["param"] == "reasoning.effort"


def test_a_client_that_leaves_cancels_its_response(stack, model):
    import httpx

    body = {"model": model, "input": "go on", "stream": True, "max_output_tokens": CAP - 100, "ignore_eos": True}
    with httpx.stream("POST", stack.url + "/v1/responses", json=body, timeout=60) as r:
        rid = r.headers["X-Request-Id"]
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                break  # leave mid-stream
    wait_until(stack.idle, 30, "the left response cancelled and its slot free")
    assert f"[{rid}] client went away: cancelling" in stack.log()
    status, kept = post(stack, f"/v1/responses/{rid}/cancel", {})
    assert status == 200 and kept["status"] == "cancelled" and kept["output"][0]["status"] == "incomplete"


def test_the_time_limit_ends_a_response(tiny_llama, model):
    # slowed to 5 ms a step: CAP tokens take 5 s or more, however fast the machine
    with Stack(str(tiny_llama), "--request-timeout-s", "1", "--max-tokens-cap", str(CAP),
               env={"VERITY_FAULT_STEP_DELAY_S": "0.005"}) as s:
        slow = {"input": "go on", "max_output_tokens": CAP, "temperature": 0}
        status, err = post(s, "/v1/responses", {**slow, "ignore_eos": True})
        assert status == 504 and err["error"]["code"] == "request_timeout"
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        with client.responses.stream(model=model, **slow, extra_body={"ignore_eos": True}) as st:
            events = list(st)
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert events[-1].response.status == "failed" and events[-1].response.error.code == "request_timeout"
        wait_until(s.idle, 30, "the timed-out responses' slots free")
    assert s.exit_code == 0 and "Traceback" not in s.log(), s.log()
