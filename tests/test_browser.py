"""The web UI in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright) against a
real stack: the key prompt, a streamed joint answer with its metrics, the kept conversation,
and the allocation view checked against worker/scheduler/allocation.py. Screenshots go to artifacts/.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

from stack import Stack
from worker.scheduler import allocate, rank, survivals
from bench.tiny_models import build_tiny_model

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
KEY = "browser-key"
PRESET = [[0.95, 0.90, 0.85], [0.80, 0.60, 0.40], [0.60, 0.50, 0.30]]  # docs/design.md's worked example
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    draft = build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, perturb_from=tiny_llama, noise=0.3)
    # slowed steps, so the answer arrives over many reads and streaming can be seen
    with Stack(str(tiny_llama), "--draft", str(draft), "--draft-budget", "3", "--api-key", KEY,
               env={"VERITY_FAULT_STEP_DELAY_S": "0.02"}) as s:
        yield s
    assert s.exit_code == 0, s.log()


@pytest.fixture(scope="module")
def page(stack, tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Chromium is missing: no {CHROMIUM}. Install Debian's package: apt-get install -y chromium "
                    "(.ci/run does this)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright for Python is missing: pip install -e '.[test]'")
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 860})
        browser.set_default_timeout(TIMEOUT_MS)
        pg = browser.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        yield pg
        browser.close()
    assert not errors, errors


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def test_chat_streams_a_joint_answer_with_its_metrics(stack, page):
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    page.goto(stack.url + "/")
    page.wait_for_selector("#key-dialog[open]")  # /v1/ needs the key: the page asks for it
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#mode option[value=joint]:not([disabled])", state="attached")
    assert "draft" in page.text_content("#draft")
    page.select_option("#mode", "joint")
    page.fill("#max-tokens", "40")
    # record every text the answer shows while it is still streaming
    page.evaluate("""() => { window.partials = [];
        new MutationObserver(() => { const a = document.querySelector('.bubble.assistant.streaming');
            if (a && a.textContent) window.partials.push(a.textContent.length); })
        .observe(document.getElementById('turns'), {subtree: true, childList: true, characterData: true}); }""")
    page.fill("#prompt", "hello world")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".turn .metrics .chip[data-metric=acceptance]")
    partials = page.evaluate("window.partials")
    assert len(set(partials)) >= 3, f"the answer did not stream: lengths seen {partials}"
    chips = {c.get_attribute("data-metric"): c.text_content() for c in page.query_selector_all(".turn .metrics .chip")}
    assert re.fullmatch(r"tokens/s \d+\.\d", chips["tps"]) and re.fullmatch(r"TTFT \d+ ms", chips["ttft"])
    drafted_accepted = re.fullmatch(r"acceptance (\d+)/(\d+) \(\d+%\)", chips["acceptance"])
    assert drafted_accepted and int(drafted_accepted.group(2)) > 0, chips
    assert re.fullmatch(r"budget/cycle \d\.\d\d", chips["budget"]) and chips["reused"] == "reused 0"
    assert re.fullmatch(r"tokens \d+ \+ \d+", chips["tokens"]) and chips["finish"].startswith("joint")
    assert sent[-1]["stream"] is True and sent[-1]["mode"] == "joint"
    # a second question carries the conversation
    page.select_option("#mode", "baseline")
    page.fill("#prompt", "and then?")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".turn:nth-child(2) .metrics .chip[data-metric=acceptance]")
    roles = [m["role"] for m in sent[-1]["messages"]]
    assert roles == ["user", "assistant", "user"] and sent[-1]["mode"] == "baseline"
    assert sent[-1]["messages"][1]["content"] == page.text_content(".turn:nth-child(1) .bubble.assistant")
    assert page.text_content(".turn:nth-child(2) [data-metric=acceptance]") == "acceptance —"
    screenshot(page, "ui-chat.png")


def label(r: int, j: int) -> str:
    return f"{chr(65 + r)}{j}"


def set_inputs(page, rows: list[list[float]], budget: int) -> None:
    while page.locator("#requests li").count() < len(rows):
        page.click("#add-request")
    while page.locator("#requests li").count() > len(rows):
        page.click("#requests li:last-child button")
    for i, row in enumerate(rows):
        page.fill(f"#requests li:nth-child({i + 1}) input", ", ".join(map(repr, row)))
    page.fill("#budget", str(budget))


def shown(page) -> tuple[list[str], list[str], list[int]]:
    """(ranking, verified candidates, draft lengths) as the page shows them."""
    got = page.evaluate("""() => ({
        order: [...document.querySelectorAll('#ranking li')].map((li) => li.dataset.label),
        verified: [...document.querySelectorAll('#ranking li.verified')].map((li) => li.dataset.label),
        lengths: document.getElementById('lengths').dataset.lengths })""")
    return got["order"], got["verified"], [int(x) for x in got["lengths"].split(",") if x]


def expected(rows: list[list[float]], budget: int) -> tuple[list[str], list[str], list[int]]:
    s = [survivals(a) for a in rows]
    order = [label(r, j) for r, j in rank(s)]
    return order, order[:budget], allocate(s, budget)


def test_allocation_view_follows_the_scheduler(stack, page):
    page.goto(stack.url + "/#allocation")
    page.wait_for_selector("#ranking li")
    assert "runs no model" in page.text_content("#allocation .notice")
    order, verified, lengths = shown(page)  # the preset, at its default budget
    assert order == ["A1", "A2", "B1", "A3", "C1", "B2", "C2", "B3", "C3"]  # the worked example's order there
    assert (order, verified, lengths) == expected(PRESET, 4)
    assert [c.text_content() for c in page.query_selector_all("#survival-table tbody tr:first-child td")] == \
        ["0.950#1", "0.855#2", "0.727#4"]
    rng = random.Random(7)
    # values from a small set, so equal survivals (the tie rule) come up often
    values = [0.0, 0.25, 0.5, 0.5, 0.6, 0.75, 0.8, 0.9, 1.0, round(rng.random(), 3)]
    for _ in range(25):
        rows = [[rng.choice(values) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 6))]
        budget = rng.randint(0, sum(map(len, rows)) + 2)
        set_inputs(page, rows, budget)
        assert shown(page) == expected(rows, budget), (rows, budget)
    set_inputs(page, [[0.9, 1.5]], 1)
    assert "not a probability" in page.text_content("#alloc-error")
    page.click("#preset")
    page.fill("#budget", "4")
    screenshot(page, "ui-allocation.png")
