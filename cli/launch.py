"""launch-stack: starts the cache service, the worker and the gateway, waits for READY, watches,
restarts, stops.

Exit codes: 0 after a clean stop, 1 when the start failed, 2 when the worker (or the gateway)
kept dying: more than --max-restarts deaths of that one process within RESTART_WINDOW_S, each
process counted on its own. A stop (SIGTERM, Ctrl-C) restarts nothing.
The cache service is not essential: when it dies the worker serves without prefix reuse, and it
is restarted with backoff for as long as the stack runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from cache_service.dirlock import DirLock, DirLocked
from cli.blas import blas_env
from cli.config import ArgumentParser, parse_with_config
from cli.ranks import GroupError, GroupPlan, RankGroup, add_group_flags, plan_from_args
from cli.launch_checks import CheckFailed, Heartbeat, raise_open_file_limit, resolve_api_key
from gateway.guard import exposure_warning
from protocol import codec, messages as m, runtime

log = logging.getLogger("verity.launch")
START_TIMEOUT_S = 600.0  # model load and warm-up
STOP_TIMEOUT_S = 10.0
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
RESTART_WINDOW_S = 120.0
EXIT_START_FAILED, EXIT_WORKER_FAILING = 1, 2
DEFAULT_CACHE_BYTES = "1G"


class StartFailed(Exception):
    pass


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict
    proc: Optional[subprocess.Popen] = None
    ready: Optional[m.Ready] = None
    failures: list[float] = field(default_factory=list)
    restart_at: Optional[float] = None
    essential: bool = True  # its dying for good fails the stack


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="launch-stack", description="Serve one MLX model: worker + gateway.")
    p.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), a local MLX folder or a Hugging Face id")
    p.add_argument("--draft", default=None, help="a draft model for joint mode (same tokenizer as the target); "
                   "'embedded': the draft distilled from the embedded model")
    p.add_argument("--draft-budget", type=int, default=None,
                   help="fix the tokens drafted per joint cycle (default: the adaptive scheduler)")
    p.add_argument("--decision-log", default=None, help="write every scheduler decision here (JSON lines; see verity replay)")
    p.add_argument("--recovery", choices=("fast", "replay"), default="fast",
                   help="hybrid-state recovery: per-position states (fast) or checkpoint and replay")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-active", type=int, default=None,
                   help="requests decoded at once, in one batch (each also needs its worst case to fit --kv-budget); "
                        "default: 64 on a GPU, 16 on the CPU")
    p.add_argument("--kv-budget", type=byte_size, default=None,
                   help="bytes the admitted requests' caches may take at most, e.g. 8G (default: the GPU's memory, "
                        "or half the machine's on the CPU, less the weights)")
    p.add_argument("--queue-size", type=int, default=16, help="requests that may wait; past that, 429")
    p.add_argument("--prefill-step", type=int, default=None,
                   help="prompt tokens a joining request prefills a round, between the others' decode steps "
                        "(default: 512 on a GPU, 128 on the CPU)")
    p.add_argument("--api-key", default=None,
                   help="require this bearer token (visible to local users: prefer VERITY_API_KEY or --api-key-file)")
    p.add_argument("--api-key-file", default=None, help="read the bearer token from this file (mode 0600)")
    p.add_argument("--max-tokens-cap", type=int, default=2048, help="the largest max_tokens a request may ask for")
    _request_default_flags(p)
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name requests may give as `model` (repeatable); responses name what the request sent")
    _body_and_store_flags(p)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--keepalive-s", type=float, default=5.0)
    p.add_argument("--stall-s", type=float, default=10.0, help="a stream whose client reads nothing this long is cut")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request not ended this long after admission is cancelled and answered with 504 (0: no limit)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a name the Host header may carry besides 127.0.0.1, localhost, [::1] and --host (repeatable)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page origin (scheme://host:port) allowed to call the API from a browser (repeatable; '*': any)")
    p.add_argument("--log-prompts", action="store_true", help="write prompt text to the log (off: only ids and counts)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help=f"deaths of the worker (or of the gateway, counted apart) within {RESTART_WINDOW_S:.0f}s before giving up")
    _liveness_flags(p)
    p.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S)
    p.add_argument("--cache-bytes", type=byte_size, default=byte_size(DEFAULT_CACHE_BYTES),
                   help=f"byte budget of the prefix-reuse snapshots, e.g. 512M or 2G (default {DEFAULT_CACHE_BYTES}; 0: no reuse)")
    p.add_argument("--cache-dir", default=None,
                   help="spill snapshots to files here (mode 0700) so reuse survives a worker restart")
    add_group_flags(p)
    a = parse_with_config(p, argv)
    problem = sampling_flag_problem(a)
    if problem:
        p.error(problem)
    return a


def _request_default_flags(p: ArgumentParser) -> None:
    """What a request that omits a field gets."""
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens of a request that omits it (default: --max-tokens-cap; it also ends at the context's end)")
    sampling = "a request that omits it gets this (default: the model's generation_config.json, else its card's value"
    p.add_argument("--temperature", type=float, default=None, help=f"{sampling}; the embedded model: 0.2; else 1)")
    p.add_argument("--top-p", type=float, default=None, help=f"{sampling}; the embedded model: 0.9; else 1)")
    p.add_argument("--top-k", type=int, default=None, help=f"{sampling}; else 0: off)")
    p.add_argument("--min-p", type=float, default=None, help=f"{sampling}; else 0: off)")
    p.add_argument("--max-thinking-tokens", type=int, default=None,
                   help="a thinking model's think block is closed after this many tokens, and the answer follows "
                        "(default: no limit; a request's `max_thinking_tokens` overrides it)")


def sampling_flag_problem(a: argparse.Namespace) -> Optional[str]:
    """What is wrong with the request defaults given (the ranges a request's own fields have)."""
    ranges = (("--temperature", a.temperature, 0.0, 2.0), ("--top-p", a.top_p, 1e-9, 1.0),
              ("--top-k", a.top_k, 0, None), ("--min-p", a.min_p, 0.0, 1.0), ("--max-tokens", a.max_tokens, 1, a.max_tokens_cap),
              ("--max-thinking-tokens", a.max_thinking_tokens, 0, None))
    for flag, value, low, high in ranges:
        if value is not None and (value < low or (high is not None and value > high)):
            return f"{flag} {value} is outside [{low:g}, {'∞' if high is None else f'{high:g}'}]"
    return None


def sampling_flags(a: argparse.Namespace) -> list[str]:
    """The worker's share of the request defaults: only those given."""
    given = (("--temperature", a.temperature), ("--top-p", a.top_p), ("--top-k", a.top_k), ("--min-p", a.min_p),
             ("--max-tokens", a.max_tokens), ("--max-thinking-tokens", a.max_thinking_tokens))
    return [f"{flag}={value}" for flag, value in given if value is not None]


def _body_and_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--responses-max-count", type=int, default=1000,
                   help="stored /v1/responses kept for GET and previous_response_id (the oldest go first)")
    p.add_argument("--responses-max-bytes", type=byte_size, default=byte_size("256M"),
                   help="bytes the stored responses may take, e.g. 64M (the oldest go first)")


