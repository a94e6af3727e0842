"""The surfaces around the API on a real stack: GET /metrics (Prometheus), /v1/verity/info and
/v1/verity/stats, the static UI's serving rules, and launch-stack --config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.client import complete
from cli.launch import parse_args
from gateway.surfaces import STATIC_DIR
from stack import LAUNCH_STACK, Stack, wait_until
from bench.tiny_models import build_tiny_model

KEY = "surface-key"


def get(url: str, key: str | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def scrape(url: str) -> dict:
    """{(sample name, sorted labels): value} of one /metrics scrape, parsed by prometheus_client."""
    status, headers, body = get(url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


@pytest.fixture(scope="module")
def draft(tiny_llama, tmp_path_factory) -> Path:
    """A noisy copy of the target: it agrees often, not always (acceptance strictly between 0 and 1)."""
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, perturb_from=tiny_llama, noise=0.3)


@pytest.fixture(scope="module")
def stack(tiny_llama, draft, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "verity.toml"
    config.write_text(f'api-key = "{KEY}"\ndraft = "{draft}"\ndraft-budget = 3\n'
                      'max_tokens_cap = 64\nmax-active = 2\n')
    with Stack(str(tiny_llama), "--config", str(config), "--max-tokens-cap", "128") as s:
        yield s
    assert s.exit_code == 0, s.log()


def chat(stack, text: str, mode: str = "baseline", **kw) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 16,
            "ignore_eos": True, "mode": mode, **kw}
    return complete(stack.url, body, KEY)


def test_config_file_values_apply_and_flags_override_them(stack, draft):
    status, _, body = get(stack.url + "/v1/verity/info", KEY)
    info = json.loads(body)
    assert status == 200 and info["ready"] and info["joint_available"]
    assert info["draft_id"].startswith(draft.name + "@")  # draft from the file
    assert info["max_tokens_cap"] == 128  # the flag beat the file's 64
    assert info["kv_format"] == "native"  # no --kv-bits: the model's dtype
    assert get(stack.url + "/v1/verity/info")[0] == 401  # api-key from the file


def test_metrics_counters_move_after_requests(stack):
    before = scrape(stack.url)
    answers = [chat(stack, "hello world", "joint"), chat(stack, "the quick brown fox", "baseline")]
    with pytest.raises(Exception, match="temperature"):
        chat(stack, "x", temperature=7)
    after = scrape(stack.url)  # the gateway counts a request before it answers it
    delta = lambda name, **labels: after[(name, tuple(sorted(labels.items())))] - before.get((name, tuple(sorted(labels.items()))), 0)  # noqa: E731
    mx = [a["metrics"] for a in answers]
    assert delta("verity:requests_total", status="200") == 2
    assert delta("verity:requests_total", status="400") == 1
    assert delta("verity:request_success_total", finished_reason="length") == 2
    assert delta("verity:prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert delta("verity:generation_tokens_total") == 32
    assert delta("verity:spec_decode_num_draft_tokens_total") == mx[0]["drafted"] > 0
    assert delta("verity:spec_decode_num_accepted_tokens_total") == mx[0]["accepted"]
    assert delta("verity:spec_decode_num_drafts_total") == mx[0]["cycles"]
    assert delta("verity:time_to_first_token_seconds_count") == 2
    assert delta("verity:time_to_first_token_seconds_sum") == pytest.approx(sum(m["ttft_s"] for m in mx))
    assert after[("verity:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == \
        after[("verity:time_to_first_token_seconds_count", ())]
    assert after[("verity:num_requests_running", ())] == after[("verity:num_requests_waiting", ())] == 0
    assert after[("verity:worker_up", ())] == 1 and after[("verity:worker_restarts_total", ())] == 0
    assert after[("verity:cache_bytes", ())] >= 0  # 0 while no cache service runs
    info = [k for k in after if k[0] == "verity:info"]
    assert dict(info[0][1])["model"] == Path(stack.argv[stack.argv.index("--model") + 1]).name


def test_stats_relay_the_workers_joint_totals(stack):
    answers = [chat(stack, "once upon a time", "joint"), chat(stack, "one two three", "joint")]
    drafted = sum(a["metrics"]["drafted"] for a in answers)

    def stats() -> dict:
        return json.loads(get(stack.url + "/v1/verity/stats", KEY)[2])

    def settled() -> bool:  # the worker publishes a snapshot every 0.5 s
        s = stats()
        ws = s["worker_stats"]
        return ws is not None and ws["requests_finished"] == sum(s["totals"]["finished"].values())

    wait_until(settled, 10, "a worker snapshot that includes the last request")
    s = stats()
    ws, tot = s["worker_stats"], s["totals"]
    # everything the worker drafted went through the gateway's counters too (warm-up excluded)
    assert ws["drafted_total"] == tot["drafted"] >= drafted > 0
    assert ws["accepted_total"] == tot["accepted"] and ws["cycles_total"] == tot["cycles"]
    # a request's metrics are taken before its last cycle's recovery; the worker's totals after it
    assert ws["rollbacks_total"] >= tot["rollbacks"] > 0 and ws["recovery_s_total"] >= tot["recovery_s"] > 0
    assert s["worker"]["joint_available"]
    cache = [ws[k] for k in ("cache_bytes", "cache_hits", "cache_lookups")]
    assert cache[0] is None and cache[1:] == [0, 0] or cache[0] >= 0 and cache[2] >= cache[1] >= 0  # off, or counting
    assert s["gateway"]["worker_restarts"] == 0 and s["recent"]["acceptance"] is not None
    assert get(stack.url + "/v1/verity/stats")[0] == 401


def test_ui_is_served_without_key_and_fetches_nothing_from_outside(stack):
    status, headers, body = get(stack.url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for src in re.findall(r'(?:src|href)="([^"]+)"', body.decode()):
        if src.startswith("/static/"):
            assert get(stack.url + src)[0] == 200, src
    # vendor/'s libraries name URLs in licences and XML namespaces: the CSP above keeps the page from
    # fetching any, and tests/test_browser.py fails on any CSP violation
    for f in STATIC_DIR.iterdir():
        assert f.is_dir() or not re.search(r"https?://", f.read_text()), f"{f.name} refers to another host"
    assert get(stack.url + "/static/nope.js")[0] == 404


# ---- --config without a stack ----


def test_config_parsing(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('model = "/models/m"\nmax-active = 3\nqueue_size = 5\nkeepalive-s = 2\nrecovery = "replay"\n')
    a = parse_args(["--config", str(f), "--queue-size", "7"])
    assert (a.model, a.max_active, a.queue_size, a.keepalive_s, a.recovery) == ("/models/m", 3, 7, 2.0, "replay")
    assert a.port == 8000  # untouched defaults stay


@pytest.mark.parametrize("text, message", [
    ("max-actve = 3\ncolour = 1\n", "unknown keys colour, max-actve"),
    ("port = \"8000\"\n", "`port` must be an integer, not str '8000'"),
    ("recovery = \"fastest\"\n", "`recovery` must be one of fast, replay"),
    ("max-active = 1\nmax_active = 2\n", "`max_active` is set twice"),
    ("port = \n", "is not valid TOML"),
])
def test_bad_config_is_refused_by_name(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    r = subprocess.run([LAUNCH_STACK, "--config", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert message in r.stderr and str(f) in r.stderr, r.stderr


def test_verity_chat_switches_to_joint_and_shows_its_figures(stack):
    script = "hello\n/mode joint\nand again\n/quit\n"
    r = subprocess.run([sys.executable, "-m", "cli.main", "chat", "--url", stack.url, "--max-tokens", "12",
                        "--temperature", "0", "--ignore-eos"], input=script, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "VERITY_API_KEY": KEY})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "tok/s" in line]
    assert len(lines) == 2 and lines[0].startswith("baseline") and "accepted" not in lines[0], r.stderr
    shown = re.search(r"^joint \(.+\) · .* accepted \d+/\d+ \(\d+%\), budget (\d\.\d\d)/cycle over (\d+) cycles", lines[1])
    assert shown, lines[1]
    budget, cycles = float(shown[1]), int(shown[2])  # k = 3, less in the last cycles (the tokens left)
    assert 3 * (cycles - 3) <= budget * cycles + 0.01 * cycles and budget <= 3, lines[1]
