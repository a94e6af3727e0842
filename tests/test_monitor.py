"""`verity monitor` against a real stack: its figures follow the requests, and it rides through a
restart of the whole stack (gateway down, then a new one on the same port)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from cli.client import complete
from cli.monitor import Monitor, fetch_stats, render
from cli.stack_process import StackProcess
from stack import wait_until
from bench.tiny_models import build_tiny_model

FRAME = "verity monitor  "  # every frame starts with this title


def _ctrl_c_as_in_a_terminal() -> None:
    """In the monitor's child: SIGINT neither ignored nor blocked, whatever the test process inherited
    or set (in the whole suite the monitor once ignored the SIGINT below: both fresh-clone CI runs
    of this session timed out waiting for it to exit, while the file alone passed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class MonitorProcess:
    """`verity monitor` with its stdout piped: it prints one frame per interval."""

    def __init__(self, url: str, preexec=_ctrl_c_as_in_a_terminal):
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "monitor", "--url", url, "--interval", "0.2",
                                      "--width", "120"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=preexec)
        self.frames: list[str] = []
        self._current: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(FRAME) and self._current:
                self.frames.append("".join(self._current))
                self._current = []
            self._current.append(line)

    def last(self) -> str:
        return self.frames[-1] if self.frames else ""

    def figure(self, pattern: str) -> tuple[str, ...] | None:
        match = re.search(pattern, self.last())
        return match.groups() if match else None

    def shows(self, pattern: str) -> bool:
        return self.figure(pattern) is not None

    def wait_for(self, pattern: str, what: str, timeout: float = 60) -> tuple[str, ...]:
        def seen() -> bool:
            assert self.proc.poll() is None, "the monitor exited:\n" + self.last()
            return self.shows(pattern)
        try:
            wait_until(seen, timeout, what)
        except TimeoutError as e:
            raise AssertionError(f"{e}; last frame:\n{self.last()}") from None
        return self.figure(pattern)


@pytest.fixture(scope="module")
def draft(tiny_llama, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, perturb_from=tiny_llama, noise=0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(tiny_llama, draft, port: int) -> StackProcess:
    return StackProcess(str(tiny_llama), port=port, extra_args=("--draft", str(draft), "--draft-budget", "3"),
                        start_timeout_s=120).start()


def ask(url: str, mode: str) -> dict:
    return complete(url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0,
                          "ignore_eos": True, "mode": mode})


def test_monitor_follows_the_stack_through_a_restart(tiny_llama, draft):
    port = free_port()
    stack = start_stack(tiny_llama, draft, port)
    mon = MonitorProcess(stack.url)
    try:
        mon.wait_for(r"connected: gateway pid \d+", "the monitor to connect")
        assert mon.figure(r"finished\s+(\d+)") == ("0",) and mon.shows(r"acceptance\s+0/0 = –")
        answers = [ask(stack.url, "joint"), ask(stack.url, "joint"), ask(stack.url, "baseline")]
        mon.wait_for(r"finished\s+3\b", "three finished requests")
        accepted = sum(a["metrics"]["accepted"] for a in answers)
        drafted = sum(a["metrics"]["drafted"] for a in answers)
        mon.wait_for(rf"acceptance\s+{accepted}/{drafted} = \d+%", "the worker's joint totals of all three")
        assert mon.figure(r"prompt · generated tokens\s+\d+ · (\d+)") == ("36",)
        assert mon.shows(r"worker\s+\d+\s+ready")
        if fetch_stats(stack.url, None)["worker_stats"]["cache_bytes"] is None:  # no cache service
            assert mon.shows(r"cache\s+–\s+off") and mon.shows(r"bytes\s+off") and mon.shows(r"hit rate\s+off")
        else:
            assert mon.shows(r"cache\s+–\s+up") and mon.shows(r"bytes\s+\d+(\.\d)? (B|KiB|MiB|GiB)")

        old_pid = stack.proc.pid
        assert stack.stop() == 0
        mon.wait_for(r"DISCONNECTED for \d+s", "the monitor to notice the stack is gone")
        stack = start_stack(tiny_llama, draft, port)
        mon.wait_for(r"reconnected: the stack restarted", "the monitor to reconnect")
        mon.wait_for(r"worker\s+\d+\s+ready", "the new worker")
        assert mon.figure(r"finished\s+(\d+)") == ("0",) and stack.proc.pid != old_pid
        ask(stack.url, "joint")
        mon.wait_for(r"finished\s+1\b", "the new stack's first request")
        assert mon.proc.poll() is None
    finally:
        stack.stop()
        mon.proc.send_signal(signal.SIGINT)
        code = mon.proc.wait(10)
    assert code == 0