def _liveness_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                   help="a worker that sends no stats this long makes /health 503")
    p.add_argument("--hang-timeout-s", type=float, default=60.0,
                   help="a worker that sends no stats this long is killed and restarted (0: never)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections at most (also: the open-file limit less 128)")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a connection that sends no whole request headers this long is closed")
    p.add_argument("--body-timeout-s", type=float, default=30.0, help="a request body must arrive within this (408)")


def byte_size(text: str) -> int:
    """'1073741824', '512M', '2G', '1.5GiB' -> bytes (K, M, G, T are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1024 ** ("KMGT".index(t[-1]) + 1) if t and t[-1] in "KMGT" else 1
    try:
        value = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte size cannot be negative: {text!r}")
    return int(value * scale)


class Supervisor:
    def __init__(self, args: argparse.Namespace, group: Optional[GroupPlan] = None):
        self.args, self.group = args, group
        base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        self.runtime_dir = tempfile.mkdtemp(prefix="verity-", dir=base if os.path.isdir(base) else None)
        os.chmod(self.runtime_dir, 0o700)
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(runtime.endpoint(self.runtime_dir, runtime.SUPERVISOR))
        self.to_gateway = self.ctx.socket(zmq.PUSH)
        self.to_gateway.setsockopt(zmq.LINGER, 0)
        self.to_gateway.connect(runtime.endpoint(self.runtime_dir, runtime.GATEWAY_CONTROL))
        self.decoder = codec.supervisor_decoder()
        self.death_r, self.death_w = os.pipe()  # children see EOF when this process dies
        self.stopping = False
        self.heartbeat = Heartbeat(self.ctx, self.runtime_dir)
        self.dir_lock: Optional[DirLock] = None
        self.children = {c.name: c for c in self._children()}

    def _children(self) -> list[Child]:
        a, py = self.args, sys.executable
        base = {**os.environ, runtime.PARENT_FD_ENV: str(self.death_r)}
        key = a.api_key  # resolved by main(); children get it by environment only
        max_active = ["--max-active", str(a.max_active)] if a.max_active else []  # else the worker's, per device
        gw_env = {**base, "VERITY_API_KEY": key} if key else {k: v for k, v in base.items() if k != "VERITY_API_KEY"}
        worker = Child("worker", [py, "-m", "worker", "--runtime-dir", self.runtime_dir, "--model", a.model,
                                  *max_active, "--queue-size", str(a.queue_size),
                                  *(["--kv-budget", str(a.kv_budget)] if a.kv_budget else []),
                                  *(["--prefill-step", str(a.prefill_step)] if a.prefill_step else []),
                                  "--recovery", a.recovery, *(["--draft", a.draft] if a.draft else []),
                                  *(["--draft-budget", str(a.draft_budget)] if a.draft_budget is not None else []),
                                  *sampling_flags(a),
                                  *(["--decision-log", a.decision_log] if a.decision_log else []),
                                  *(["--prefix-cache"] if a.cache_bytes else []),
                                  *(["--cache-dir", os.path.abspath(a.cache_dir)] if a.cache_bytes and a.cache_dir else [])],
                       blas_env(base))
        gateway = Child("gateway", [py, "-m", "gateway", "--runtime-dir", self.runtime_dir, "--host", a.host,
                                    "--port", str(a.port), *max_active,
                                    "--queue-size", str(a.queue_size), "--max-tokens-cap", str(a.max_tokens_cap),
                                    "--max-body-bytes", str(a.max_body_bytes), "--keepalive-s", str(a.keepalive_s),
                                    "--stall-s", str(a.stall_s),
                                    "--drain-timeout-s", str(a.drain_timeout_s),
                                    "--request-timeout-s", str(a.request_timeout_s),
                                    "--heartbeat-timeout-s", str(a.heartbeat_timeout_s),
                                    "--max-connections", str(a.max_connections),
                                    "--header-timeout-s", str(a.header_timeout_s),
                                    "--body-timeout-s", str(a.body_timeout_s),
                                    "--responses-max-count", str(a.responses_max_count),
                                    "--responses-max-bytes", str(a.responses_max_bytes),
                                    *[f"--allow-host={h}" for h in a.allow_host],
                                    *[f"--served-model-name={n}" for n in a.served_model_name],
                                    *[f"--allow-origin={o}" for o in a.allow_origin],
                                    *(["--log-prompts"] if a.log_prompts else [])], gw_env)
        if not a.cache_bytes:
            return [worker, gateway]
        cache = Child("cache", [py, "-m", "cache_service", "--runtime-dir", self.runtime_dir,
                                "--cache-bytes", str(a.cache_bytes)], base, essential=False)
        return [cache, worker, gateway]  # the cache first: the worker registers its spilled snapshots there

    def spawn(self, c: Child) -> None:
        c.ready, c.restart_at = None, None
        if c.name == "worker" and self.group is not None:
            try:
                c.proc = RankGroup(self.group, c.argv, c.env, self.runtime_dir, pass_fds=(self.death_r,))
            except GroupError as e:
                raise StartFailed(str(e)) from None
            return
        c.proc = subprocess.Popen(c.argv, env=c.env, pass_fds=(self.death_r,))
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    # ---- start ----

    def start(self) -> None:
        if self.args.cache_bytes and self.args.cache_dir:
            try:
                os.makedirs(self.args.cache_dir, mode=0o700, exist_ok=True)
                self.dir_lock = DirLock(self.args.cache_dir)
                self.dir_lock.acquire()
            except OSError as e:
                raise StartFailed(f"cannot use --cache-dir {self.args.cache_dir}: {e.strerror}") from None
            except DirLocked as e:
                raise StartFailed(str(e)) from None
        for c in self.children.values():
            self.spawn(c)
        deadline = time.monotonic() + self.args.start_timeout_s
        # a cache service that dies while starting is restarted by watch(); the stack starts without it
        while waiting := [c.name for c in self.children.values() if not c.ready and (c.essential or c.restart_at is None)]:
            if self.stopping:
                raise StartFailed("interrupted during start-up")
            while self._receive(timeout_ms=0):
                pass
            for c in self.children.values():
                code = c.proc.poll()
                if code is not None and not c.ready and c.restart_at is None:  # one that died after READY is watch()'s
                    if c.essential:
                        raise StartFailed(f"{c.name} exited with code {code} during start-up")
                    self._exited(c, code, time.monotonic())
            if time.monotonic() > deadline:
                raise StartFailed(f"no READY from {', '.join(waiting)} within {self.args.start_timeout_s:.0f}s")
            self._receive(timeout_ms=100)

    def _receive(self, timeout_ms: int) -> bool:
        """Handles one message from a child, if one comes within the timeout."""
        if not self.inbox.poll(timeout_ms):
            return False
        try:
            msg = self.decoder.decode(self.inbox.recv())
        except codec.DecodeError as e:
            log.error("dropped an undecodable message: %s", e)
            return True
        c = self.children.get(msg.process) if isinstance(msg, m.Ready) else None
        if c is None or c.proc is None or msg.pid != c.proc.pid:
            return True
        if msg.protocol_version != m.PROTOCOL_VERSION:
            raise StartFailed(f"{c.name} speaks protocol {msg.protocol_version}, launch-stack {m.PROTOCOL_VERSION}")
        c.ready = msg
        log.info("%s ready (pid %d)", c.name, msg.pid)
        if c.name == "worker":
            self.heartbeat.expect(msg.pid)
        if c.name in ("worker", "gateway"):  # the gateway resubmits what waits on each worker READY
            self._tell_gateway_about_worker()
        return True

    def _tell_gateway_about_worker(self) -> None:
        worker, gateway = self.children["worker"], self.children["gateway"]
        if worker.ready and gateway.ready:
            self.to_gateway.send(codec.encode(worker.ready))

    # ---- watch ----

    def watch(self) -> int:
        while not self.stopping:
            self._receive(timeout_ms=100)
            if self.stopping:  # children exit on the same signal: none of that is a death
                break
            self._check_heartbeat()
            now = time.monotonic()
            for c in self.children.values():
                if c.restart_at is not None:
                    if now >= c.restart_at:
                        self.spawn(c)
                    continue
                code = c.proc.poll()
                if code is not None and not self._exited(c, code, now):
                    return EXIT_WORKER_FAILING
        return 0

    def _check_heartbeat(self) -> None:
        """A ready worker silent past --hang-timeout-s is killed; the next poll restarts it."""
        worker, limit = self.children["worker"], self.args.hang_timeout_s
        if not (limit and worker.ready and worker.proc.poll() is None):
            return
        silent = self.heartbeat.silent_s()
        if silent > limit:
            log.error("worker (pid %d) sent no heartbeat for %.1fs (--hang-timeout-s %g): killing it",
                      worker.proc.pid, silent, limit)
            worker.proc.kill()
            worker.proc.wait()

    def _exited(self, c: Child, code: int, now: float) -> bool:
        """Schedules the restart of a child that exited, with backoff; False: an essential one
        keeps dying (a non-essential one is restarted for as long as the stack runs)."""
        log.error("%s (pid %d) exited with code %d", c.name, c.proc.pid, code)
        if c.name == "worker":
            self.to_gateway.send(codec.encode(m.WorkerDown(c.proc.pid, code)))
        c.failures = [t for t in c.failures if now - t < RESTART_WINDOW_S] + [now]
        if c.essential and len(c.failures) > self.args.max_restarts:
            log.error("%s died %d times within %.0fs (--max-restarts %d); giving up", c.name, len(c.failures),
                      RESTART_WINDOW_S, self.args.max_restarts)
            return False
        delay = BACKOFF_S[min(len(c.failures) - 1, len(BACKOFF_S) - 1)]
        log.info("restarting %s in %.1fs%s", c.name, delay, "" if c.essential else " (serving without it meanwhile)")
        c.ready, c.restart_at = None, now + delay
        return True

    # ---- stop ----

    def stop(self) -> None:
        """Gateway first (it drains admitted requests), then the worker, then the cache service."""
        gateway, worker, cache = self.children["gateway"], self.children["worker"], self.children.get("cache")
        _terminate(gateway.proc, self.args.drain_timeout_s + STOP_TIMEOUT_S)
        _terminate(worker.proc, STOP_TIMEOUT_S)
        _terminate(cache.proc if cache else None, STOP_TIMEOUT_S)
        self.ctx.destroy(linger=0)
        if self.dir_lock is not None:
            self.dir_lock.release()
        os.close(self.death_w)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _terminate(proc: Optional[subprocess.Popen], timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not stop within %.0fs; killing it", proc.pid, timeout)
        proc.kill()
        proc.wait()


def _banner(url: str) -> str:
    return (
        f"\nverity is serving on {url}\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'\n"
        "Stop with Ctrl-C.\n"
    )


def _on_command_line(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch-stack %(levelname)s %(message)s")
    os.umask(0o077)  # sockets, spilled snapshots and logs of the stack: readable by this user only
    try:
        args.api_key = resolve_api_key(args.api_key, args.api_key_file, _on_command_line(argv, "--api-key"))
        soft, _ = raise_open_file_limit()
    except CheckFailed as e:
        log.error("start failed: %s", e)
        return EXIT_START_FAILED
    log.info("open-file limit %d", soft)
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        log.warning("%s", warning)
    try:
        group = plan_from_args(args.ranks, args.hostfile, args.backend, args.shard, args.rank_timeout_s)
    except GroupError as e:
        log.error("start failed: %s", e)
        return EXIT_START_FAILED
    sup = Supervisor(args, group)
    log.info("runtime directory %s (mode 0700)", sup.runtime_dir)

    def on_signal(signum, _frame):
        log.info("received %s: stopping", signal.Signals(signum).name)
        sup.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        sup.start()
        print(_banner(sup.children["gateway"].ready.url), flush=True)
        code = sup.watch()
    except StartFailed as e:
        log.error("start failed: %s", e)
        code = EXIT_START_FAILED
    finally:
        sup.stop()
    log.info("stopped (exit %d)", code)
    return code


if __name__ == "__main__":
    sys.exit(main())
