"""What real OpenAI clients send, through the openai SDK against a real stack on a tiny model:
message shapes, nulls, n > 1, logprobs, prompt arrays and token ids, echo, samplers, the
server's defaults and model aliases, and a log line for every refusal."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import openai
import pytest

from stack import Stack, wait_until

ALIASES = ("alias-a", "alias-b")


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with Stack(str(tiny_llama), "--max-active", "4", "--queue-size", "16", "--temperature", "0", "--top-k", "7",
               "--max-tokens", "6", *[f"--served-model-name={a}" for a in ALIASES]) as s:
        yield s
    assert s.exit_code == 0, s.log()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def msgs(text: str = "hello world") -> list:
    return [{"role": "user", "content": text}]


def test_message_shapes_and_nulls(client):
    """Content parts, developer, name, refusal, and null for every optional field: the same answer
    as the plain shape (greedy by the server's --temperature 0)."""
    plain = client.chat.completions.create(model=ALIASES[0], messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}])
    nulls = {k: None for k in ("top_p", "n", "stop", "seed", "stream_options", "user", "logprobs",
                               "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias")}
    shaped = client.chat.completions.create(model=ALIASES[0], temperature=None, max_tokens=None, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
        extra_body={**nulls, "top_k": None, "min_p": None, "repetition_penalty": None})
    assert shaped.choices[0].message.content == plain.choices[0].message.content
    assert shaped.model == ALIASES[0]  # the name the client sent
    assert shaped.usage.completion_tokens == 6  # --max-tokens: the default for an omitted max_tokens
    refused = client.chat.completions.create(model=ALIASES[1], max_tokens=3, messages=[
        *msgs("a"), {"role": "assistant", "content": None, "refusal": "I can't"}, *msgs("b")])
    assert refused.usage.prompt_tokens > plain.usage.prompt_tokens - 10


def test_image_parts_and_unknown_fields_are_refused_by_name(client, stack):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ALIASES[0], messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    err = e.value.body
    assert (err["param"], err["code"]) == ("messages[0].content[1].type", "unsupported_content")
    assert "image_url" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ALIASES[0], messages=msgs(), extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    rid = e.value.response.headers["X-Request-Id"]
    line = f"[{rid}] refused POST /v1/chat/completions: 400 unknown_parameter (param frobnicate)"
    wait_until(lambda: line in stack.log(), 10, "the refusal's log line")  # the stack's output arrives by a pipe


def test_n_choices_and_logprobs(client):
    """n = 2 with a seed: two indexed choices, each with its tokens' log-probabilities."""
    r = client.chat.completions.create(model=ALIASES[0], messages=msgs(), n=2, temperature=1.0, seed=3,
                                       max_tokens=5, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 10
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
        assert "".join(t.token for t in content) == c.message.content
        assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob for t in content)
    again = client.chat.completions.create(model=ALIASES[0], messages=msgs(), n=2, temperature=1.0, seed=3,
                                           max_tokens=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_streamed_choices_carry_their_index_and_logprobs(client):
    chunks = list(client.chat.completions.create(model=ALIASES[0], messages=msgs(), n=3, max_tokens=4, stream=True,
                                                 logprobs=True, stream_options={"include_usage": True}))
    text, tokens = {0: "", 1: "", 2: ""}, {0: 0, 1: 0, 2: 0}
    for ch in chunks[:-1]:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert tokens == {0: 4, 1: 4, 2: 4}
    assert len(set(text.values())) == 1  # greedy by default here: the same answer three times
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_completion_prompts_token_ids_and_echo(client, stack):
    one = client.completions.create(model=ALIASES[0], prompt="once upon a time", max_tokens=4)
    many = client.completions.create(model=ALIASES[0], prompt=["once upon a time", "hello"], n=2, max_tokens=4,
                                     logprobs=2, echo=False, suffix=None, best_of=None)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    hello = client.completions.create(model=ALIASES[0], prompt="hello", max_tokens=1)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens + hello.usage.prompt_tokens  # once per prompt
    assert many.usage.completion_tokens == 16
    lp = many.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 and lp.text_offset[0] == 0
    ids = client.completions.create(model=ALIASES[0], prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6
    echoed = client.completions.create(model=ALIASES[0], prompt="once upon a time", max_tokens=4, echo=True)
    assert echoed.choices[0].text == "once upon a time" + one.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ALIASES[0], prompt="x", suffix="the end")
    assert e.value.body["param"] == "suffix"


def test_samplers_reproduce_with_a_seed(client):
    body = dict(model=ALIASES[0], messages=msgs("tell me a story"), temperature=1.2, seed=9, max_tokens=8,
                presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"5": 2.0},
                extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2})
    a, b = (client.chat.completions.create(**body).choices[0].message.content for _ in range(2))
    others = [dict(model=ALIASES[0], messages=msgs(t), temperature=1.0, max_tokens=8) for t in ("hi", "one two", "abc")]
    with ThreadPoolExecutor(4) as pool:  # the same request again, in one batch with three others
        futures = [pool.submit(client.chat.completions.create, **x) for x in (body, *others)]
        crowd = futures[0].result().choices[0].message.content
    assert a == b == crowd


async def test_info_shows_defaults_and_aliases(stack, client):
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.url + "/v1/verity/info") as r:
            info = await r.json()
    assert info["defaults"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 7, "min_p": 0.0, "max_tokens": 6,
                                "source": "flags"}
    assert info["served_model_names"][1:] == list(ALIASES)
    assert [m.id for m in client.models.list().data][1:] == list(ALIASES)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=msgs())
    assert json.dumps(info)  # plain JSON
