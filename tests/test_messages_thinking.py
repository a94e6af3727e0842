"""Thinking on /v1/messages: a tiny qwen3_5 with Qwen3.5's thinking template (built here) behind a
real stack, read with the `anthropic` SDK: the think block becomes a `thinking` content block
(streamed as `thinking_delta`), `budget_tokens` closes it, `disabled` leaves it out, joint mode
gives baseline's reply."""

from __future__ import annotations

import anthropic
import pytest

from bench.tiny_models import THINKING_TEMPLATE, build_tiny_model
from stack import Stack

ASK = [{"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages-thinking")
    target = build_tiny_model(root / "target", "qwen3_5", seed=0, chat_template=THINKING_TEMPLATE)
    draft = build_tiny_model(root / "draft", "qwen3_5", seed=1, perturb_from=target, noise=0.3)
    with Stack(str(target), "--draft", str(draft), "--draft-budget", "2", "--max-tokens-cap", "256") as s:
        yield s
    assert s.exit_code == 0, s.log()


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(stack):
    return stack.health()[1]["model"]


def ask(client, model, budget: int = 8, **extra):
    return client.messages.create(model=model, max_tokens=40, messages=ASK, extra_body={**GREEDY, **extra},
                                  thinking={"type": "enabled", "budget_tokens": budget})


@pytest.mark.parametrize("mode", ["baseline", "joint"])
def test_thinking_block_then_the_answer_whole_and_streamed(client, model, mode):
    whole = ask(client, model, mode=mode)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    thinking, text = whole.content[0].thinking, whole.content[1].text
    assert thinking and text and "think>" not in thinking + text
    with client.messages.stream(model=model, max_tokens=40, messages=ASK, extra_body={**GREEDY, "mode": mode},
                                thinking={"type": "enabled", "budget_tokens": 8}) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert kinds.index("text_delta") > max(i for i, k in enumerate(kinds) if k == "thinking_delta")
    assert (final.content[0].thinking, final.content[1].text) == (thinking, text)
    if mode == "joint":
        base = ask(client, model)
        assert (base.content[0].thinking, base.content[1].text) == (thinking, text)


def test_budget_tokens_bounds_the_thinking(client, model):
    short, long = ask(client, model, budget=1), ask(client, model, budget=12)
    assert len(short.content[0].thinking) < len(long.content[0].thinking)


def test_thinking_disabled_has_no_thinking_block(client, model):
    msg = client.messages.create(model=model, max_tokens=20, messages=ASK, extra_body=GREEDY,
                                 thinking={"type": "disabled"})
    assert [b.type for b in msg.content] == ["text"]


def test_a_past_thinking_block_goes_back(client, model):
    first = ask(client, model)
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": "and then?"}]
    again = client.messages.create(model=model, max_tokens=20, messages=turn, extra_body=GREEDY,
                                   thinking={"type": "enabled", "budget_tokens": 4})
    assert again.content[0].type == "thinking"
    counted = client.messages.count_tokens(model=model, messages=turn, thinking={"type": "enabled", "budget_tokens": 4})
    assert counted.input_tokens == again.usage.input_tokens + again.usage.cache_read_input_tokens
