"""The web UI in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright) against a
real stack on a tiny random model, one browser session for every check: the key prompt, a streamed
joint answer with its metrics, markdown, message actions, conversations, Stop, scrolling, errors,
the phone layout, axe-core in both themes, and the allocation view checked against
worker/scheduler/allocation.py. Screenshots go to artifacts/.

The model's answers are random text, so markdown is checked on answers that reach the page the way
a user's own do: a conversation imported from an export file (the real file input and store).
"""

from __future__ import annotations

import contextlib
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
AXE = Path(__file__).resolve().parent / "vendor" / "axe.min.js"  # axe-core, for this test only (not served)
KEY = "browser-key"
CAP = 300  # the server's max_tokens cap
PRESET = [[0.95, 0.90, 0.85], [0.80, 0.60, 0.40], [0.60, 0.50, 0.30]]  # docs/design.md's worked example
TIMEOUT_MS = 60_000
DESKTOP, PHONE = {"width": 1280, "height": 860}, {"width": 390, "height": 844}
CODE = "for i in range(3):\n    print(i)  # count"
MARKDOWN = f"Here is one:\n\n```python\n{CODE}\n```\n\nand `inline` code, **bold**."
WIDE = "\n\n```\n" + "x = 1; " * 40 + "\n```\n\n" + "unbroken" * 30  # must scroll or wrap, never widen the page
TABLE = "\n\n| α | survival |\n|---|---|\n| 0.8 | 0.64 |\n\nSee [the docs](https://example.org/) and a\n\n> quote"
HOSTILE = 'Stored <img src=x onerror="window.pwned=1"> and <script>window.pwned=2</script> stay inert.'


def export_file(title: str, turns: list[tuple[str, str]], **settings) -> dict:
    conv = {"title": title, "named": True, "turns": [{"user": u, "assistant": a, "mode": "baseline", "finish": "stop"}
                                                     for u, a in turns],
            "settings": {"mode": "baseline", "temperature": 0, "max_tokens": 30, "system": "", **settings}}
    return {"name": "export.json", "mimeType": "application/json",
            "buffer": json.dumps({"format": "verity.conversations", "version": 1, "conversations": [conv]}).encode()}


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    draft = build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, perturb_from=tiny_llama, noise=0.3)
    # slowed steps, so the answer arrives over many reads and streaming can be seen
    with Stack(str(tiny_llama), "--draft", str(draft), "--draft-budget", "3", "--api-key", KEY,
               "--max-tokens-cap", str(CAP), env={"VERITY_FAULT_STEP_DELAY_S": "0.02"}) as s:
        yield s
    assert s.exit_code == 0, s.log()


