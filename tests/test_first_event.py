"""A request's Queued is its first event, even when the engine runs it to its end before the worker's
jobs thread has announced it. A fuzz run once got a 529 "the request was cancelled before it
started" for a valid /v1/messages with max_tokens 1: nothing had cancelled it, its Finished had
overtaken its Queued. Here the jobs thread is held after each queueing
(VERITY_FAULT_AFTER_QUEUE_DELAY_S), so the engine ends every one-token request first."""

from __future__ import annotations

import json
import os
import re
import signal
import socket

import aiohttp
import pytest

from reliability import stack_pids
from stack import Stack, until

HELD_S = 0.3  # far longer than a one-token request's step on the tiny model
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BODIES = {
    "/v1/messages": {"max_tokens": 1, "messages": ASK},
    "/v1/chat/completions": {"max_tokens": 1, "messages": ASK},
    "/v1/responses": {"max_output_tokens": 1, "input": ASK},
}


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with Stack(str(tiny_llama), env={"VERITY_FAULT_AFTER_QUEUE_DELAY_S": str(HELD_S)}) as s:
        yield s
    assert s.exit_code == 0, s.log()


def _prompt_tokens(path: str, body: dict) -> int:
    """The prompt's tokens as the answer reports them (the Queued event is their source)."""
    usage = body["usage"]
    return usage["prompt_tokens"] if path.endswith("/completions") else usage["input_tokens"]


def _streamed_prompt_tokens(path: str, events: list[dict]) -> int:
    if path == "/v1/messages":
        assert events[-1]["type"] == "message_stop", events
        return events[0]["message"]["usage"]["input_tokens"]
    if path == "/v1/responses":
        assert events[-1]["type"] == "response.incomplete", events  # max_output_tokens reached
        return events[-1]["response"]["usage"]["input_tokens"]
    return events[-1]["usage"]["prompt_tokens"]


async def _post(stack: Stack, path: str, stream: bool):
    body = {**BODIES[path], "model": stack.health()[1]["model"], "stream": stream}
    if path.endswith("/completions") and stream:
        body["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as s, s.post(stack.url + path, json=body) as r:
        text = await r.text()
        return r.status, r.headers.get("X-Request-Id"), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", list(BODIES))
async def test_a_request_ended_before_its_announcement_is_answered(stack, path, stream):
    status, rid, text = await _post(stack, path, stream)
    assert status == 200, text
    if stream:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        tokens = _streamed_prompt_tokens(path, events)
    else:
        tokens = _prompt_tokens(path, json.loads(text))
    assert tokens > 0, text
    assert f"[{rid}] cancel" not in stack.log()  # nothing stopped it: the server cancels no waiting request


async def test_a_request_ended_before_its_announcement_leaves_no_origin_behind(tiny_llama):
    """The worker keeps each running request's gateway, to cancel what a dead gateway left. A
    request that ended before the worker recorded it used to stay in that table for good: a later
    gateway found it there and "cancelled" it. Now the new gateway finds none."""
    s = Stack(str(tiny_llama), env={"VERITY_FAULT_AFTER_QUEUE_DELAY_S": str(HELD_S)}, port=_free_port()).start()
    with s:
        for path in BODIES:
            status, _, text = await _post(s, path, False)
            assert status == 200, text
        gateway = stack_pids(s.proc.pid)["gateway"]
        os.kill(gateway, signal.SIGKILL)
        took_over = re.compile(r"gateway (\d+) took over: (\d+) requests of gone gateways cancelled")
        await until(lambda: any(int(g) != gateway for g, _ in took_over.findall(s.log())), 30,
                    "the restarted gateway to take over from the killed one")
        assert [n for g, n in took_over.findall(s.log()) if int(g) != gateway] == ["0"], s.log()[-3000:]
        assert "is gone" not in s.log()
        status, _, text = await _post(s, "/v1/chat/completions", False)
        assert status == 200, text
    assert s.exit_code == 0, s.log()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
