"""One stack per `--cache-dir`: launch-stack holds an exclusive lock on the directory while it runs.

Two stacks on one directory would adopt and then delete each other's snapshot files. The lock is
`flock` on `.verity.lock` (it holds the holder's pid, for the refusal's message); the kernel
releases it when the holder dies, so a stale file never blocks a start. A directory this process
cannot write is locked through its own descriptor (the holder's pid is then unknown).
"""

from __future__ import annotations

import fcntl
import os
from typing import Optional

LOCK_NAME = ".verity.lock"


class DirLocked(Exception):
    """Another running stack holds the directory."""


class DirLock:
    def __init__(self, directory: str):
        self.directory = directory
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        path = os.path.join(self.directory, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            writable = True
        except OSError:  # a read-only directory: lock the directory itself
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            writable = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd) if writable else None
            os.close(fd)
            who = f"launch-stack pid {holder}" if holder else "another launch-stack"
            raise DirLocked(f"--cache-dir {self.directory} is in use by {who}; give each stack its own directory") from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _holder(fd: int) -> Optional[int]:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None
