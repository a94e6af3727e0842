"""Reasoning apart from the answer on a real stack: a tiny qwen3_5 with Qwen3.5's thinking
template (built here) behind launch-stack, read with the openai SDK, alone and in joint mode; and
the small endpoints (/tokenize, /detokenize, cancelling a chat completion by its id)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from bench.tiny_models import THINKING_TEMPLATE, build_tiny_model
from stack import Stack

BUDGET = 8  # --max-thinking-tokens: the random model never closes its block itself
MAX_TOKENS = 48


class Weather(BaseModel):
    """Looks up the weather of a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=5)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    target = build_tiny_model(root / "target", "qwen3_5", seed=0, chat_template=THINKING_TEMPLATE)
    draft = build_tiny_model(root / "draft", "qwen3_5", seed=1, perturb_from=target, noise=0.3)
    with Stack(str(target), "--draft", str(draft), "--draft-budget", "2", "--max-tokens-cap", "2000",
               "--max-thinking-tokens", str(BUDGET)) as s:
        yield s
    assert s.exit_code == 0, s.log()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def ask(client, stream: bool = False, **kw):
    body = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": "hello world"}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream, **kw}
    extra = {k: body.pop(k) for k in ("mode", "thinking", "max_thinking_tokens", "chat_template_kwargs", "ignore_eos")
             if k in body}
    return client.chat.completions.create(**body, extra_body=extra or None)


def streamed(client, **kw) -> tuple[str, str, str, list[str]]:
    """(reasoning_content, reasoning, content, finish_reason) added up over a stream's deltas."""
    rc = r = content = ""
    finish = []
    for chunk in ask(client, stream=True, **kw):
        for c in chunk.choices:
            d = c.delta.model_dump()
            rc += d.get("reasoning_content") or ""
            r += d.get("reasoning") or ""
            content += d.get("content") or ""
            finish += [c.finish_reason] if c.finish_reason else []
    return rc, r, content, finish


def test_info_says_the_model_thinks(stack):
    info = httpx.get(stack.url + "/v1/verity/info").json()
    assert info["thinks"] is True and info["max_thinking_tokens"] == BUDGET


@pytest.mark.parametrize("mode", ["baseline", "joint"])
def test_thinking_is_apart_from_the_answer_whole_and_streamed(client, mode):
    """The budget closes the block; the answer follows it; the stream adds up to the whole reply,
    and joint mode gives baseline's reply exactly."""
    done = ask(client, mode=mode, ignore_eos=True)
    whole, extra = done.choices[0].message, done.choices[0].message.model_extra
    assert done.usage.completion_tokens_details.reasoning_tokens == BUDGET == done.model_extra["metrics"]["reasoning_tokens"]
    assert extra["reasoning_content"] and extra["reasoning"] == extra["reasoning_content"]
    assert whole.content and "think>" not in whole.content and "think>" not in extra["reasoning"]
    rc, r, content, finish = streamed(client, mode=mode, ignore_eos=True)
    assert (rc, r, content, finish) == (extra["reasoning"], extra["reasoning"], whole.content, ["length"])
    if mode == "joint":
        base = ask(client, ignore_eos=True).choices[0].message
        assert (base.content, base.model_extra["reasoning"]) == (whole.content, extra["reasoning"])


def test_a_request_budget_overrides_the_servers(client):
    short = ask(client, max_thinking_tokens=1, ignore_eos=True).choices[0].message
    long = ask(client, ignore_eos=True).choices[0].message
    assert len(short.model_extra["reasoning"]) < len(long.model_extra["reasoning"])
    assert short.content and short.content != long.content


@pytest.mark.parametrize("control", [{"thinking": False}, {"reasoning_effort": "none"},
                                     {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_switched_off(client, control):
    done = ask(client, ignore_eos=True, **control)
    msg = done.choices[0].message
    assert msg.model_extra.get("reasoning") is None and msg.content
    assert done.usage.completion_tokens_details.reasoning_tokens == 0
    on = ask(client, ignore_eos=True, reasoning_effort="high").choices[0].message
    assert on.model_extra["reasoning"]


def test_contradicting_controls_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, thinking=True, reasoning_effort="minimal")
    assert e.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("mode", ["baseline", "joint"])
def test_structured_output_and_tool_calls_apply_to_the_answer(client, mode):
    """The think block is free text; the answer after it is the schema's JSON, or the calls."""
    done = client.chat.completions.parse(model=client.models.list().data[0].id,
                                         messages=[{"role": "user", "content": "weather?"}],
                                         response_format=Weather, temperature=0, max_tokens=120,
                                         extra_body={"mode": mode})
    msg = done.choices[0].message
    assert msg.model_extra["reasoning"] and isinstance(msg.parsed, Weather), msg.content
    call = client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": "weather?"}],
                                          tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=120,
                                          extra_body={"mode": mode}).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    assert call.message.model_extra["reasoning"]
    Weather.model_validate_json(call.message.tool_calls[0].function.arguments)
    rc, _, content, finish = streamed(client, mode=mode, response_format={"type": "json_object"}, max_tokens=120)
    assert rc == msg.model_extra["reasoning"] and isinstance(json.loads(content), dict) and finish == ["stop"]


def test_a_reply_with_its_thinking_goes_back_in_the_next_turn(client):
    first = ask(client).choices[0].message
    history = [{"role": "user", "content": "hello world"}, first.model_dump(exclude_none=True),
               {"role": "user", "content": "and?"}]
    assert history[1]["reasoning_content"]
    assert ask(client, messages=history).choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, messages=[{"role": "user", "content": "x", "reasoning": "no"}])
    assert e.value.body["param"] == "messages[0].reasoning"


