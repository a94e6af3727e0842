"""Bad input: random bytes and structures into the protocol decoders (hypothesis), hand-written
hostile HTTP requests, and schemathesis fuzzing the live API from its own /openapi.json.

Covered elsewhere, not repeated here: schema rejections naming the field and malformed bodies at
the parser (test_protocol.py); over HTTP, wrong types and values, unsupported fields, max_tokens
over the cap, an unknown model, joint without a draft, a body over the limit, a bad or missing API
key, malformed JSON and a prompt over the context limit (test_stack.py test_errors_are_openai_objects,
test_prompt_over_context_limit_is_400).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import FULL
from gateway import openapi as shapes
from protocol import codec, messages as m
from protocol.schema import RequestInvalid, parse_request
from stack import Stack, until
from test_protocol import METRICS, REQ, ROUND_TRIPS

KEY = "fuzz-key-456"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 16
EXAMPLES = 400 if FULL else 100  # hypothesis examples per decoder property
FUZZ_EXAMPLES = 150 if FULL else 60  # schemathesis examples per operation
HYPOTHESIS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not FULL, database=None,
                      suppress_health_check=list(HealthCheck))
DECODERS = [codec.job_decoder, codec.control_decoder, codec.worker_out_decoder, codec.supervisor_decoder,
            codec.stats_decoder]

# ---- the decoders: only typed errors come out ----

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(list(m.GenerateRequest.__struct_fields__) + ["role", "content", "include_usage", "type"])
        | st.text(max_size=8), inner, max_size=6),
    max_leaves=30)
# objects shaped like requests: known fields with random values, so decoding gets past the first key
request_like = st.fixed_dictionaries({}, optional={
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.text()}) | json_values, max_size=3) | json_values,
    "prompt": st.text() | json_values, "max_tokens": st.integers(-5, 5000) | json_values,
    "temperature": st.floats() | json_values, "top_p": st.floats() | json_values,
    "stop": st.lists(st.text(max_size=3), max_size=6) | json_values, "stream": json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": json_values}) | json_values,
    "mode": st.sampled_from(["baseline", "joint", "x"]) | json_values, "n": json_values,
    "seed": st.integers(-(2**64), 2**64) | json_values, "model": json_values})
ENCODED = [codec.encode(msg) for _, msg in ROUND_TRIPS]


def decode_or_typed_error(make_decoder, data: bytes) -> None:
    try:
        msg = make_decoder().decode(data)
    except msgspec.DecodeError:  # msgspec.ValidationError is a subclass
        return
    assert make_decoder().decode(codec.encode(msg)) == msg  # what decodes, round-trips


def parse_or_refuse(data: bytes, endpoint: str) -> None:
    try:
        req = parse_request(data, endpoint)
    except RequestInvalid as e:
        assert e.message and e.code
        return
    assert (req.messages is not None) == (endpoint == "chat") and (req.prompt is not None) == (endpoint != "chat")
    assert req.max_completion_tokens is None and (req.stop is None or isinstance(req.stop, list))
    assert codec.job_decoder().decode(codec.encode(m.SubmitRequest("r", req))).request == req


@HYPOTHESIS
@given(data=st.binary(max_size=512))
def test_random_bytes_give_typed_errors_only(data):
    for make in DECODERS:
        decode_or_typed_error(make, data)
    for endpoint in ("chat", "completion"):
        parse_or_refuse(data, endpoint)


@HYPOTHESIS
@given(value=json_values | request_like)
def test_random_structures_give_typed_errors_only(value):
    try:
        packed = msgspec.msgpack.encode(value)
    except OverflowError:  # msgpack has no integers past 64 bits
        packed = None
    for make in DECODERS if packed is not None else ():
        decode_or_typed_error(make, packed)
    text = json.dumps(value).encode()
    for endpoint in ("chat", "completion"):
        parse_or_refuse(text, endpoint)


@HYPOTHESIS
@given(which=st.integers(0, len(ENCODED) - 1), edits=st.lists(
    st.tuples(st.integers(0, 4096), st.integers(0, 255), st.sampled_from(["flip", "insert", "delete"])),
    min_size=1, max_size=4))
def test_corrupted_wire_messages_give_typed_errors_only(which, edits):
    data = bytearray(ENCODED[which])
    for pos, byte, op in edits:
        pos %= len(data) + (op == "insert")
        if op == "flip" and data:
            data[pos % len(data)] ^= byte or 1
        elif op == "insert":
            data.insert(pos, byte)
        elif data:
            del data[pos % len(data)]
    for make in DECODERS:
        decode_or_typed_error(make, bytes(data))


def test_decoders_survive_what_hypothesis_rarely_builds():
    nested = b"\x91" * 100_000 + b"\xc0"  # 100k nested msgpack arrays
    deep_json = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for make in DECODERS:
        decode_or_typed_error(make, nested)
        decode_or_typed_error(make, b"\xdd\xff\xff\xff\xff")  # array header claiming 4G items
        decode_or_typed_error(make, b"\xdb\xff\xff\xff\xff")  # str header claiming 4 GiB
    for endpoint in ("chat", "completion"):
        parse_or_refuse(deep_json, endpoint)
        parse_or_refuse(b'{"max_tokens": 1e400, "prompt": "x"}', endpoint)
        parse_or_refuse(b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}', endpoint)
    assert codec.worker_out_decoder().decode(codec.encode(m.EventBatch(1, [m.Finished("r", "stop", METRICS)])))
    assert REQ.mode == "joint"


# ---- hostile HTTP on a live stack ----


@pytest.fixture(scope="module")
def served(tiny_llama):
    with Stack(str(tiny_llama), "--api-key", KEY, "--max-active", "2", "--queue-size", "8",
               "--max-tokens-cap", str(CAP), "--max-body-bytes", "65536") as s:
        yield s
    assert s.exit_code == 0, s.log()[-3000:]


async def raw_http(url: str, request: bytes, read_timeout: float = 10.0) -> bytes:
    """Sends bytes as they are (no client library fixing them up) and returns the raw answer."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1 << 20), read_timeout)
    finally:
        writer.close()


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.") else 0


