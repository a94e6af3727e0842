"""The worker as an MLX distributed group: N ranks started as one child of launch-stack.

`--ranks N` starts N ranks on this machine; `--hostfile FILE` (mlx.launch's format: a JSON list
of {"ssh": name, "ips": [...], "rdma": [...]}, or {"backend": ..., "envs": [...], "hosts": [...]})
starts rank i on host i, through ssh where the host is not this machine, as mlx.launch does.
Each rank gets the environment MLX's backend reads (MLX_RANK and MLX_HOSTFILE for ring, ...).
Any rank's exit takes the whole group down; launch-stack restarts it whole.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("verity.launch")
BACKENDS = ("ring", "jaccl", "nccl", "mpi")
RING_PORT = 32323  # a remote group's first ring port, as mlx.launch (rank i listens on + i)
NCCL_PORT = 12345
SSH_CHECK_S = 10
FOLLOWER_GRACE_S = 5.0  # after rank 0 stopped, the others' time to see its stop message


class GroupError(ValueError):
    """The group cannot be started as asked (names the host or setting at fault)."""


@dataclass
class Host:
    ssh: str
    ips: list[str] = field(default_factory=list)
    rdma: list = field(default_factory=list)

    @property
    def local(self) -> bool:
        """This machine: by its name, or an address of its own among the host's ips."""
        names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
        return self.ssh in names or any(_own_address(ip) for ip in self.ips)


def _own_address(ip: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


@dataclass
class GroupPlan:
    hosts: list[Host]  # one per rank
    backend: str
    shard: str = "tensor"
    rank_timeout_s: float = 60.0
    envs: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.hosts)


def add_group_flags(p) -> None:
    p.add_argument("--ranks", type=int, default=1, help="run the worker as N ranks on this machine (an MLX distributed group)")
    p.add_argument("--hostfile", default=None, help="run the worker as a group over these hosts (mlx.launch's JSON hostfile)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="the group's MLX backend (default: MLX's choice)")
    p.add_argument("--shard", choices=("tensor", "pipeline"), default="tensor", help="how the group splits the model")
    p.add_argument("--rank-timeout-s", type=float, default=60.0,
                   help="a group whose ranks make no progress this long is taken down and restarted")


def plan_from_args(ranks: int, hostfile: Optional[str], backend: Optional[str], shard: str,
                   rank_timeout_s: float) -> Optional[GroupPlan]:
    """The group launch-stack's flags ask for (None: one worker process, as without them)."""
    if ranks < 1:
        raise GroupError(f"--ranks must be at least 1, not {ranks}")
    if hostfile and ranks > 1:
        raise GroupError("--ranks and --hostfile both name the group's ranks: give one of them")
    if hostfile:
        hosts, file_backend, envs = read_hostfile(hostfile)
        backend = backend or file_backend
    elif ranks > 1:
        hosts, envs = [Host("127.0.0.1", ["127.0.0.1"]) for _ in range(ranks)], []
    else:
        return None
    if not hosts[0].local:
        raise GroupError(f"the first host of the group, {hosts[0].ssh}, must be this machine: "
                         "rank 0 serves the stack's sockets beside the gateway")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise GroupError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
    if backend == "ring" and not all(h.ips for h in hosts):
        raise GroupError("the ring backend needs each host's \"ips\" in the hostfile (the addresses its ranks listen on)")
    if backend == "mpi":
        raise GroupError("launch-stack does not start MPI jobs: use --backend ring, jaccl or nccl")
    if backend == "jaccl" and not all(h.rdma for h in hosts):
        raise GroupError("--backend jaccl needs each host's \"rdma\" devices in the hostfile")
    return GroupPlan(hosts, backend, shard, rank_timeout_s, envs)


def read_hostfile(path: str) -> tuple[list[Host], str, list[str]]:
    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise GroupError(f"cannot read the hostfile {path}: {e}") from None
    backend, envs, hosts = "", [], data
    if isinstance(data, dict):
        backend, envs, hosts = data.get("backend", ""), data.get("envs", []), data.get("hosts")
    if not isinstance(hosts, list) or len(hosts) < 2 or not all(isinstance(h, dict) and "ssh" in h for h in hosts):
        raise GroupError(f"the hostfile {path} must list at least two hosts, each {{\"ssh\": name, \"ips\": [...]}}")
    return [Host(h["ssh"], list(h.get("ips") or []), list(h.get("rdma") or [])) for h in hosts], backend, envs


def default_backend() -> str:
    """MLX's choice, as mlx.launch makes it: NCCL where MLX has CUDA, else ring."""
    probe = [sys.executable, "-c", "import mlx.core as mx; print(int(mx.cuda.is_available()))"]
    try:
        return "nccl" if subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip() == "1" else "ring"
    except (OSError, subprocess.TimeoutExpired):
        return "ring"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_env(plan: GroupPlan, runtime_dir: str) -> list[dict[str, str]]:
    """Each rank's environment for MLX's backend (what mlx.launch would set)."""
    n, local = plan.size, all(h.local for h in plan.hosts)
    extra = dict(e.split("=", 1) for e in plan.envs if "=" in e)
    if plan.backend == "ring":
        ports = free_ports(n) if local else [RING_PORT + i for i in range(n)]
        ring = json.dumps([[f"{(h.ips or [h.ssh])[0]}:{p}"] for h, p in zip(plan.hosts, ports)])
        return [{**extra, "MLX_RANK": str(i), "MLX_HOSTFILE_JSON": ring} for i in range(n)]
    first = (plan.hosts[0].ips or ["127.0.0.1"])[0]
    if plan.backend == "nccl":
        port = free_ports(1)[0] if local else NCCL_PORT
        return [{**extra, "MLX_RANK": str(i), "MLX_WORLD_SIZE": str(n), "NCCL_HOST_IP": first,
                 "NCCL_PORT": str(port), "CUDA_VISIBLE_DEVICES": str(i if local else 0)} for i in range(n)]
    devices = json.dumps([h.rdma for h in plan.hosts])
    return [{**extra, "MLX_RANK": str(i), "MLX_JACCL_COORDINATOR": f"{first}:{RING_PORT}",
             "MLX_IBV_DEVICES_JSON": devices} for i in range(n)]


