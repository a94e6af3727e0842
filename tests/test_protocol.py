"""Protocol round trips and every rejection of the request schema."""

import json

import msgspec
import pytest

from protocol import codec, messages as m
from protocol.schema import UNSUPPORTED_FIELDS, RequestInvalid, parse_request, resolve_max_tokens

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def body(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def reject(raw: bytes, endpoint="chat") -> RequestInvalid:
    with pytest.raises(RequestInvalid) as e:
        parse_request(raw, endpoint)
    return e.value


METRICS = m.RequestMetrics(mode="joint", draft="d1", prompt_tokens=3, completion_tokens=4, reused_tokens=1,
                           cycles=2, drafted=5, accepted=3, rollbacks=1, ttft_s=0.5, decode_tps=9.5,
                           recovery_s=0.01, budget_mean=2.5)
REQ = parse_request(body(max_tokens=5, stop="x", seed=7, mode="joint", thinking=False), "chat")

ROUND_TRIPS = [
    (codec.job_decoder, m.SubmitRequest("r1", REQ)),
    (codec.control_decoder, m.CancelRequest("r1")),
    (codec.control_decoder, m.DropOrphans(gateway_pid=7)),
    (codec.job_decoder, m.SubmitRequest("r2", REQ, gateway_pid=9)),
    (codec.worker_out_decoder, m.Ready(process="worker", pid=1, model_id="x", cache_identity="c",
                                       context_limit=8, joint_available=True, draft_id="d")),
    (codec.worker_out_decoder, m.EventBatch(3, [m.Queued("r", 2), m.Started("r", 2), m.TextDelta("r", "é😀", [1, 2]),
                                                m.Finished("r", "stop", METRICS), m.Error("r", "c", "msg", 400, "p")])),
    (codec.supervisor_decoder, m.WorkerDown(pid=4, exit_code=-9)),
    (codec.supervisor_decoder, m.Ready(process="gateway", pid=2, url="http://x")),
    (codec.stats_decoder, m.StatsSnapshot(process="worker", pid=1, time=1.5, queue_depth=2, active=1)),
]


@pytest.mark.parametrize("make_decoder,msg", ROUND_TRIPS, ids=lambda x: type(x).__name__)
def test_round_trip(make_decoder, msg):
    assert make_decoder().decode(codec.encode(msg)) == msg


def test_decoders_refuse_other_messages():
    with pytest.raises(codec.DecodeError):
        codec.job_decoder().decode(codec.encode(m.CancelRequest("r")))
    with pytest.raises(codec.DecodeError):
        codec.control_decoder().decode(b"\xc1garbage")


def test_metrics_keys_are_fixed():
    assert list(msgspec.structs.asdict(m.RequestMetrics())) == [
        "mode", "draft", "prompt_tokens", "completion_tokens", "reused_tokens", "cycles", "drafted",
        "accepted", "rollbacks", "ttft_s", "decode_tps", "recovery_s", "budget_mean"]


def test_valid_request_is_normalized():
    r = parse_request(body(max_completion_tokens=9, stop="END", n=1, presence_penalty=0, frequency_penalty=0,
                           user="u", stream=True, stream_options={"include_usage": True}), "chat")
    assert (r.max_tokens, r.max_completion_tokens, r.stop) == (9, None, ["END"])
    assert r.stream_options.include_usage
    assert parse_request(body(max_tokens=4, max_completion_tokens=4), "chat").max_tokens == 4
    c = parse_request(json.dumps({"prompt": "Once"}).encode(), "completion")
    assert c.prompt == "Once" and c.messages is None and c.mode == "baseline"


@pytest.mark.parametrize("fields,param,words", [
    ({"temperature": 2.5}, "temperature", "<= 2.0"),
    ({"temperature": -1}, "temperature", ">= 0.0"),
    ({"temperature": "hot"}, "temperature", "Expected `float`"),
    ({"top_p": 0}, "top_p", "> 0.0"),
    ({"top_p": 1.5}, "top_p", "<= 1.0"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 1.5}, "max_tokens", "Expected `int"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", ">= 1"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "differ"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"stream": "yes"}, "stream", "Expected `bool`"),
    ({"mode": "fast"}, "mode", "Invalid enum value 'fast'"),
    ({"thinking": "no"}, "thinking", "Expected `bool"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "must not be empty"),
    ({"stop": 5}, "stop", "Expected `str | array"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when `stream` is true"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown field"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "Invalid enum value 'robot'"),
    ({"messages": [{"role": "user"}]}, "messages[0]", "missing required field `content`"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content", "Expected `str`"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name", "unknown field"),
    ({"prompt": "x"}, "prompt", "belongs to /v1/completions"),
    ({"foo": 1}, "foo", "unknown field `foo`"),
    ({"n": 2}, "n", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"frequency_penalty": 1}, "frequency_penalty", "not supported"),
])
def test_schema_rejections_name_the_field(fields, param, words):
    e = reject(body(**fields))
    assert e.param == param
    assert words in e.message
    assert param.split("[")[0].split(".")[0] in e.message or param in e.message


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_openai_fields_are_refused_by_name(name):
    e = reject(body(**{name: None}))
    assert (e.param, e.code) == (name, "unsupported_parameter")
    assert f"`{name}` is not supported" in e.message


@pytest.mark.parametrize("raw,words", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[]", "Expected `object`"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not valid UTF-8"),
    (b'{"messages": [{"role": "user", "content": "x"}]} trailing', "not valid JSON"),
])
def test_malformed_bodies(raw, words):
    assert words in reject(raw).message


def test_completion_endpoint_rules():
    assert "belongs to /v1/chat/completions" in reject(body(), "completion").message
    assert reject(b"{}", "completion").param == "prompt"


def test_max_tokens_cap():
    r = parse_request(body(), "chat")
    assert resolve_max_tokens(r, 64).max_tokens == 64
    with pytest.raises(RequestInvalid, match="exceeds this server's cap of 64") as e:
        resolve_max_tokens(parse_request(body(max_tokens=65), "chat"), 64)
    assert e.value.param == "max_tokens"


def test_control_characters_and_unicode_survive():
    text = "tab\tnul\u0000 bell\u0007 é 😀"
    r = parse_request(json.dumps({"messages": [{"role": "user", "content": text}]}).encode(), "chat")
    assert r.messages[0].content == text
    assert codec.job_decoder().decode(codec.encode(m.SubmitRequest("r", r))).request == r