def test_ctrl_c_stops_the_monitor_even_when_started_with_sigint_ignored():
    # nothing listens there: it draws the stack as unreachable; its parent ignores SIGINT (a background job)
    mon = MonitorProcess(f"http://127.0.0.1:{free_port()}", preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        mon.wait_for(r"verity monitor", "a first frame")
        mon.proc.send_signal(signal.SIGINT)
        assert mon.proc.wait(10) == 0
    finally:
        if mon.proc.poll() is None:
            mon.proc.kill()
            mon.proc.wait()


def test_render_without_a_stack():
    mon = Monitor("http://127.0.0.1:9")
    mon.update(None, "unreachable (connection refused)")
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(render(mon))
    text = console.export_text()
    assert "DISCONNECTED" in text and "disconnected: unreachable (connection refused)" in text


def _frame(width: int) -> str:
    """A frame of a stack with large figures, rendered at `width` columns."""
    from rich.console import Console

    stats = {"time": 1000.0, "launcher": {"pid": 11},
             "gateway": {"pid": 12, "started_at": 10.0, "draining": False, "worker_restarts": 0, "capacity": 32,
                         "running": 16, "waiting": 16},
             "worker": {"pid": 13, "model": "SmolLM2-135M-Instruct", "draft_id": None},
             "worker_stats": {"time": 999.5, "queue_depth": 16, "active": 16, "tokens_per_s": 12345.6,
                              "drafted_total": 987654, "accepted_total": 876543, "cycles_total": 123456,
                              "rollbacks_total": 54321, "recovery_s_total": 1234.567, "cache_bytes": 1 << 30,
                              "cache_budget_bytes": 1 << 30, "cache_hits": 9876, "cache_lookups": 12345},
             "totals": {"finished": {"stop": 123456, "length": 234567, "cancelled": 3456},
                        "responses": {"200": 361479, "400": 4321, "429": 765, "503": 21},
                        "kinds": {"chat": 360000, "completion": 1479, "responses": 5107},
                        "errors": {"context_length_exceeded": 17, "generation_failed": 3},
                        "error_statuses": {"400": 17, "500": 3},
                        "prompt_tokens": 123456789, "generation_tokens": 98765432, "cached_tokens": 7654321},
             "recent": {"ttft_p50_s": 0.123, "ttft_p95_s": 12.345, "acceptance": 0.876, "budget_per_cycle": 3.21}}
    mon = Monitor("http://127.0.0.1:8000")
    mon.update(stats)
    console = Console(width=width, record=True)
    console.print(render(mon))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_every_value_shows_at_80_columns_and_errors_are_split_by_class(width):
    """Client errors (4xx) apart from server errors (5xx), and no value cut or dropped at 80 columns."""
    text = _frame(width)
    for value in ("123456789 · 98765432", "123456 · 234567 · 3456", "5086 · 21", "17 · 3", "12345.6",
                  "876543/987654 = 89%", "54321", "1234.567 s · 22.73 ms", "7654321", "123 ms · 12345 ms",
                  "360000 · 1479 · 5107"):
        assert value in text, (value, text)
    assert "…" not in text