@contextlib.contextmanager
def browser_page(profile: Path):
    """A headless Chromium page; fails the test on any page error it reports."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Chromium is missing: no {CHROMIUM}. Install Debian's package: apt-get install -y chromium "
                    "(.ci/run does this)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright for Python is missing: pip install -e '.[test]'")
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            viewport=DESKTOP, permissions=["clipboard-read", "clipboard-write"])
        browser.set_default_timeout(TIMEOUT_MS)
        pg = browser.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        # the sanitizer's own inert parse of a hostile answer is reported, and blocked, by the CSP
        pg.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text
              and not m.location.get("url", "").endswith("/vendor/purify.min.js") else None)
        yield pg
        browser.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def page(stack, tmp_path_factory):
    with browser_page(tmp_path_factory.mktemp("chromium-profile")) as pg:
        yield pg


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def stored(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('verity.conversations'))")


def idle(page) -> None:
    page.wait_for_function("() => !document.body.classList.contains('busy')")


def ask(page, text: str) -> dict:
    """Sends `text` from the composer; the request body once the answer is complete."""
    with page.expect_request("**/v1/chat/completions") as req:
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")
    idle(page)
    return json.loads(req.value.post_data)


def copied(page, button: str) -> str:
    """Clicks a copy button; the clipboard once the button says the text is there."""
    page.click(button)
    page.wait_for_selector(f"{button}:text('Copied')")
    return page.evaluate("navigator.clipboard.readText()")


def test_chat_streams_a_joint_answer_with_its_metrics(stack, page):
    page.goto(stack.url + "/")
    page.wait_for_selector("#key-dialog[open]")  # /v1/ needs the key: the page asks for it, with the server's reason
    assert page.text_content("#key-reason code") == "Authorization: Bearer <key>"
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
    page.wait_for_selector(".bubble.assistant.streaming:not([hidden])")
    assert page.evaluate("document.activeElement.id") == "prompt"  # focus stays in the composer
    idle(page)
    partials = page.evaluate("window.partials")
    assert len(set(partials)) >= 3, f"the answer did not stream: lengths seen {partials}"
    chips = {c.get_attribute("data-metric"): c.text_content() for c in page.query_selector_all(".turn .metrics .chip")}
    assert re.fullmatch(r"tokens/s \d+\.\d", chips["tps"]) and re.fullmatch(r"first token \d+ ms", chips["ttft"])
    accepted = re.fullmatch(r"draft accepted (\d+) of (\d+) \(\d+%\)", chips["acceptance"])
    assert accepted and int(accepted.group(2)) > 0, chips
    assert re.fullmatch(r"drafted per step \d\.\d\d tokens", chips["budget"]) and chips["reused"] == "cache reused 0 tokens"
    assert re.fullmatch(r"tokens \d+ in, \d+ out", chips["tokens"]) and chips["finish"].startswith("joint")
    # each token's origin (the stream's `verity` extension), shown on request
    turn = stored(page)[0]["turns"][0]
    assert "".join(text for text, _ in turn["origins"]) == turn["assistant"]
    page.check("#show-drafts")
    spans = page.locator(".turn:first-child .bubble.assistant.origins span")
    assert "".join(spans.all_text_contents()) == turn["assistant"]
    assert page.locator(".turn:first-child .from-draft").count() == sum(d for _, d in turn["origins"]) <= int(accepted.group(1))
    page.uncheck("#show-drafts")
    assert page.locator(".turn:first-child .bubble.assistant.origins").count() == 0
    # a second question carries the conversation, as stored
    page.select_option("#mode", "baseline")
    sent = ask(page, "and then?")
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"] and sent["mode"] == "baseline"
    assert sent["messages"][1]["content"] == stored(page)[0]["turns"][0]["assistant"]
    assert page.text_content(".turn:nth-child(2) [data-metric=acceptance]") == "draft accepted —"


def test_markdown_code_highlighted_copied_and_sanitized(page):
    page.set_input_files("#import", files=[export_file("Markdown", [("Show me a loop", MARKDOWN), ("And html?", HOSTILE)],
                                                       system="Be brief.", temperature=0.5)])
    page.wait_for_selector("#conversations [aria-current=true]:text('Markdown')")
    code = page.locator(".turn:first-child .code-block pre code")
    assert code.text_content() == CODE + "\n" or code.text_content() == CODE
    assert page.locator(".turn:first-child .code-block code .hljs-keyword").first.text_content() in ("for", "in")
    assert page.text_content(".turn:first-child .code-bar span") == "python"
    assert page.text_content(".turn:first-child .bubble.assistant p code") == "inline"
    assert copied(page, ".turn:first-child .code-bar button").rstrip("\n") == CODE
    assert copied(page, ".turn:first-child button[aria-label='Copy answer']") == MARKDOWN
    assert page.evaluate("window.pwned") is None and page.locator(".bubble img[onerror], .bubble script").count() == 0
    assert page.input_value("#system") == "Be brief." and page.input_value("#temperature") == "0.5"


def test_regenerate_edit_delete_and_undo(page):
    sent = None
    with page.expect_request("**/v1/chat/completions") as req:
        page.click(".turn:last-child button:text('Regenerate')")
    idle(page)
    sent = json.loads(req.value.post_data)
    assert [m["content"] for m in sent["messages"]] == ["Be brief.", "Show me a loop", MARKDOWN, "And html?"]
    assert sent["temperature"] == 0.5 and page.locator(".turn").count() == 2
    assert stored(page)[0]["turns"][1]["assistant"] != HOSTILE
    page.click(".turn:first-child button[aria-label^='Edit']")
    page.fill(".turn:first-child textarea.edit", "Count to three")
    with page.expect_request("**/v1/chat/completions") as req:
        page.click(".turn:first-child button:text('Save and send')")
    idle(page)
    assert [m["content"] for m in json.loads(req.value.post_data)["messages"]] == ["Be brief.", "Count to three"]
    assert page.locator(".turn").count() == 1 and page.text_content(".turn .bubble.user") == "Count to three"
    page.click(".turn:first-child button[aria-label^='Delete']")
    assert page.locator(".turn").count() == 0 and stored(page)[0]["turns"] == []
    page.click("#toast button:text('Undo')")
    assert page.locator(".turn").count() == 1 and stored(page)[0]["turns"][0]["user"] == "Count to three"


def test_conversations_persist_with_their_settings(page):
    page.click("#new-chat")
    page.fill("#system", "Answer in French.")
    page.fill("#max-tokens", "5000")  # above the server's cap: clamped, and said so
    page.press("#max-tokens", "Tab")
    assert page.input_value("#max-tokens") == str(CAP) and "server's cap" in page.text_content("#max-tokens-note")
    page.fill("#temperature", "7")
    page.press("#temperature", "Tab")
    assert page.input_value("#temperature") == "2"
    with page.expect_request("**/v1/chat/completions") as req:
        page.fill("#prompt", "bonjour")
        page.press("#prompt", "Enter")
    page.keyboard.press("Escape")
    idle(page)
    sent = json.loads(req.value.post_data)
    assert sent["max_tokens"] == CAP and sent["temperature"] == 2 and sent["messages"][0]["content"] == "Answer in French."
    first = page.locator("#conversations li").nth(0)
    first.locator("button:text('Rename')").click()
    page.fill("#conversations input.rename", "French")
    page.press("#conversations input.rename", "Enter")
    page.reload()
    page.wait_for_selector("#conversations [aria-current=true]:text('French')")
    assert page.input_value("#system") == "Answer in French." and page.input_value("#max-tokens") == str(CAP)
    assert page.locator(".turn .bubble.user").text_content() == "bonjour"
    # clearing asks first
    page.click("#clear-chat")
    page.click("#confirm-dialog button[value=cancel]")
    assert page.locator(".turn").count() == 1
    page.click("#clear-chat")
    page.click("#confirm-dialog #confirm-ok")
    page.wait_for_selector(".turn", state="detached")
    assert stored(page)[0]["turns"] == []
    page.click("#conversations button.open:text('Markdown')")
    assert page.input_value("#system") == "Be brief." and page.locator(".turn").count() == 1
    # deleting can be undone
    titles = [c["title"] for c in stored(page)]
    assert titles[:2] == ["French", "Markdown"]
    page.click("#conversations li:has-text('French') button:text('Delete')")
    assert [c["title"] for c in stored(page)] == titles[1:]
    page.click("#toast button:text('Undo')")
    assert [c["title"] for c in stored(page)] == titles
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["format"] == "verity.conversations" and [c["title"] for c in exported["conversations"]] == titles
    page.set_input_files("#import", files=[{"name": "x.json", "mimeType": "application/json", "buffer": b"[1, 2]"}])
    page.wait_for_selector("#toast:has-text('not a verity export')")


def test_stop_escape_and_scroll_follow_only_at_the_bottom(page):
    page.set_input_files("#import", files=[export_file("Long", [(f"question {i}", "\n\n".join(["ok"] * 30)) for i in range(2)],
                                                       max_tokens=CAP)])
    page.wait_for_selector("#conversations [aria-current=true]:text('Long')")
    height = page.locator("#prompt").bounding_box()["height"]
    page.fill("#prompt", "Tell me\na long\nstory")  # the composer grows with its text
    assert page.locator("#prompt").bounding_box()["height"] > height * 2
    page.press("#prompt", "Enter")
    long_text = ".bubble.assistant.streaming:not([hidden])"
    page.wait_for_selector(long_text)
    turns = page.locator("#turns")
    assert turns.evaluate("(t) => t.scrollHeight > t.clientHeight + 200")
    turns.evaluate("(t) => { t.scrollTop = 0; }")  # the user scrolls up: the stream must not pull the view down
    seen = page.text_content(long_text)
    page.wait_for_function("([sel, n]) => document.querySelector(sel).textContent.length > n", arg=[long_text, len(seen) + 20])
    assert turns.evaluate("(t) => t.scrollTop") == 0
    turns.evaluate("(t) => { t.scrollTop = t.scrollHeight; }")  # back at the bottom: it follows again
    seen = page.text_content(long_text)
    page.wait_for_function("([sel, n]) => document.querySelector(sel).textContent.length > n", arg=[long_text, len(seen) + 20])
    assert turns.evaluate("(t) => t.scrollHeight - t.scrollTop - t.clientHeight") < 40
    page.keyboard.press("Escape")
    idle(page)
    last = page.locator(".turn:last-child")
    assert last.locator(".note").text_content() == "Stopped by you." and last.locator(".error").count() == 0
    assert last.locator("button:text('Regenerate')").count() == 1


def test_errors_read_as_words_with_retry_and_send_waits_for_the_server(page):
    page.route("**/v1/chat/completions", lambda route: route.abort())
    page.fill("#max-tokens", "20")
    ask(page, "are you there?")
    last = page.locator(".turn:last-child")
    assert last.locator(".error").text_content().startswith("Could not reach the server")
    assert last.locator(".bubble.assistant").is_hidden()  # no empty ghost bubble
    page.unroute("**/v1/chat/completions")
    with page.expect_request("**/v1/chat/completions"):
        last.locator("button:text('Retry')").click()
    idle(page)
    assert last.locator(".error").count() == 0 and last.locator("[data-metric=finish]").count() == 1
    # a real server refusal, shown as its message with its parameter
    sent = ask(page, "word " * 2100)
    assert "context limit" in last.locator(".error").text_content() and "(messages)" in last.locator(".error").text_content()
    assert len(sent["messages"]) > 2
    page.route("**/health", lambda route: route.abort())
    page.wait_for_selector("#send:disabled")
    assert "unreachable" in page.text_content("#composer-note") and page.text_content("#status") == "server unreachable"
    assert last.locator("button:text('Retry')").is_disabled()
    page.unroute("**/health")
    page.wait_for_selector("#send:enabled")
    assert last.locator("button:text('Retry')").is_enabled()


BROKEN = {"format": "verity.conversations", "version": 1, "conversations": [
    {"title": "Broken", "named": True, "settings": {"mode": "warp", "temperature": "hot", "max_tokens": -3, "system": 7},
     "turns": [{"user": "q1", "assistant": "a1", "mode": "baseline", "metrics": {}, "finish": "stop"},
               {"user": 42, "assistant": "lost"}, "not a turn",
               {"user": "q3", "assistant": 5, "metrics": {"decode_tps": "fast"}, "finish": "stop"}]},
    "not a conversation", {"title": "no turns", "turns": "nope"}]}


def usable(page) -> None:
    """The page answers: Send streams an answer into the active conversation, the sidebar lists it."""
    before = page.locator(".turn").count()
    ask(page, "still there?")
    assert page.locator(".turn").count() == before + 1 and page.locator(".turn:last-child .error").count() == 0
    assert page.locator("#conversations li").count() >= 1


def test_broken_conversations_are_read_field_by_field(page, reliability):
    """A conversation file whose turn has `metrics: {}` left the page with an empty sidebar and a
    dead Send button, after reloads too. Every field is now checked on the way in: what cannot be
    read is left out with a notice, and unreadable storage is set aside, never fatal."""
    page.set_input_files("#import", files=[{"name": "broken.json", "mimeType": "application/json",
                                            "buffer": json.dumps(BROKEN).encode()}])
    page.wait_for_selector("#toast:has-text('Left out what could not be read')")
    notice = page.text_content("#toast")
    assert "2 unreadable metrics records" in notice and "2 unreadable turns" in notice and "unreadable conversation" in notice
    page.wait_for_selector("#conversations [aria-current=true]:text('Broken')")
    assert page.locator(".turn .bubble.user").all_text_contents() == ["q1", "q3"]
    assert page.input_value("#max-tokens") == "256" and page.locator(".turn [data-metric]").count() == 0
    usable(page)
    page.reload()  # what was kept is the checked copy
    page.wait_for_selector("#conversations [aria-current=true]:text('Broken')")
    usable(page)
    # a store broken in place (another tab, an old version, a hand edit): its turn's metrics {} again
    page.evaluate("""() => { const list = JSON.parse(localStorage.getItem('verity.conversations'));
        list[0].turns[0].metrics = {}; localStorage.setItem('verity.conversations', JSON.stringify(list)); }""")
    page.reload()
    page.wait_for_selector("#toast:has-text('1 unreadable metrics record')")
    usable(page)
    # a store that is not JSON at all: set aside, the page starts afresh
    page.evaluate("() => localStorage.setItem('verity.conversations', '[{not json')")
    page.reload()
    page.wait_for_selector("#toast:has-text('set aside')")
    assert page.evaluate("localStorage.getItem('verity.conversations.unreadable')") == "[{not json"
    usable(page)
    assert stored(page)[0]["turns"][-1]["user"] == "still there?"
    reliability.record(
        "bad_input", "Broken conversations in the web UI",
        "In Chromium: an export file with a turn whose metrics are {} (and a numeric question, a non-object turn, "
        "bad settings, a non-conversation); then the same metrics written into the browser's storage; then storage "
        "that is not JSON. After each (and a reload) a question is sent and answered.",
        expected="what cannot be read is left out with a visible notice; the page keeps working",
        notice=notice, lost=0, hung=0, leaked="none")


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
    assert page.get_attribute("nav a[data-view=allocation]", "aria-current") == "page"
    order, verified, lengths = shown(page)  # the preset, at its default budget
    assert order == ["A1", "A2", "B1", "A3", "C1", "B2", "C2", "B3", "C3"]  # the worked example's order there
    assert (order, verified, lengths) == expected(PRESET, 4)
    assert [c.text_content() for c in page.query_selector_all("#survival-table tbody tr:first-child td")] == \
        ["0.950#1", "0.855#2", "0.727#4"]
    # 0.7 * 0.7 = 0.48999999999999994 ties 0.49 at the stated precision: request order decides
    set_inputs(page, [[0.7, 0.7], [0.49]], 2)
    assert shown(page) == (["A1", "A2", "B1"], ["A1", "A2"], [2, 0]) == expected([[0.7, 0.7], [0.49]], 2)
    rng = random.Random(7)
    # values from a small set, so equal survivals (the tie rule) come up often
    values = [0.0, 0.25, 0.5, 0.5, 0.6, 0.7, 0.49, 0.75, 0.8, 0.9, 1.0, round(rng.random(), 3)]
    for _ in range(25):
        rows = [[rng.choice(values) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 6))]
        budget = rng.randint(0, sum(map(len, rows)) + 2)
        set_inputs(page, rows, budget)
        assert shown(page) == expected(rows, budget), (rows, budget)
    assert page.evaluate("[...document.querySelectorAll('#requests input')].every((i) => i.labels.length === 1)")


@pytest.mark.parametrize("entry, says", [("0.9, 1.5", "not a probability"), ("0.80, 1.", "not a complete number"),
                                         ("0,95", "use a dot as the decimal separator")])
def test_allocation_refuses_a_bad_entry_without_stale_results(page, entry, says):
    set_inputs(page, [[0.5], [0.5]], 1)
    bad = page.locator("#requests li:nth-child(2) input")
    bad.fill(entry)
    assert says in page.text_content("#alloc-error") and page.get_attribute("#alloc-error", "role") == "alert"
    assert bad.get_attribute("aria-invalid") == "true" and page.locator("#alloc-results").is_hidden()
    bad.fill("0.5")
    assert bad.get_attribute("aria-invalid") is None and page.locator("#alloc-results").is_visible()


def axe_violations(page) -> list[str]:
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.evaluate(AXE.read_text())  # evaluated, not a <script>: the page's CSP stays as served
    found = page.evaluate("""async () => (await axe.run(document, {resultTypes: ['violations']})).violations
        .filter((v) => v.impact === 'serious' || v.impact === 'critical')
        .map((v) => `${v.id} (${v.impact}): ${v.nodes.slice(0, 3).map((n) => n.target.join(' ')).join(', ')}`)""")
    return found


@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_layout_and_accessibility_in_both_themes(stack, page, size):
    page.goto(f"{stack.url}/#chat")  # the key and conversations are those of the checks above
    if not page.locator("#conversations button.open:text('Showcase')").count():  # a code block, a link, a table
        page.set_input_files("#import", files=[export_file("Showcase", [("Show me", MARKDOWN + TABLE + WIDE)])])
    page.set_viewport_size(DESKTOP if size == "desktop" else PHONE)
    failures = []
    for theme in ("light", "dark"):
        page.emulate_media(color_scheme=theme)
        for view in ("chat", "allocation"):
            page.goto("about:blank")  # a fresh load: the layout is chosen at start-up
            page.goto(f"{stack.url}/#{view}")
            page.wait_for_selector("#conversations li" if view == "chat" else "#ranking li", state="attached")
            if view == "chat":
                if size == "phone":  # a drawer, closed at start and again once a conversation is picked
                    page.click("#conversations-panel summary")
                page.click("#conversations button.open:text('Showcase')")
                assert page.evaluate("document.getElementById('conversations-panel').open") == (size == "desktop")
            failures += [f"{size} {theme} {view}: {v}" for v in axe_violations(page)]
            width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], f"{size} {view}: the page pans sideways ({width})"
            assert page.locator("main.view:visible").evaluate_all("(v) => v.map((m) => m.id)") == [view]
            header = page.locator("header").bounding_box()
            assert header["y"] >= 0 and page.locator("header nav").is_visible()
            if view == "chat":
                box = page.locator("#composer").bounding_box()
                assert box["y"] + box["height"] <= page.viewport_size["height"], "the composer is off-screen"
                assert page.evaluate("document.getElementById('settings-panel').open") == (size == "desktop")
            screenshot(page, f"ui-{view}-{size}-{theme}.png")
    page.emulate_media(color_scheme="light")
    page.set_viewport_size(DESKTOP)
    assert not failures, "\n".join(failures)
