"""A launch-stack run as a child process: start, wait for /health 200, stop with SIGTERM.

    with StackProcess(model="embedded", port=0) as stack:
        ...  # stack.url is ready to serve

Used by the benches and the tests. The child's output (launch-stack and its worker and gateway)
is drained by a thread: echoed to stderr when `echo`, otherwise kept as a tail for error reports.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0  # launch-stack drains the gateway, then stops the worker
_BANNER = re.compile(r"verity is serving on (http://\S+)")


class StackError(RuntimeError):
    pass


def health(url: str, timeout: float = 2.0) -> tuple[int, Optional[dict]]:
    """(HTTP status, body) of GET /health; (0, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


class StackProcess:
    def __init__(self, model: str = "embedded", port: int = 0, host: str = "127.0.0.1",
                 extra_args: tuple[str, ...] = (), env: Optional[dict] = None,
                 start_timeout_s: float = START_TIMEOUT_S, echo: bool = False, tail_lines: int = 200):
        self.argv = [sys.executable, "-m", "cli.launch", "--model", model, "--host", host,
                     "--port", str(port), *extra_args]
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.start_timeout_s = start_timeout_s
        self.echo = echo
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.exit_code: Optional[int] = None  # set by stop()
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._banner = threading.Event()
        self._reader: Optional[threading.Thread] = None

    # ---- start ----

    def start(self) -> "StackProcess":
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", bufsize=1)
        self._reader = threading.Thread(target=self._drain, name="stack-output", daemon=True)
        self._reader.start()
        try:
            self.wait_ready(self.start_timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self.echo:
                sys.stderr.write(line)
            match = _BANNER.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._banner.set()

    def wait_ready(self, timeout_s: float) -> None:
        """Waits for launch-stack's banner (it names the port, even for --port 0), then /health 200."""
        deadline = time.monotonic() + timeout_s
        while not self._banner.wait(0.1):
            self._check_alive()
            if time.monotonic() > deadline:
                raise StackError(f"launch-stack did not start within {timeout_s:.0f}s{self._tail_text()}")
        wait_healthy(self.url, max(1.0, deadline - time.monotonic()), alive=self._check_alive)

    def _check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            self._reader.join(timeout=2)
            raise StackError(f"launch-stack exited with code {code} during start-up{self._tail_text()}")

    def _tail_text(self, n: int = 40) -> str:
        lines = list(self.tail)[-n:]
        return ("; its last output:\n" + "\n".join(lines)) if lines else ""

    # ---- stop ----

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then waits; returns launch-stack's exit code (SIGKILL after the timeout: -9)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.exit_code = self.proc.returncode
        return self.exit_code

    def wait_exit(self, timeout_s: float) -> int:
        """Waits for launch-stack to exit by itself; returns its exit code."""
        self.exit_code = self.proc.wait(timeout_s)
        self._reader.join(timeout=5)
        return self.exit_code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "StackProcess":
        return self if self.proc is not None else self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()


def wait_healthy(url: str, timeout_s: float, alive=None) -> dict:
    """Polls /health until 200 (returns its body); StackError at the deadline."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        status, body = health(url)
        if status == 200:
            return body
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise StackError(f"{url}/health did not answer 200 within {timeout_s:.0f}s (last: {status} {body})")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
