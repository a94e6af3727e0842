"""A real launch-stack in a subprocess, for integration tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional

LAUNCH_STACK = str(Path(sys.executable).parent / "launch-stack")
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Polls a condition until it holds; fails naming it after the timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """wait_until for async tests: the blocking check runs in a thread so the loop keeps going."""
    import asyncio

    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


class Stack:
    def __init__(self, model: str, *args: str, log_path: Path, env: Optional[dict] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [LAUNCH_STACK, "--model", model, "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Stack":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        wait_until(lambda: self.proc.poll() is not None or self.health()[0] == 200, START_TIMEOUT_S, "READY")
        if self.proc.poll() is not None:
            raise RuntimeError(f"launch-stack exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, {}

    def worker_pid(self) -> Optional[int]:
        return self.health()[1].get("worker_pid")

    def idle(self) -> bool:
        """No admitted request in the gateway and none active or queued in the worker."""
        code, h = self.health()
        w = h.get("worker") or {}
        return code == 200 and h.get("admitted") == 0 and w.get("active") == 0 and w.get("queue_depth") == 0

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
