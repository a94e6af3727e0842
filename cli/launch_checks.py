"""What launch-stack checks before and while it serves: the API key's source, the open-file
limit, and the worker's heartbeat.

- The key comes from `VERITY_API_KEY` or `--api-key-file` (a file only its owner may read);
  `--api-key` on the command line still works but warns: every local user can read it (`ps`).
  Children get it in their environment, never on a command line.
- The soft open-file limit is raised to the hard one (the gateway holds a descriptor per
  connection). mlx-lm sets the worker's limit to 2048 soft, 4096 hard at import and fails under a
  lower hard limit: that is refused at start with what to change.
- The worker publishes stats every 0.5 s: a worker silent for `--hang-timeout-s` is killed and
  restarted as for a death (the gateway's /health says 503 sooner, at `--heartbeat-timeout-s`).
"""

from __future__ import annotations

import logging
import os
import resource
import stat
import time
from typing import Optional

import zmq

from protocol import codec, runtime

log = logging.getLogger("verity.launch")
MLX_HARD_NOFILE = 4096  # mlx_lm.utils: resource.setrlimit(RLIMIT_NOFILE, (2048, 4096)) at import


class CheckFailed(Exception):
    pass


def resolve_api_key(cli_key: Optional[str], key_file: Optional[str], on_command_line: bool) -> Optional[str]:
    """The API key from --api-key, --api-key-file or VERITY_API_KEY (in that order)."""
    if cli_key and on_command_line:
        log.warning("--api-key on the command line is readable by every local user (ps); "
                    "use VERITY_API_KEY or --api-key-file instead")
    if cli_key:
        return cli_key
    if key_file:
        return read_key_file(key_file)
    return os.environ.get("VERITY_API_KEY") or None


def read_key_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CheckFailed(f"cannot read --api-key-file {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise CheckFailed(f"--api-key-file {path} must be a regular file only its owner can read "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}; run chmod 600 {path})")
        key = f.read().strip()
    if not key:
        raise CheckFailed(f"--api-key-file {path} is empty")
    return key


def raise_open_file_limit() -> tuple[int, int]:
    """Soft limit raised to the hard one; CheckFailed when the hard one is under mlx-lm's."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < MLX_HARD_NOFILE:
        try:  # a privileged process may raise its hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (MLX_HARD_NOFILE, MLX_HARD_NOFILE))
            return MLX_HARD_NOFILE, MLX_HARD_NOFILE
        except (ValueError, OSError):
            raise CheckFailed(
                f"the hard open-file limit is {hard}; the worker needs at least {MLX_HARD_NOFILE} (mlx-lm sets it "
                f"at import): raise it (ulimit -Hn {MLX_HARD_NOFILE}, or LimitNOFILE= in a systemd unit)") from None
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # macOS refuses RLIM_INFINITY as a soft limit
            pass
    return soft, hard


class Heartbeat:
    """The worker's stats as seen by launch-stack: when the running worker was last heard."""

    def __init__(self, ctx: zmq.Context, runtime_dir: str):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(runtime.endpoint(runtime_dir, runtime.WORKER_STATS))
        self.decoder = codec.stats_decoder()
        self.pid: Optional[int] = None
        self.heard_at = time.monotonic()

    def expect(self, pid: int) -> None:
        """A new worker is ready: its silence counts from now."""
        self.pid, self.heard_at = pid, time.monotonic()

    def silent_s(self) -> float:
        """Seconds since the expected worker's last stats (drains what has arrived)."""
        while self.sock.poll(0):
            try:
                stats = self.decoder.decode(self.sock.recv())
            except codec.DecodeError:
                continue
            if stats.pid == self.pid:
                self.heard_at = time.monotonic()
        return time.monotonic() - self.heard_at if self.pid is not None else 0.0
