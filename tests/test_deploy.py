"""deploy/: the example configuration is one launch-stack accepts, and the service files run it
with that configuration and restart it on the exit codes that mean failure."""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
from pathlib import Path

import pytest

from cli.launch import parse_args
from stack import LAUNCH_STACK

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_example_config_is_accepted_as_is():
    a = parse_args(["--config", str(DEPLOY / "verity.toml")])
    assert (a.model, a.host, a.port, a.max_active, a.recovery) == ("embedded", "127.0.0.1", 8000, None, "fast")


def test_systemd_unit_restarts_on_failure_only():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "verity.service")
    service = unit["Service"]
    assert service["ExecStart"].split()[1:] == ["--config", "/etc/verity/verity.toml"]
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 30 + 10  # drain timeout + the worker's stop
    assert int(service["LimitNOFILE"]) >= 4096 + 1024  # mlx-lm's hard limit; the default connection cap
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    local = (DEPLOY / "verity.service").read_text().replace("/opt/verity/.venv/bin/launch-stack", LAUNCH_STACK)
    local = local.replace("User=verity", "User=root").replace("Group=verity", "Group=root")
    (tmp_path / "verity.service").write_text(local)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "verity.service")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr


def test_launchd_plist_restarts_on_nonzero_exit():
    with open(DEPLOY / "dev.verity.launch-stack.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "dev.verity.launch-stack"
    assert plist["ProgramArguments"][0].endswith("/.venv/bin/launch-stack")
    assert plist["ProgramArguments"][1] == "--config" and plist["ProgramArguments"][2].endswith("verity.toml")
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    assert plist["ExitTimeOut"] > 30
    for limits in ("SoftResourceLimits", "HardResourceLimits"):  # mlx-lm's 4,096; the default connection cap
        assert plist[limits]["NumberOfFiles"] >= 4096 + 1024
