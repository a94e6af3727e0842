"""Protocol round trips and every rejection of the request schema."""

import json

import msgspec
import pytest

from protocol import codec, messages as m
from protocol.schema import (UNSUPPORTED_FIELDS, RequestInvalid, message_text, parse_request, resolve_max_tokens,
                             split_prompts, top_logprobs)

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
        "accepted", "rollbacks", "ttft_s", "decode_tps", "recovery_s", "budget_mean", "reasoning_tokens"]


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
    ({"temperature": "hot"}, "temperature", "Expected `float | null`"),
    ({"top_p": 0}, "top_p", "> 0.0"),
    ({"top_p": 1.5}, "top_p", "<= 1.0"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 1.5}, "max_tokens", "Expected `int"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", ">= 1"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "differ"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"stream": "yes"}, "stream", "Expected `bool | null`"),
    ({"mode": "fast"}, "mode", "Invalid enum value 'fast'"),
    ({"thinking": "no"}, "thinking", "Expected `bool"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "must not be empty"),
    ({"stop": 5}, "stop", "Expected `str | array"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when `stream` is true"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown field"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "Invalid enum value 'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type", "`video`"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "needs its `text`"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "`image_url` are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type", "`input_audio` are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "alt": 1}]}]},
     "messages[0].content[0].alt", "unknown field"),
    ({"messages": [{"role": "user", "content": "x", "nick": "n"}]}, "messages[0].nick", "unknown field"),
    ({"prompt": "x"}, "prompt", "belongs to /v1/completions"),
    ({"foo": 1}, "foo", "unknown field `foo`"),
    ({"n": 9}, "n", "<= 8"),
    ({"n": 0}, "n", ">= 1"),
    ({"presence_penalty": 2.5}, "presence_penalty", "<= 2.0"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "regex"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "<= 100.0"),
    ({"top_logprobs": 2}, "top_logprobs", "needs `logprobs`: true"),
    ({"logprobs": 3}, "logprobs", "true or false"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "<= 20"),
    ({"echo": True}, "echo", "belongs to /v1/completions"),
    ({"audio": {"voice": "x"}}, "audio", "not supported"),
    ({"store": True}, "store", "not supported"),
])
def test_schema_rejections_name_the_field(fields, param, words):
    e = reject(body(**fields))
    assert e.param == param
    assert words in e.message
    assert param.split("[")[0].split(".")[0] in e.message or param in e.message


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_openai_fields_take_null_only(name):
    parse_request(body(**{name: None}), "chat")
    e = reject(body(**{name: {"store": True, "best_of": 2, "service_tier": "flex", "suffix": "x"}.get(name, {"x": 1})}))
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
    for prompt, words in (([], "empty list"), (["a", 1], "mixes"), ([[1], []], "empty list of token ids")):
        e = reject(json.dumps({"prompt": prompt}).encode(), "completion")
        assert e.param == "prompt" and words in e.message
    for fields, param in (({"logprobs": True}, "logprobs"), ({"logprobs": 1, "echo": True}, "echo"),
                          ({"suffix": "end"}, "suffix"), ({"top_logprobs": 1}, "top_logprobs")):
        assert reject(json.dumps({"prompt": "x", **fields}).encode(), "completion").param == param


def test_what_openai_clients_send_is_accepted():
    """null for every optional field; content parts, developer, name, refusal; prompt arrays."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "max_tokens", "stop", "seed", "stream_options", "user",
                               "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                               "top_k", "min_p", "repetition_penalty", "store", "metadata", "service_tier",
                               "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
                               "stream", "mode", "ignore_eos")}
    r = parse_request(body(**nulls), "chat")
    assert (r.n, r.stream, r.mode, r.temperature, r.ignore_eos) == (1, False, "baseline", None, False)
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}], "name": "ops"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": "no"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "still no"}]},
            {"role": "user", "content": "ok", "name": "bob"}]
    r = parse_request(json.dumps({"messages": msgs, "logprobs": True, "top_logprobs": 3, "n": 2}).encode(), "chat")
    assert [message_text(x) for x in r.messages] == ["be brief", "a\nb", "no", "still no", "ok"]
    assert top_logprobs(r) == 3
    for prompt, split in (("x", ["x"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])):
        c = parse_request(json.dumps({"prompt": prompt, "echo": False, "suffix": None, "logprobs": 2}).encode(),
                          "completion")
        assert split_prompts(c.prompt) == split and top_logprobs(c) == 2


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
