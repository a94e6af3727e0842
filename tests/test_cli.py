"""The CLI against a real launch-stack on a tiny model: verity generate / chat / bench overhead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cli.stack_process import StackProcess

VERITY = [sys.executable, "-m", "cli.main"]
RUN_TIMEOUT_S = 120


def verity(*args: str, input: str | None = None, env: dict | None = None, timeout: float = RUN_TIMEOUT_S):
    return subprocess.run([*VERITY, *args], input=input, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=None if input is not None else subprocess.DEVNULL)


# Fixtures kept here for now (candidates for conftest.py: cli_stack, fake_server).


@pytest.fixture(scope="module")
def cli_stack(tiny_llama: Path):
    """launch-stack on the tiny model, on a free port; must stop cleanly (exit 0)."""
    stack = StackProcess(model=str(tiny_llama), port=0, start_timeout_s=120).start()
    try:
        yield stack
    finally:
        code = stack.stop()
    assert code == 0, "launch-stack did not exit 0:\n" + "\n".join(stack.tail)


class _FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    sse: list[bytes] = []
    seen_headers: list[dict] = []


class _FakeHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.server.seen_headers.append(dict(self.headers))
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in self.server.sse:
            self.wfile.write(b"data: " + event + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    """A stand-in server that answers every POST with the SSE events in `server.sse`."""
    server = _FakeServer(("127.0.0.1", 0), _FakeHandler)
    server.sse, server.seen_headers = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _chunk(content=None, finish=None, metrics=None) -> bytes:
    delta = {} if content is None else {"content": content}
    obj = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if metrics is not None:
        obj["metrics"] = metrics
    return json.dumps(obj).encode()


# ---- verity generate ----


def test_generate_streams_text_then_metrics(cli_stack):
    r = verity("generate", "Hello there", "--url", cli_stack.url, "--max-tokens", "8",
               "--temperature", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no streamed text on stdout"
    assert "8 tokens" in r.stderr and "tok/s" in r.stderr and "ttft" in r.stderr, r.stderr
    # the streamed text is the whole response's text (greedy on both)
    j = verity("generate", "Hello there", "--url", cli_stack.url, "--max-tokens", "8",
               "--temperature", "0", "--ignore-eos", "--json")
    assert j.returncode == 0, j.stderr
    body = json.loads(j.stdout)
    assert body["choices"][0]["message"]["content"] == r.stdout.removesuffix("\n")
    assert body["metrics"]["completion_tokens"] == 8


def test_generate_invalid_request_exits_1_naming_the_field(cli_stack):
    r = verity("generate", "Hello", "--url", cli_stack.url, "--temperature", "5")
    assert r.returncode == 1
    assert "temperature" in r.stderr and "error 400" in r.stderr, r.stderr
    assert r.stdout == ""


def test_generate_unreachable_server_exits_1():
    r = verity("generate", "Hello", "--url", "http://127.0.0.1:9")
    assert r.returncode == 1
    assert "cannot reach" in r.stderr, r.stderr


def test_generate_error_event_mid_stream_exits_1(fake_server):
    fake_server.sse = [_chunk("partial answer"),
                       json.dumps({"error": {"message": "the worker process died", "type": "service_unavailable",
                                             "param": None, "code": "worker_died"}}).encode(),
                       b"[DONE]"]
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    r = verity("generate", "Hello", "--url", url, env={"VERITY_API_KEY": "sekrit"})
    assert r.returncode == 1
    assert r.stdout.startswith("partial answer")
    assert "the worker process died" in r.stderr and "worker_died" in r.stderr, r.stderr
    assert fake_server.seen_headers[0]["Authorization"] == "Bearer sekrit"


def test_api_key_flag_is_sent_as_bearer(fake_server):
    fake_server.sse = [_chunk("hi"), _chunk(finish="stop", metrics={"mode": "baseline", "completion_tokens": 1}),
                       b"[DONE]"]
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    r = verity("generate", "Hello", "--url", url, "--api-key", "k1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hi\n"
    assert fake_server.seen_headers[0]["Authorization"] == "Bearer k1"


# ---- verity chat ----


def test_chat_keeps_the_conversation_and_handles_commands(cli_stack):
    script = "Hello\n/mode baseline\nand a \\\nsecond line\n/reset\nHello\n/quit\n"
    r = verity("chat", "--url", cli_stack.url, "--max-tokens", "4", "--temperature", "0", input=script)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tok/s") == 3, r.stderr  # one metrics line per answer
    assert "mode: baseline" in r.stderr and "conversation cleared" in r.stderr
    # the second answer saw the whole conversation: a longer prompt than the first and third
    prompts = [int(line.split(" prompt")[0].split()[-1]) for line in r.stderr.splitlines() if " prompt + " in line]
    assert prompts[1] > prompts[0] and prompts[2] == prompts[0], prompts


def test_chat_error_keeps_the_repl_alive_and_exits_1(cli_stack):
    r = verity("chat", "--url", cli_stack.url, "--temperature", "5", "--max-tokens", "2", input="Hello\nagain\n")
    assert r.returncode == 1  # EOF ends the REPL; a failed request makes it exit 1
    assert r.stderr.count("error 400") == 2, r.stderr


def test_chat_mode_joint_asks_the_server(cli_stack):
    r = verity("chat", "--url", cli_stack.url, "--max-tokens", "2", "--temperature", "0", input="/mode joint\nHello\n")
    assert r.returncode == 0, r.stderr
    assert "no draft model" in r.stderr and r.stderr.count("tok/s") == 1  # asked in baseline mode


def test_generate_reads_the_prompt_from_stdin(cli_stack):
    args = ("--url", cli_stack.url, "--max-tokens", "3", "--temperature", "0", "--json")
    outs = [json.loads(verity("generate", *a, *args, input="Hello").stdout) for a in (["-"], [])]
    direct = json.loads(verity("generate", "Hello", *args).stdout)
    assert [o["usage"]["prompt_tokens"] for o in outs] == [direct["usage"]["prompt_tokens"]] * 2
    assert [o["choices"][0]["message"]["content"] for o in outs] == [direct["choices"][0]["message"]["content"]] * 2


def test_help_shows_defaults():
    for cmd in (["generate", "--help"], ["chat", "--help"]):
        assert "(default: " in verity(*cmd).stdout
    r = subprocess.run([sys.executable, "-m", "cli.launch", "--help"], capture_output=True, text=True, timeout=60)
    text = " ".join(r.stdout.split())
    assert "--max-tokens-cap MAX_TOKENS_CAP the largest max_tokens a request may ask for (default: 2048)" in text
    assert "--queue-size QUEUE_SIZE requests that may wait; past that, 429 (default: 16)" in text
    assert "the embedded model: 0.2" in text and "--served-model-name" in text and "(default: None)" not in text


# ---- verity bench overhead ----


def test_bench_overhead_json(tiny_llama: Path):
    r = verity("bench", "overhead", "--model", str(tiny_llama), "--json", "--tokens", "8", "--repeats", "1",
               timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["ratio"] > 0
    assert figures["inproc_tokens"] == [8] and figures["http_tokens"] == [8]
    assert figures["inproc_tps"] > 0 and figures["http_tps"] > 0
    assert figures["stack_exit_code"] == 0
    assert figures["same_text"], "greedy in-process and HTTP texts differ"
    assert "goal met" in r.stdout or "goal missed" in r.stdout


def test_launch_stack_refuses_request_defaults_out_of_range():
    for flags, words in ((["--temperature", "3"], "--temperature 3.0 is outside [0, 2]"),
                         (["--max-tokens", "99", "--max-tokens-cap", "64"], "--max-tokens 99 is outside [1, 64]")):
        r = subprocess.run([sys.executable, "-m", "cli.launch", *flags], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and words in r.stderr, r.stderr