# ---- the small endpoints ----


def test_tokenize_and_detokenize_round_trip(stack):
    url = stack.url
    msgs = [{"role": "user", "content": "hello world"}]
    chat = httpx.post(url + "/tokenize", json={"messages": msgs, "return_token_strs": True}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert chat["count"] == len(chat["tokens"]) == len(chat["token_strs"]) and "".join(chat["token_strs"]) == text
    assert chat["max_model_len"] == httpx.get(url + "/v1/verity/info").json()["context_limit"]
    off = httpx.post(url + "/tokenize", json={"messages": msgs, "thinking": False}).json()
    assert httpx.post(url + "/detokenize", json={"tokens": off["tokens"]}).json()["prompt"].endswith("</think>\n\n")
    bare = httpx.post(url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    plain = httpx.post(url + "/tokenize", json={"prompt": "the quick brown fox"}).json()
    assert httpx.post(url + "/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "the quick brown fox"}
    whole = ask(openai.OpenAI(base_url=url + "/v1", api_key="none"), messages=msgs, max_tokens=1)
    assert whole.usage.prompt_tokens == chat["count"]  # what chat completions count


@pytest.mark.parametrize("body,param", [({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
                                        ({}, "prompt"), ({"prompt": "x", "tools": []}, "tools"),
                                        ({"prompt": "x", "nope": 1}, "nope")])
def test_tokenize_refuses_by_name(stack, body, param):
    r = httpx.post(stack.url + "/tokenize", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(stack.url + "/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_token_id"


def test_cancel_a_running_chat_completion_by_its_id(stack, client):
    """The stream ends at once and the row is freed (the worker holds nothing afterwards)."""
    stream = ask(client, stream=True, max_tokens=2000, ignore_eos=True, max_thinking_tokens=3000)
    first = next(iter(stream))
    r = httpx.post(f"{stack.url}/v1/chat/completions/{first.id}/cancel")
    assert r.status_code == 200 and r.json() == {"id": first.id, "object": "chat.completion", "status": "cancelled",
                                                 "choices": 1}
    rest = list(stream)
    assert sum(1 for c in rest for ch in c.choices if ch.delta.model_dump().get("reasoning")) < 1900
    assert stack.settled()["worker"]["active"] == 0
    again = httpx.post(f"{stack.url}/v1/chat/completions/{first.id}/cancel")
    assert again.status_code == 404 and again.json()["error"]["param"] == "id"


# ---- verity generate / chat ----


def test_the_cli_prints_thinking_dimmed_and_the_answer_apart(stack, client):
    """On a terminal (a pty) the think block is dimmed; into a pipe, stdout is the answer alone
    and the thinking goes to stderr."""
    want = ask(client, ignore_eos=True, max_tokens=24).choices[0].message
    args = [sys.executable, "-m", "cli.main", "generate", "hello world", "--url", stack.url, "--max-tokens", "24",
            "--temperature", "0", "--ignore-eos"]
    piped = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == want.content + "\n" and piped.stderr.startswith(want.model_extra["reasoning"] + "\n")
    main, sub = pty.openpty()
    run = subprocess.run(args, stdout=sub, stderr=subprocess.PIPE, timeout=60)
    os.close(sub)
    shown = b""
    while chunk := _read(main):
        shown += chunk
    os.close(main)
    assert run.returncode == 0, run.stderr
    text = shown.decode().replace("\r\n", "\n")
    assert text.startswith("\x1b[2m") and "\x1b[22m" in text
    assert text.replace("\x1b[2m", "").replace("\x1b[22m", "") == want.model_extra["reasoning"] + "\n" + want.content + "\n"


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # the other end is closed: all was read
        return b""


def test_streamed_tool_calls_and_several_choices_after_thinking(client):
    stream = client.chat.completions.create(model=client.models.list().data[0].id,
                                            messages=[{"role": "user", "content": "weather?"}], stream=True,
                                            tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=120,
                                            extra_body={"mode": "joint"})
    thought, args, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            thought += c.delta.model_dump().get("reasoning_content") or ""
            args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
            assert not c.delta.content
            finish = c.finish_reason or finish
    assert thought and finish == "tool_calls"
    Weather.model_validate_json(args)
    two = ask(client, n=2, seed=5, temperature=1.0, ignore_eos=True)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert all(c.message.model_extra["reasoning"] and c.message.content for c in two.choices)
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * BUDGET
