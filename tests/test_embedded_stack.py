"""What the embedded model's stack (SmolLM2-135M with its distilled draft, over HTTP) holds to:
a forced tool call ends clean, whole and streamed, baseline and joint; grammars compile on the
worker's pool, so heavy schemas hold up neither a running stream nor a small request; a schema
past the compiler's limits is a 400 naming the limit; a long prompt prefills in chunks sized by
their cost, so a running stream's gaps stay short however deep the prompt goes; Codex CLI, where
installed, answers through /v1/responses."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import time

import aiohttp
import openai
import pytest

from conftest import FULL
from stack import Stack, until

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def embedded():
    # chunks of up to 512 prompt tokens (the GPU's default): deep in a prompt, a fixed 512 cost seconds here
    with Stack("embedded", "--draft", "embedded", "--max-active", "8", "--prefill-step", "512") as s:
        yield s
    assert s.exit_code == 0, s.log()[-3000:]


async def sse(http: aiohttp.ClientSession, url: str, body: dict, times: list | None = None) -> list[dict]:
    """A streamed request's data chunks (their arrival times in `times`)."""
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        out = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                out.append(json.loads(line[6:]))
                if times is not None:
                    times.append(time.monotonic())
        return out


@pytest.mark.parametrize("mode", ["baseline", "joint"])
async def test_a_forced_call_ends_after_it_whole_and_streamed(embedded, mode, reliability):
    """tool_choice "required" with one function: the model calls once and may end there (the
    grammar allows EOS after every whole call, with nothing between calls to begin a repeat), so
    the reply is one call, no content, finish_reason "tool_calls", well under max_tokens."""
    body = {**FORCED, "mode": mode}
    async with aiohttp.ClientSession() as http:
        async with http.post(embedded.url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
        chunks = await sse(http, embedded.url, body)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert whole["usage"]["completion_tokens"] < FORCED["max_tokens"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and not any(d.get("content") for d in deltas)
    assert pieces[0]["id"] and pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert len(pieces) >= 4 and all(deltas[1:-1]), "arguments in pieces, and no empty chunks"
    reliability.record(
        "outputs", f"A forced tool call on the embedded model ({mode})",
        "tool_choice \"required\" with one function (get_weather(city)), greedy, max_tokens 60, whole and streamed, "
        "baseline and joint. Before: the model called, began the same call again, max_tokens cut it, and the "
        "response carried the call and the raw `<tool_call>` text, finish_reason length.",
        expected="one call, content null, finish_reason tool_calls; streamed arguments in pieces",
        **{f"{mode} tokens": whole["usage"]["completion_tokens"], f"{mode} streamed pieces": len(pieces),
           f"{mode} finish": choice["finish_reason"]})


def test_the_sdk_stream_helper_reads_a_forced_call(embedded):
    """The openai SDK's `.stream()` raised LengthFinishReasonError on the cut repeat; its partial
    argument parser now gets the arguments in pieces."""
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="none", max_retries=0)
    kinds = []
    model = client.models.list().data[0].id
    with client.chat.completions.stream(model=model, **FORCED) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert kinds.count("tool_calls.function.arguments.delta") >= 3, kinds


def heavy_schema(n: int, tag: str) -> dict:
    """n required string properties (10,000: 329 KB, the issue's heavy but legal schema)."""
    names = [f"{tag}{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "string"} for k in names}, "required": names}


def formatted(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "heavy", "schema": schema}}


async def test_heavy_schemas_compile_beside_a_stream_and_a_small_request(embedded, reliability):
    """Three schemas of 10,000 required properties sent at once beside a running stream, then a
    one-token request. Before: compiles ran on the jobs thread and matchers were built on the
    decode thread (the small request waited 13.6 s; the stream stalled 2.9 s). Now they compile on
    the pool: the small request is answered before the first heavy one is compiled, and no gap of
    the stream is as long as a compile (a decode thread that waited on one would show it whole)."""
    url = embedded.url
    small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    times: list[float] = []
    async with aiohttp.ClientSession() as http:
        t = time.monotonic()
        await (await http.post(url + "/v1/chat/completions", json=small)).read()
        alone = time.monotonic() - t
        stream = asyncio.create_task(sse(http, url, {"messages": ASK, "max_tokens": 300, "temperature": 0,
                                                     "ignore_eos": True}, times))
        await until(lambda: len(times) >= 8, 60, "the stream's first tokens")
        start, verdicts = time.monotonic(), []

        async def heavy(tag: str) -> None:
            body = {**small, "max_tokens": 2, "response_format": formatted(heavy_schema(10_000, tag)), "stream": True}
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                verdicts.append(time.monotonic())  # headers come with the worker's verdict: compiled
                assert r.status == 200, await r.text()
                await r.read()

        heavies = [asyncio.create_task(heavy(tag)) for tag in ("a", "b", "c")]
        await until(lambda: embedded.health()[1].get("admitted", 0) >= 4, 30, "the heavy requests admitted")
        t = time.monotonic()
        async with http.post(url + "/v1/chat/completions", json=small) as r:
            assert r.status == 200
            await r.read()
        waited, answered = time.monotonic() - t, time.monotonic()
        await asyncio.gather(*heavies)
        await stream
    window = [b - a for a, b in zip(times, times[1:]) if b > start and a < max(verdicts)]
    before = [b - a for a, b in zip(times, times[1:]) if b <= start]
    compiled = [float(x.split(" in ")[1].split("s ")[0]) for x in embedded.log().splitlines() if "grammar compiled" in x]
    assert answered < min(verdicts), (answered - start, [v - start for v in verdicts])
    compiled = compiled[-3:]
    assert max(window) < min(compiled), (max(window), compiled, statistics.median(before))
    reliability.record(
        "load", "Heavy schemas compiling beside a stream and a small request",
        "Three response_format schemas of 10,000 required string properties (329 KB each) sent at once beside a "
        "running 300-token stream, then a one-token request. Grammars compile on the worker's pool (one thread "
        "on 2 cores), cached by the hash of the fields that make them; the decode thread copies a compiled matcher.",
        expected="the small request answered before the first heavy compile ends; no stream gap as long as a compile",
        compile_s=compiled, small_request_s=round(waited, 3), small_request_alone_s=round(alone, 3),
        heavy_verdicts_after_s=[round(v - start, 2) for v in sorted(verdicts)],
        stream_longest_gap_s=round(max(window), 3), stream_median_gap_before_s=round(statistics.median(before), 3),
        lost=0, hung=0, leaked="none")



async def test_a_schema_past_the_limits_is_a_400_naming_it(embedded, reliability):
    """8,000 string properties with formats (447 KB) exceed initial_lexer_fuel, the bound on the
    work of compiling; the refusal is kept, so the same schema again is refused at once."""
    names = [f"f{i}" for i in range(8000)]
    schema = {"type": "object", "required": names, "properties": {
        k: {"type": "string", "format": ["email", "date-time", "uuid", "ipv4"][i % 4]} for i, k in enumerate(names)}}
    body = {"messages": ASK, "max_tokens": 4, "response_format": formatted(schema)}
    took = []
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            t = time.monotonic()
            async with http.post(embedded.url + "/v1/chat/completions", json={**body, "stream": stream}) as r:
                err = (await r.json())["error"]
                took.append(time.monotonic() - t)
                assert r.status == 400 and err["code"] == "grammar_too_large", err
                assert "initial_lexer_fuel" in err["message"] and err["param"] == "response_format.json_schema.schema"
    assert "Traceback" not in embedded.log()
    reliability.record(
        "bad_input", "A schema past the grammar compiler's limits",
        "8,000 string properties with formats (447 KB): the compile stops at llguidance's initial_lexer_fuel "
        "(1,000,000), on the worker's pool; then the same schema streamed.",
        expected="400 grammar_too_large naming the limit, before any stream header; the refusal kept",
        first_s=round(took[0], 2), again_streamed_s=round(took[1], 3), lost=0, hung=0, leaked="none")


# worker/prefill_cost.py aims a round at 0.8 of its 1.0 s CPU bound. On the 2-core machine shared
# with other test runs (load 5-9) a 2,150-token prompt gave the stream longest gaps of 1.97, 2.36 and
# 3.09 s (5 of some 60 over 1 s, the rest load), its deepest third's median gap 0.7 s against
# 0.8 s in its first; with chunks fixed at 512 tokens: 1.4, 3.0, 4.8, 7.4 and 9.0 s, rising with depth
LONG_GAP_BOUND_S = 6.0
DEEP_OVER_EARLY = 1.5  # the deepest third's median gap over the first third's, at most


async def test_a_long_prompt_beside_a_stream_keeps_its_gaps_short(embedded, reliability):
    """A long prompt arrives beside a running stream. Its chunks were capped in tokens only (here
    512), and a chunk deep in a long context costs far more than one near its start: an 8,190-token
    prompt gave a stream a 14.5 s gap. Chunks are now sized by their measured cost at their depth."""
    words = 2700 if FULL else 760  # 8,100 and 2,300 prompt tokens
    long = {"messages": [{"role": "user", "content": " ".join(f"word{i % 50}" for i in range(words))}],
            "max_tokens": 1, "temperature": 0}
    times: list[float] = []
    async with aiohttp.ClientSession() as http:
        stream = asyncio.create_task(sse(http, embedded.url, {"messages": ASK, "max_tokens": 2048, "temperature": 0,
                                                              "ignore_eos": True}, times))
        await until(lambda: len(times) >= 8, 60, "the stream's first tokens")
        start = time.monotonic()
        async with http.post(embedded.url + "/v1/chat/completions", json=long) as r:
            body = await r.json()
            assert r.status == 200, body
        end = time.monotonic()
        stream.cancel()
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    prompt, third = body["usage"]["prompt_tokens"], max(1, len(gaps) // 3)
    early, deep = statistics.median(gaps[:third]), statistics.median(gaps[-third:])
    assert deep <= DEEP_OVER_EARLY * early + 0.3, (prompt, early, deep, [round(g, 2) for g in gaps])
    assert max(gaps) <= LONG_GAP_BOUND_S, (prompt, max(gaps), sorted(gaps)[-5:])
    reliability.record(
        "load", f"A {prompt:,}-token prompt beside a running stream",
        f"A stream decoding while a {prompt:,}-token prompt arrives (--prefill-step 512). Each round's chunk is the "
        "largest whose cost, predicted at its depth from the rounds measured so far (worker/prefill_cost.py), "
        "stays within 0.8 of the bound (1.0 s on a CPU).",
        expected=f"deep in the prompt the stream's median gap ≤ {DEEP_OVER_EARLY}× its median near the start (+0.3 s); "
                 f"longest ≤ {LONG_GAP_BOUND_S} s (before: 14.5 s at 8,190 tokens)",
        stream_longest_gap_s=round(max(gaps), 2), stream_median_gap_s=round(statistics.median(gaps), 2),
        median_gap_first_third_s=round(early, 2), median_gap_deepest_third_s=round(deep, 2),
        gaps_over_1_s=sum(g > 1 for g in gaps), long_prompt_answered_after_s=round(end - start, 1),
        lost=0, hung=0, leaked="none")


# Codex CLI's prompt trimmed to what a 135M model's CPU prefill takes in seconds (docs/agents.md)
CODEX_TRIM = ["-c", 'model_instructions_file="{short}"', "-c", "include_permissions_instructions=false",
              "-c", "include_environment_context=false", "-c", "features.multi_agent=false",
              "-c", "features.goals=false", "-c", 'web_search="disabled"', "-c", "skills.include_instructions=false"]


@pytest.mark.skipif(shutil.which("codex") is None, reason="Codex CLI is not installed (npm install -g @openai/codex)")
def test_codex_exec_answers_over_responses(embedded, tmp_path):
    """`codex exec` with a custom provider on wire_api "responses": Codex's own request (its input
    items, function tools, hosted tools, include, prompt_cache_key, client_metadata, store false)
    is served, streamed, and its answer printed; no request of it is refused."""
    home = tmp_path / "codex"
    home.mkdir()
    model = embedded.health()[1]["model"]
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "verity"\n\n[model_providers.verity]\nname = "verity"\n'
        f'base_url = "{embedded.url}/v1"\nwire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\n')
    short = tmp_path / "instructions.md"
    short.write_text("Be brief. You are a coding agent; use exec_command to run shell commands.\n")
    last = tmp_path / "last.txt"
    trim = [a.format(short=short) for a in CODEX_TRIM]
    r = subprocess.run(["codex", "exec", "--skip-git-repo-check", "--ephemeral", "-o", str(last), *trim, "Say hello."],
                       cwd=tmp_path, env={**os.environ, "CODEX_HOME": str(home)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and last.read_text().strip(), r.stdout[-3000:] + r.stderr[-3000:]
    log = embedded.log()
    assert "admitted (responses" in log and "refused POST /v1/responses" not in log, log[-3000:]
