"""The stack's socket layout and the parent-death watch every child runs."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

# ipc endpoints inside launch-stack's private runtime directory (mode 0700)
JOBS = "jobs"  # gateway PUSH (bind) -> worker PULL
CONTROL = "control"  # gateway PUSH (bind) -> worker PULL: cancels
EVENTS = "events"  # worker PUSH -> gateway PULL (bind)
WORKER_STATS = "worker-stats"  # worker PUB (bind) -> gateway SUB
SUPERVISOR = "supervisor"  # children PUSH -> launch-stack PULL (bind): READY
GATEWAY_CONTROL = "gateway-control"  # launch-stack PUSH -> gateway PULL (bind): worker up/down
CACHE = "cache"  # worker DEALER -> cache service ROUTER (bind): snapshot metadata, byte budget

PARENT_FD_ENV = "VERITY_PARENT_FD"


def endpoint(runtime_dir: str | Path, name: str) -> str:
    return f"ipc://{Path(runtime_dir) / name}.sock"


def watch_parent(on_death: Callable[[], None]) -> None:
    """Calls on_death when the parent's end of the inherited pipe closes (works on Linux and macOS)."""
    fd = os.environ.get(PARENT_FD_ENV)
    if fd is None:
        return

    def wait() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        on_death()

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()