def request_bytes(url: str, body: bytes, path="/v1/chat/completions", headers: str = "", method="POST") -> bytes:
    host = urlsplit(url).netloc
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n"
            ).encode() + body


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
# (name, raw body, expected status, words the error message must contain)
BODIES = [
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe\xfd"}]}', 400, "not valid UTF-8"),
    ("lone surrogate escapes", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', 400, "surrogate"),
    ("empty body", b"", 400, "not valid JSON"),
    ("JSON null", b"null", 400, "Expected `object`"),
    ("JSON string", b'"hello"', 400, "Expected `object`"),
    ("truncated JSON", json.dumps(CHAT).encode()[:-3], 400, "not valid JSON"),
    ("100k nested arrays", b'{"messages": ' + b"[" * 30000 + b"]" * 30000 + b"}", 400, "nested at most 128"),
    ("number too large", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}', 400, "max_tokens"),
    ("integer past int64", b'{"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}', 400, "seed"),
    ("NaN", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "not valid JSON"),
    ("UTF-8 BOM", b"\xef\xbb\xbf" + json.dumps(CHAT).encode(), 400, "not valid JSON"),
    ("20k empty messages", json.dumps({"messages": [{"role": "user", "content": ""}] * 1500}).encode(), 400, "context limit"),
]


@pytest.mark.parametrize("name,body,status,words", BODIES, ids=[b[0] for b in BODIES])
async def test_hostile_bodies_get_openai_errors(served, name, body, status, words):
    raw = await raw_http(served.url, request_bytes(served.url, body))
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert status_of(raw) == status, raw[:300]
    err = json.loads(payload)["error"]
    assert words in err["message"] and err["code"], err


def deep_schema(depth: int) -> bytes:
    """A chat body whose response_format schema nests `depth` objects (3,000: 18 KB)."""
    return (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
            b'"json_schema": {"name": "x", "schema": ' + b'{"x":' * depth + b"{}" + b"}" * depth + b"}}}")


async def test_a_deep_schema_is_one_400_and_one_log_line(served, reliability):
    """Parsing recurses (msgspec's decoder, then every walk of the schema): at 3,000 levels it overflowed
    Python's stack, a 500 with a traceback. The raw body's depth is measured first, without recursion."""
    seen = {}
    async with aiohttp.ClientSession() as http:
        for depth in (300, 3000):
            async with http.post(served.url + "/v1/chat/completions", data=deep_schema(depth),
                                 headers={**AUTH, "Content-Type": "application/json"}) as r:
                err, rid = (await r.json())["error"], r.headers["X-Request-Id"]
                assert r.status == 400 and err["code"] == "json_too_deep" and "at most 128 levels" in err["message"], err
                seen[depth] = (len(deep_schema(depth)), rid)
    for _, rid in seen.values():
        await until(lambda: rid in served.log(), 10, "the refusal's log line")
        assert sum(rid in line for line in served.log().splitlines()) == 1
    assert "Traceback" not in served.log() and "RecursionError" not in served.log()
    reliability.record(
        "bad_input", "A schema nested 3,000 objects deep",
        "response_format schemas nested 300 and 3,000 objects deep. The body's JSON depth is measured on the raw "
        "bytes (strings skipped, brackets summed) before anything recursive reads it; past 128 levels it is a 400 "
        "naming the limit, one log line, no traceback.",
        expected="400 json_too_deep naming the limit; one log line each; no traceback",
        bodies={f"depth {d}": f"{size} bytes, 400" for d, (size, _) in seen.items()}, lost=0, hung=0, leaked="none")


async def test_log_probabilities_stay_json_under_a_vanishing_penalty(served):
    """repetition_penalty 5e-324 (schemathesis's) sends logits to infinity and log-probabilities to
    -inf, which JSON cannot carry: they come as -9999.0, OpenAI's value for an impossible token."""
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the response"))

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1,  # sampled: temperature 1
            "logprobs": True, "top_logprobs": 2, "repetition_penalty": 5e-324}
    async with aiohttp.ClientSession() as http:
        async with http.post(served.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status == 200 and strict(await r.text())["choices"][0]["logprobs"]["content"]
        async with http.post(served.url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as r:
            chunks = [strict(x[6:]) for x in (await r.text()).splitlines() if x.startswith("data: {")]
    assert chunks and r.status == 200


async def test_text_with_control_characters_is_served(served):
    text = "nul\u0000 bell\u0007 esc\u001b[31m del\u007f bidi\u202e zero-width\u200b é 😀 \r\n"
    async with aiohttp.ClientSession() as http:
        for body, path in (({**CHAT, "messages": [{"role": "user", "content": text}]}, "/v1/chat/completions"),
                           ({"prompt": text, "max_tokens": 4}, "/v1/completions"),
                           ({**CHAT, "stop": ["\u0000", "😀"], "stream": True}, "/v1/chat/completions")):
            async with http.post(served.url + path, json=body, headers=AUTH) as r:
                assert r.status == 200, await r.text()
                await r.read()


async def test_hostile_requests_at_the_http_layer(served, reliability):
    url = served.url
    big = b'{"prompt": "' + b"x" * 5_000_000 + b'"}'
    cases = {
        "5 MB body (declared)": (request_bytes(url, big), 413),
        "body over the limit, chunked": (
            request_bytes(url, b"", headers="Transfer-Encoding: chunked\r\n").replace(b"Content-Length: 0\r\n", b"")
            + b"".join(b"%x\r\n%s\r\n" % (60000, b"x" * 60000) for _ in range(3)) + b"0\r\n\r\n", 413),
        "GET on a POST route": (request_bytes(url, b"", method="GET"), 405),
        "unknown path": (request_bytes(url, b"{}", path="/v1/nothing-here"), 404),
        "unknown method": (request_bytes(url, b"", method="BREW"), 400),
        "64 KiB header": (request_bytes(url, b"{}", headers="X-Junk: " + "a" * 65536 + "\r\n"), 400),
        "header with a bare CR": (request_bytes(url, b"{}", headers="X-Junk: a\rb\r\n"), 400),
        "Authorization in Latin-1 bytes": (request_bytes(url, json.dumps(CHAT).encode()).replace(
            f"Bearer {KEY}".encode(), b"Bearer \xe9\xff\xfe"), 401),
        "Bearer with no token": (request_bytes(url, json.dumps(CHAT).encode()).replace(
            f"Bearer {KEY}".encode(), b"Bearer "), 401),
        "lowercase scheme (RFC 7235: case-insensitive)": (
            request_bytes(url, json.dumps(CHAT).encode()).replace(b"Bearer ", b"bearer "), 200),
        "key with a suffix": (request_bytes(url, json.dumps(CHAT).encode()).replace(KEY.encode(), KEY.encode() + b"x"), 401),
        "Content-Length longer than the body": (request_bytes(url, b"{}").replace(b"Content-Length: 2", b"Content-Length: 20"), 0),
        "two Content-Length headers": (request_bytes(url, b"{}", headers="Content-Length: 5\r\n"), 400),
        "not HTTP at all": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)), 400),
    }
    seen = {}
    for name, (raw, status) in cases.items():
        try:
            answer = await raw_http(url, raw, read_timeout=1.0 if status == 0 else 10.0)
        except asyncio.TimeoutError:
            answer = b""  # an incomplete body: the server waits for the rest (the client gives up)
        except ConnectionError:
            answer = b"HTTP/1.1 000 reset"
        got = status_of(answer)
        seen[name] = got
        assert got == status or (status == 0 and got in (0, 400)), (name, answer[:300])
        if got in (401, 404, 405, 413):
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"], (name, answer[:300])
    status, body = served.health()
    assert status == 200 and body["admitted"] == 0
    reliability.record(
        "bad_input", "Hostile requests at the HTTP layer",
        "Raw sockets sending what clients libraries would not: oversized and chunked bodies, wrong methods and "
        "paths, oversized and malformed headers, odd Authorization values, lying Content-Length, TLS bytes. "
        "Every one gets a 4xx (an OpenAI error object where the gateway answers; aiohttp's parser answers "
        "malformed HTTP) and the server keeps serving.",
        cases=len(cases), **{name.replace(" ", "_"): status or "no answer: the server waits for the rest "
                             "(the client gives up)" for name, status in seen.items()})


