"""The reliability run's figures: tests record what they tried and measured; at the end of the
session they are written to artifacts/reliability.json and rendered into docs/reliability.md.

    def test_something(reliability):
        reliability.record("faults", "Worker killed mid-stream", "what was done ...",
                           streams_ended_with_error=1, waiting_served=2)

artifacts/RELIABILITY.md is written by every run that recorded something. The committed
docs/reliability.md is rewritten only by a full reliability run:
VERITY_FULL=1 (the 500-request load run), every reliability test run and passed.

Also here: process helpers over /proc (pids of a stack's processes, liveness, resident memory).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
SECTIONS = {
    "faults": "Faults survived",
    "load": "Load held",
    "bad_input": "Bad input refused",
    "outputs": "What clients get",
    "security": "Security",
}
FULL = os.environ.get("VERITY_FULL") == "1"

_entries: dict[str, dict] = {}  # nodeid -> entry
_outcomes: dict[str, str] = {}
_started = time.time()


class Recorder:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def record(self, section: str, title: str, tried: str, **figures) -> None:
        """Adds (or extends) this test's entry: what it tried, and named figures."""
        assert section in SECTIONS, section
        e = _entries.setdefault(self.nodeid, {"section": section, "title": title, "tried": tried, "figures": {}})
        e["figures"].update(figures)


@pytest.fixture
def reliability(request) -> Recorder:
    return Recorder(request.node.nodeid)


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed":
        prev = _outcomes.get(report.nodeid)
        if prev not in ("failed",):
            _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session, exitstatus) -> None:
    if not _entries:
        return
    entries = []
    for nodeid, e in _entries.items():
        entries.append({**e, "test": nodeid, "outcome": _outcomes.get(nodeid, "unknown")})
    run = {
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "duration_s": round(time.time() - _started, 1),
        "variant": "full (VERITY_FULL=1)" if FULL else "CI",
        "commit": _git("rev-parse", "--short", "HEAD"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "tests_collected": session.testscollected,
        "tests_failed": session.testsfailed,
    }
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "reliability.json").write_text(json.dumps({"run": run, "entries": entries}, indent=1))
    text = render(run, entries)
    (ARTIFACTS / "RELIABILITY.md").write_text(text)
    complete = {e["section"] for e in entries} == set(SECTIONS)
    if FULL and complete and all(e["outcome"] == "passed" for e in entries):
        (ROOT / "docs" / "reliability.md").write_text(text)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def render(run: dict, entries: list[dict]) -> str:
    passed = sum(e["outcome"] == "passed" for e in entries)
    out = [
        "# verity — reliability",
        "",
        "Written by the test suite from its own results (tests/reliability.py); do not edit by hand.",
        "Regenerate with the README's test command and `VERITY_FULL=1` (CI runs the same tests with a",
        "100-request load run and writes artifacts/RELIABILITY.md instead).",
        "",
        f"- run: {run['variant']}, finished {run['finished']}, {run['duration_s']} s for the whole session "
        f"({run['tests_collected']} tests collected, {run['tests_failed']} failed)",
        f"- commit: {run['commit']} (plus the working tree it ran on)",
        f"- machine: {run['machine']}; every process on loopback, tiny random-weight model",
        f"- reliability checks: {passed} of {len(entries)} passed",
        "",
    ]
    out += _attack_table(entries)
    for key, heading in SECTIONS.items():
        mine = [e for e in entries if e["section"] == key]
        if not mine:
            continue
        out += [f"## {heading}", ""]
        for e in mine:
            mark = "passed" if e["outcome"] == "passed" else f"**{e['outcome'].upper()}**"
            out += [f"### {e['title']} — {mark}", "", e["tried"], ""]
            if e["figures"]:
                out += ["| figure | value |", "| --- | --- |"]
                out += [f"| {k.replace('_', ' ')} | {_fmt(v)} |" for k, v in e["figures"].items()]
                out.append("")
            out += [f"<sub>{e['test']}</sub>", ""]
    return "\n".join(out)


def _attack_table(entries: list[dict]) -> list[str]:
    """One row per entry that states what was expected: attack, expected, observed, lost/hung/leaked."""
    rows = [e for e in entries if "expected" in e["figures"]]
    if not rows:
        return []
    out = ["## Attacks at a glance", "", "| attack | expected | observed | lost / hung / leaked |", "| --- | --- | --- | --- |"]
    for e in rows:
        f = e["figures"]
        seen = "; ".join(f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in f.items()
                         if k not in ("expected", "lost", "hung", "leaked"))
        mark = "" if e["outcome"] == "passed" else f" (**{e['outcome'].upper()}**)"
        out.append(f"| {e['title']}{mark} | {f['expected']} | {seen} | "
                   f"{_fmt(f.get('lost', '?'))} / {_fmt(f.get('hung', '?'))} / {_fmt(f.get('leaked', '?'))} |")
    return out + [""]


# ---- processes, through /proc (Linux) ----


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "?")
    return state not in ("Z", "X")


def rss_kib(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def stack_pids(launch_pid: int) -> dict[str, int]:
    """{launch-stack, worker, gateway, cache}: pids of a launch-stack and its children now."""
    out = {"launch-stack": launch_pid}
    for pid in children(launch_pid):
        argv = cmdline(pid)
        if "-m" in argv and argv.index("-m") + 1 < len(argv):
            name = argv[argv.index("-m") + 1]
            out[{"cache_service": "cache"}.get(name, name)] = pid
    return out


def launch_stack_has(flag: str) -> bool:
    """Whether launch-stack takes this flag (the cache service's flags arrive with it)."""
    from cli.launch import parse_args

    try:
        parse_args([flag, "1K"] if flag == "--cache-bytes" else [flag, "x"])
    except SystemExit:
        return False
    return True


def runtime_dir_of(pid: int) -> Optional[str]:
    """The --runtime-dir a worker or gateway was started with."""
    argv = cmdline(pid)
    return argv[argv.index("--runtime-dir") + 1] if "--runtime-dir" in argv else None
