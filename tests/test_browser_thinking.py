"""The web UI on a thinking model (a tiny qwen3_5 with Qwen3.5's thinking template) in headless
Chromium: the think block streams into a collapsed block above the answer, and stays apart from
the answer in the page, in the store and in the next turn's history."""

from __future__ import annotations

import pytest

from bench.tiny_models import THINKING_TEMPLATE, build_tiny_model
from stack import Stack
from test_browser import browser_page, idle, screenshot, stored

BUDGET = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("thinking-ui"), "qwen3_5", seed=0, chat_template=THINKING_TEMPLATE)
    with Stack(str(model), "--max-thinking-tokens", str(BUDGET), "--max-tokens-cap", "200",
               env={"VERITY_FAULT_STEP_DELAY_S": "0.02"}) as s:  # slowed: the block grows over many reads
        yield s
    assert s.exit_code == 0, s.log()


@pytest.fixture(scope="module")
def page(stack, tmp_path_factory):
    with browser_page(tmp_path_factory.mktemp("chromium-thinking")) as pg:
        yield pg


def test_thinking_streams_collapsed_above_the_answer(stack, page):
    page.goto(stack.url + "/")
    page.fill("#max-tokens", "60")
    page.evaluate("""() => { window.thoughts = []; window.answerBeforeThought = false;
        new MutationObserver(() => { const t = document.querySelector('.turn:last-child .thinking');
            const a = document.querySelector('.bubble.assistant.streaming');
            if (t && !t.hidden) window.thoughts.push([t.querySelector('.thinking-text').textContent.length,
                                                      t.querySelector('summary').textContent, t.open]);
            if (a && !a.hidden && (!t || t.hidden)) window.answerBeforeThought = true; })
        .observe(document.getElementById('turns'), {subtree: true, childList: true, characterData: true}); }""")
    page.fill("#prompt", "hello world")
    page.press("#prompt", "Enter")
    idle(page)
    thoughts = page.evaluate("window.thoughts")
    growing = [n for n, label, _ in thoughts if label == "Thinking…"]
    assert len(set(growing)) >= 3, f"the thinking did not stream: {thoughts}"
    assert not any(opened for _, _, opened in thoughts) and not page.evaluate("window.answerBeforeThought")
    turn = stored(page)[0]["turns"][0]
    assert turn["reasoning"] and turn["assistant"] and "think>" not in turn["assistant"] + turn["reasoning"]
    block = page.locator(".turn:first-child .thinking")
    assert block.evaluate("(b) => b.nextElementSibling.classList.contains('assistant')")  # above the answer
    assert page.text_content(".turn:first-child .thinking summary") == f"Thought ({len(turn['reasoning'])} characters)"
    assert not block.evaluate("(b) => b.open") and not page.locator(".turn:first-child .thinking-text").is_visible()
    page.click(".turn:first-child .thinking summary")
    assert page.text_content(".turn:first-child .thinking-text") == turn["reasoning"]
    screenshot(page, "ui-thinking.png")
    with page.expect_request("**/v1/chat/completions") as req:  # the next turn sends the answer alone
        page.fill("#prompt", "and?")
        page.press("#prompt", "Enter")
    idle(page)
    sent = req.value.post_data_json["messages"]
    assert sent[1] == {"role": "assistant", "content": turn["assistant"]}