async def test_hand_written_bad_bodies_recorded(served, reliability):
    """Counts the hand-written bad bodies (run above) for docs/reliability.md and checks nothing leaked."""
    status, body = await asyncio.to_thread(served.health)
    assert status == 200 and body["admitted"] == 0
    reliability.record(
        "bad_input", "Hand-written bad bodies",
        "Each sent raw: " + "; ".join(f"{name} → {st}" for name, _, st, _ in BODIES) + ". Plus control "
        "characters, bidi and zero-width characters in prompts and stop strings (served: 200). Cases already "
        "in test_stack.py / test_protocol.py (wrong types, unknown and unsupported fields, max_tokens over "
        "the cap, unknown model, bad or missing API key, prompt over the context limit, body over the "
        "limit) are not repeated.",
        bodies=len(BODIES))


# ---- the OpenAPI description and schemathesis ----


async def test_openapi_describes_the_structs_and_real_responses_fit_it(served):
    async with aiohttp.ClientSession() as http:
        async with http.get(served.url + "/openapi.json") as r:
            doc = await r.json()
        schemas = doc["components"]["schemas"]
        fields = set(m.GenerateRequest.__struct_fields__)
        assert set(schemas["ChatCompletionRequest"]["properties"]) == fields - {"prompt"}
        assert set(schemas["CompletionRequest"]["properties"]) == fields - {"messages"}
        assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == CAP
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        async with http.post(served.url + "/v1/chat/completions", json=CHAT, headers=AUTH) as r:
            msgspec.convert(await r.json(), shapes.ChatCompletion)
        async with http.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=AUTH) as r:
            msgspec.convert(await r.json(), shapes.Completion)
        for path, kind in (("/v1/chat/completions", shapes.ChatCompletionChunk), ("/v1/completions", shapes.CompletionChunk)):
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            if kind is shapes.CompletionChunk:
                body = {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(served.url + path, json=body, headers=AUTH) as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("data: {"):
                        msgspec.convert(json.loads(line[6:]), kind)
        async with http.get(served.url + "/v1/models", headers=AUTH) as r:
            msgspec.convert(await r.json(), shapes.ModelList)
        async with http.get(served.url + "/health") as r:
            msgspec.convert(await r.json(), shapes.Health)
        async with http.post(served.url + "/v1/chat/completions", json={}, headers=AUTH) as r:
            msgspec.convert(await r.json(), shapes.ErrorResponse)


def test_schemathesis_finds_no_server_error(served, tmp_path, reliability):
    """schemathesis's CLI against the live stack (its pytest plugin does not run on pytest 9), with every
    check it has except positive_data_acceptance, replaced by ours (tests/schemathesis_hooks.py: valid
    requests are served, or refused for a rule the description states in words only)."""
    har = tmp_path / "fuzz.har"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", served.url + "/openapi.json", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--max-examples", str(FUZZ_EXAMPLES),
           "--header", f"Authorization: Bearer {KEY}", "--workers", "1", "--request-timeout", "30",
           "--report", "har", "--report-har-path", str(har), "--suppress-health-check", "all",
           "--output-truncate", "false", *([] if FULL else ["--seed", "1"])]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    by_op = collections.defaultdict(collections.Counter)
    for e in entries:
        path = urlsplit(e["request"]["url"]).path
        op = "/v1/models/{model}" if path.startswith("/v1/models/") else path
        if path.startswith("/v1/responses/"):
            op = "/v1/responses/{id}/cancel" if path.endswith("/cancel") else "/v1/responses/{id}"
        by_op[f"{e['request']['method']} {op}"][e["response"]["status"]] += 1
    for op in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/responses"):
        assert by_op[op][200] > 0, (op, dict(by_op[op]))  # a server that refuses everything does not pass
    assert not any(status >= 500 for c in by_op.values() for status in c), dict(by_op)
    status, body = served.health()
    assert status == 200 and body["admitted"] == 0
    reliability.record(
        "bad_input", "schemathesis against /openapi.json",
        f"schemathesis {schemathesis.__version__} (CLI) generates requests from the served OpenAPI description, "
        f"valid and invalid, in all its phases (examples, coverage, fuzzing, stateful; up to {FUZZ_EXAMPLES} "
        "examples per operation), with all its checks (no server error, status codes, content types, response "
        "headers and schemas, invalid data refused, auth enforced, ...) and ours in place of "
        "positive_data_acceptance: valid requests are served (or refused for a rule stated only in words).",
        requests=len(entries), seconds=round(took, 1), server_errors=0,
        **{op: ", ".join(f"{st}×{n}" for st, n in sorted(c.items())) for op, c in sorted(by_op.items())
           if op in DOCUMENTED},
        undeclared_methods=", ".join(f"{st}×{n}" for st, n in sum(
            (c for op, c in by_op.items() if op not in DOCUMENTED), collections.Counter()).items()))


DOCUMENTED = {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
              "GET /health", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses",
              "GET /v1/responses/{id}", "DELETE /v1/responses/{id}", "POST /v1/responses/{id}/cancel"}
