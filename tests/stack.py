"""Test helpers around a real launch-stack (cli/stack_process.py) and condition waits."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from cli.stack_process import StackProcess, health

LAUNCH_STACK = str(Path(sys.executable).parent / "launch-stack")


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Polls a condition until it holds; fails naming it after the timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """wait_until for async tests: the blocking check runs in a thread so the loop keeps going."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


class Stack(StackProcess):
    """A launch-stack on a free port, keeping its whole log for assertions."""

    def __init__(self, model: str, *args: str, env: Optional[dict] = None, port: int = 0, **_):
        super().__init__(model=model, port=port, extra_args=args, env=env, start_timeout_s=120, tail_lines=100_000)

    def log(self) -> str:
        return "\n".join(self.tail)

    def health(self) -> tuple[int, dict]:
        status, body = health(self.url)
        return status, body or {}

    def worker_pid(self) -> Optional[int]:
        return self.health()[1].get("worker_pid")

    def settled(self, timeout: float = 30) -> dict:
        """/health once idle, with worker stats sent after idleness was seen (the worker publishes
        them every 0.5 s: an older snapshot may predate the last requests)."""
        wait_until(self.idle, timeout, "no admitted request in the gateway and none active or queued in the worker")
        t = time.time()
        wait_until(lambda: (self.health()[1].get("worker") or {}).get("time", 0) > t, 10, "fresh worker stats")
        return self.health()[1]

    def idle(self) -> bool:
        """No admitted request in the gateway and none active or queued in the worker."""
        code, h = self.health()
        w = h.get("worker") or {}
        return code == 200 and h.get("admitted") == 0 and w.get("active") == 0 and w.get("queue_depth") == 0


async def read_data_lines(resp, n: int) -> None:
    """Reads an SSE response until n `data:` lines have come."""
    seen = 0
    async for line in resp.content:
        seen += line.startswith(b"data: ")
        if seen >= n:
            return