def check_hosts(plan: GroupPlan) -> None:
    """Fails naming the first remote host that ssh cannot reach."""
    for h in plan.hosts:
        if h.local:
            continue
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_S}", h.ssh, "true"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=SSH_CHECK_S + 5)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise GroupError(f"cannot reach host {h.ssh} over ssh: {e}") from None
        if r.returncode != 0:
            raise GroupError(f"cannot reach host {h.ssh} over ssh: {r.stderr.strip() or f'exit {r.returncode}'}")


def _die_with_parent() -> None:
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: SIGKILL when launch-stack dies
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def core_shares(n: int) -> list[Optional[set[int]]]:
    """The cores of this machine split among n local ranks (None each where it cannot be): ranks
    that share cores wait at every all_sum for one another's time slice (docs/benchmarks.md)."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * n
    cores = sorted(os.sched_getaffinity(0))
    k = len(cores) // n
    return [set(cores[i * k : (i + 1) * k]) for i in range(n)] if k else [None] * n


def _start_local(cores: Optional[set[int]]):
    def start() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)  # the worker sizes its BLAS threads to these

    return start


def files_env(env: dict[str, str], runtime_dir: str, rank: int) -> dict[str, str]:
    """MLX reads the ring hostfile and the RDMA device list from files: write them (locally)."""
    out = dict(env)
    for key, var in (("MLX_HOSTFILE_JSON", "MLX_HOSTFILE"), ("MLX_IBV_DEVICES_JSON", "MLX_IBV_DEVICES")):
        if key in out:
            path = os.path.join(runtime_dir, f"{var.lower()}-{rank}.json")
            with open(path, "w") as f:
                f.write(out.pop(key))
            out[var] = path
    return out


def remote_command(env: dict[str, str], argv: list[str]) -> str:
    """The shell line ssh runs: the files MLX reads written on that host, then the rank."""
    script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; "
    for key, var in (("MLX_HOSTFILE_JSON", "MLX_HOSTFILE"), ("MLX_IBV_DEVICES_JSON", "MLX_IBV_DEVICES")):
        if key in env:
            script += f"f=$(mktemp); echo {shlex.quote(env[key])} > $f; export {var}=$f; "
    script += "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items() if not k.endswith("_JSON"))
    return script + "exec " + " ".join(map(shlex.quote, argv))


class RankGroup:
    """The ranks as one Popen-like child: `pid` is rank 0's, `poll()` reports the first exit
    (and takes the other ranks down), `terminate()` asks rank 0 to stop the group."""

    def __init__(self, plan: GroupPlan, argv: list[str], env: dict, runtime_dir: str, pass_fds: tuple = ()):
        check_hosts(plan)
        self.plan, self.procs, self.returncode = plan, [], None
        argv = [*argv, "--shard", plan.shard, "--backend", plan.backend, "--rank-timeout-s", str(plan.rank_timeout_s)]
        local = [i for i, h in enumerate(plan.hosts) if h.local]
        cores = dict(zip(local, core_shares(len(local)) if plan.backend == "ring" else [None] * len(local)))
        for i, (host, renv) in enumerate(zip(plan.hosts, rank_env(plan, runtime_dir))):
            if host.local:
                p = subprocess.Popen(argv, env={**env, **files_env(renv, runtime_dir, i)}, pass_fds=pass_fds,
                                     preexec_fn=_start_local(cores[i]))
            else:
                p = subprocess.Popen(["ssh", "-tt", "-o", "LogLevel=QUIET", host.ssh, remote_command(renv, argv)],
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            self.procs.append(p)
            log.info("started worker rank %d (pid %d on %s)", i, p.pid, host.ssh)

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                log.error("worker rank %d (pid %d on %s) exited with code %d: stopping its group",
                          i, p.pid, self.plan.hosts[i].ssh, code)
                self.kill()
                self.returncode = code
                return code
        return None

    def terminate(self) -> None:
        self.procs[0].terminate()  # rank 0 tells the others to stop

    def wait(self, timeout: Optional[float] = None) -> int:
        """Rank 0's exit, then the others' (stopped by it; SIGTERM after FOLLOWER_GRACE_S)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> Optional[float]:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self.procs[0].wait(left())
        for p in self.procs[1:]:
            try:
                p.wait(FOLLOWER_GRACE_S if deadline is None else min(FOLLOWER_GRACE_S, left()))
            except subprocess.TimeoutExpired:
                p.terminate()  # it was still loading, or waiting for a rank 0 that is gone
                p.wait(left())
        if self.returncode is None:
            self.returncode = self.procs[0].returncode
        return self.returncode

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
