"""Integration: the real launch-stack (worker + gateway processes) over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import aiohttp
import openai
import pytest

from stack import LAUNCH_STACK, Stack, read_data_lines, until
from bench.tiny_models import build_tiny_model

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


def chat_body(text="hello world", **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 8, **kw}


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    with Stack(str(tiny_llama), "--api-key", KEY, "--max-active", "2", "--queue-size", "8",
               "--max-tokens-cap", "256", "--max-body-bytes", "20000") as s:
        yield s
    assert s.exit_code == 0, s.log()


async def post(url, body, headers=AUTH, path="/v1/chat/completions"):
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body, headers=headers) as r:
            return r.status, await r.json(), r.headers


async def stream_events(url, body, path="/v1/chat/completions") -> list:
    """Returns the parsed SSE data events in order ('[DONE]' as a string)."""
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json={**body, "stream": True}, headers=AUTH) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_chat_whole_response(stack):
    status, body, headers = await post(stack.url, chat_body())
    assert status == 200, body
    assert body["object"] == "chat.completion" and headers["X-Request-Id"] == body["id"]
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage, metrics = body["usage"], body["metrics"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["completion_tokens"] == metrics["completion_tokens"] > 0
    assert metrics["mode"] == "baseline" and metrics["draft"] is None
    types = {k: type(v).__name__ for k, v in metrics.items()}
    assert types == {"mode": "str", "draft": "NoneType", "prompt_tokens": "int", "completion_tokens": "int",
                     "reused_tokens": "int", "cycles": "int", "drafted": "int", "accepted": "int",
                     "rollbacks": "int", "ttft_s": "float", "decode_tps": "float", "recovery_s": "float",
                     "budget_mean": "float", "reasoning_tokens": "int"}


async def test_stream_matches_whole_and_carries_metrics(stack):
    body = chat_body("the quick brown fox", max_tokens=12, ignore_eos=True)
    _, whole, _ = await post(stack.url, body)
    events = await stream_events(stack.url, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert final[0]["metrics"]["completion_tokens"] == 12
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["metrics"] == final[0]["metrics"]


async def test_completions_endpoint(stack):
    status, body, _ = await post(stack.url, {"prompt": "once upon", "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True}, path="/v1/completions")
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5 and isinstance(body["choices"][0]["text"], str)
    events = await stream_events(stack.url, {"prompt": "once upon", "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True}, path="/v1/completions")
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]


def test_openai_sdk(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [stack.health()[1]["model"]]
    r = client.chat.completions.create(model=stack.health()[1]["model"], temperature=0, max_tokens=8,
                                       messages=[{"role": "user", "content": "hello world"}])
    whole = r.choices[0].message.content
    assert r.usage.completion_tokens > 0 and r.model_extra["metrics"]["mode"] == "baseline"
    parts = client.chat.completions.create(temperature=0, max_tokens=8, stream=True, model=r.model,
                                           messages=[{"role": "user", "content": "hello world"}])
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=r.model, temperature=9, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong").models.list()


async def test_errors_are_openai_objects(stack):
    cases = [
        (chat_body(temperature=3), AUTH, 400, "temperature"),
        (chat_body(tools=[]), AUTH, 400, "tools"),
        (chat_body(max_tokens=257), AUTH, 400, "max_tokens"),
        (chat_body(model="other"), AUTH, 404, "model"),
        (chat_body(mode="joint"), AUTH, 400, "mode"),
        (chat_body("word " * 5000), AUTH, 413, None),
        (chat_body(), {}, 401, None),
        (chat_body(), {"Authorization": "Bearer nope"}, 401, None),
    ]
    for body, headers, status, param in cases:
        got, err, _ = await post(stack.url, body, headers)
        assert got == status, (body, err)
        assert set(err["error"]) >= {"message", "type", "code"} and err["error"]["param"] == param, err
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/v1/chat/completions", data=b"{oops", headers=AUTH) as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        async with http.get(stack.url + "/v1/models/other", headers=AUTH) as r:
            assert r.status == 404
    assert stack.health()[0] == 200  # still serving


async def test_prompt_over_context_limit_is_400(stack, tiny_llama_lm):
    text = "hello " * tiny_llama_lm.context_limit
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/v1/completions", headers=AUTH,
                             json={"prompt": text, "max_tokens": 4, "stream": True}) as r:
            err = await r.json()
    assert r.status == 400 and err["error"]["code"] == "context_length_exceeded", err


async def test_concurrent_requests_equal_their_solo_answers(stack):
    prompts = ["hello world", "the quick brown fox", "once upon a time", "one two three", "a b c d"]
    solo = [(await post(stack.url, chat_body(p, ignore_eos=True)))[1] for p in prompts]
    together = await asyncio.gather(*(post(stack.url, chat_body(p, ignore_eos=True)) for p in prompts))
    for s, (status, t, _) in zip(solo, together):
        assert status == 200
        assert t["choices"][0]["message"]["content"] == s["choices"][0]["message"]["content"]


async def test_disconnect_mid_stream_cancels_in_worker(stack):
    async with aiohttp.ClientSession() as http:
        r = await http.post(stack.url + "/v1/chat/completions", headers=AUTH,
                            json=chat_body(max_tokens=256, ignore_eos=True, stream=True))
        await read_data_lines(r, 3)
        r.close()  # the client goes away mid-stream
    await until(stack.idle, 30, "the worker to drop the cancelled request")
    assert "cancel" in stack.log()
    status, body, _ = await post(stack.url, chat_body())
    assert status == 200 and body["usage"]["completion_tokens"] > 0


async def test_disconnect_while_waiting_for_whole_response(stack):
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(stack.url + "/v1/chat/completions", headers=AUTH,
                                             json=chat_body(max_tokens=256, ignore_eos=True)))
        await until(lambda: stack.health()[1].get("admitted") == 1, 10, "admission")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await until(stack.idle, 30, "the worker to drop the cancelled request")


@pytest.fixture
def small_stack(tiny_llama, tmp_path):
    with Stack(str(tiny_llama), "--max-active", "1", "--queue-size", "2", "--keepalive-s", "0.2", env={"VERITY_FAULT_STEP_DELAY_S": "0.02"}) as s:
        yield s


async def test_full_line_gets_429_and_waiting_stream_gets_keepalives(small_stack):
    url = small_stack.url
    long = chat_body(max_tokens=256, ignore_eos=True)
    async with aiohttp.ClientSession() as http:
        running = await http.post(url + "/v1/chat/completions", json={**long, "stream": True})
        await running.content.readline()
        waiting = await http.post(url + "/v1/chat/completions", json={**long, "stream": True})
        third = asyncio.create_task(post(url, chat_body(), headers={}))
        await until(lambda: small_stack.health()[1].get("admitted") == 3, 10, "three admitted")
        status, err, headers = await post(url, chat_body(), headers={})
        assert status == 429 and int(headers["Retry-After"]) >= 1 and err["error"]["code"] == "queue_full"
        first_line = await waiting.content.readline()
        while first_line.strip() == b"":
            first_line = await waiting.content.readline()
        assert first_line.startswith(b": keep-alive") or first_line.startswith(b"data: ")
        keepalive = first_line.startswith(b": keep-alive")
        while not keepalive:  # the role chunk comes first; keep-alives follow while it waits
            line = await waiting.content.readline()
            keepalive = line.startswith(b": keep-alive")
            assert not line.startswith(b'data: {"id"') or b'"content": ""' in line
        running.close()
        waiting.close()
        assert (await third)[0] == 200
    await until(small_stack.idle, 30, "idle after cancels")


async def test_killed_worker_is_restarted_and_nothing_admitted_is_lost(small_stack, reliability):
    url = small_stack.url
    expected = (await post(url, chat_body("hello world"), headers={}))[1]["choices"][0]["message"]["content"]
    old_pid = small_stack.worker_pid()
    async with aiohttp.ClientSession() as http:
        running = await http.post(url + "/v1/chat/completions",
                                  json=chat_body(max_tokens=256, ignore_eos=True, stream=True))
        await read_data_lines(running, 3)  # the role chunk and two tokens: it has started
        waiting = [asyncio.create_task(post(url, chat_body("hello world"), headers={})) for _ in range(2)]
        await until(lambda: small_stack.health()[1].get("admitted") == 3, 10, "three admitted")
        os.kill(old_pid, signal.SIGKILL)
        t0 = time.monotonic()
        await until(lambda: small_stack.health()[0] == 503, 10, "/health to say 503 while the worker is down")
        tail = [line async for line in running.content]
    errors = [json.loads(x[6:]) for x in tail if x.startswith(b'data: {"error"')]
    assert errors, (b"".join(tail[-4:]).decode(), small_stack.log()[-3000:])
    assert len(errors) == 1 and errors[0]["error"]["code"] == "worker_died"
    assert [x for x in tail if x.strip()][-1] == b"data: [DONE]\n"
    for task in waiting:
        status, body, _ = await task
        assert status == 200 and body["choices"][0]["message"]["content"] == expected
    await until(lambda: small_stack.health()[0] == 200, 60, "the restarted worker")
    assert small_stack.worker_pid() != old_pid and small_stack.health()[1]["worker_restarts"] == 1
    reliability.record(
        "faults", "Worker killed with SIGKILL mid-stream",
        "One stream decoding, two requests waiting; the worker gets SIGKILL. The started stream ends with "
        "one `worker_died` error event and [DONE]; /health says 503 until the restarted worker is READY; "
        "the waiting requests are resubmitted to it and answered with the text a healthy worker gives.",
        started_stream="error event worker_died, then [DONE]", waiting_requests_served=len(waiting),
        health_while_down=503, serving_again_after_s=round(time.monotonic() - t0, 2))


def test_start_failure_names_the_child(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    r = subprocess.run([LAUNCH_STACK, "--model", str(bad), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "worker exited with code 1 during start-up" in r.stderr


async def test_worker_that_keeps_dying_fails_the_stack(tiny_llama, tmp_path, reliability):
    s = Stack(str(tiny_llama), "--max-restarts", "1",
              env={"VERITY_FAULT_EXIT_ON_JOB": "3"}).start()
    status, err, _ = await post(s.url, chat_body(), headers={})  # kills every worker it reaches
    assert status == 503, err
    code = await asyncio.to_thread(s.wait_exit, 60)
    log = s.log()
    assert code == 2, log
    assert log.count("exited with code 3") == 2 and "giving up" in log
    reliability.record(
        "faults", "A worker that keeps dying",
        "Every worker exits (code 3) when a job reaches it (VERITY_FAULT_EXIT_ON_JOB); with --max-restarts 1, "
        "launch-stack restarts it once, then gives up and exits non-zero; the admitted request gets 503.",
        request_status=status, worker_deaths=2, launch_stack_exit_code=code)


async def test_joint_over_http_equals_baseline(tiny_llama, tmp_path):
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=1, perturb_from=tiny_llama, noise=0.3)
    with Stack(str(tiny_llama), "--draft", str(draft), "--draft-budget", "3") as s:
        for text in ("hello world", "the quick brown fox"):
            body = chat_body(text, max_tokens=24, ignore_eos=True)
            _, base, _ = await post(s.url, body, headers={})
            _, joint, _ = await post(s.url, {**body, "mode": "joint"}, headers={})
            assert joint["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]
            jm = joint["metrics"]
            assert jm["mode"] == "joint" and jm["draft"].startswith("draft@")
            # k = 3, but a cycle drafts no more than the tokens left allow: at most the last 3 cycles draft less
            assert 3 * (jm["cycles"] - 3) <= jm["budget_mean"] * jm["cycles"] <= 3 * jm["cycles"]
            assert jm["drafted"] > jm["accepted"] > 0 and jm["rollbacks"] > 0 and jm["cycles"] < 24
            events = await stream_events(s.url, {**body, "mode": "joint"})
            final = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]][0]
            assert final["metrics"]["drafted"] == jm["drafted"]
            # the `verity` extension: every token's origin, the accepted drafts true
            origins = [d for e in events[:-1] for d in e.get("verity", {}).get("drafted", [])]
            assert len(origins) == 24 and sum(origins) == jm["accepted"]
    assert s.exit_code == 0


def test_draft_with_another_tokenizer_is_refused(tiny_llama, tmp_path):
    other = build_tiny_model(tmp_path / "other", "qwen3_5", seed=0)
    r = subprocess.run([LAUNCH_STACK, "--model", str(tiny_llama), "--draft", str(other), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "cannot pair draft" in r.stderr and "tokenizer differs" in r.stderr


@pytest.mark.slow
async def test_embedded_model_knows_paris(tmp_path):
    with Stack("embedded") as s:
        status, body, _ = await post(s.url, chat_body("What is the capital of France?", max_tokens=20), headers={})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]
    assert s.exit_code == 0
