"""launch-stack's own checks: where the API key comes from (never a child's command line), a stop
that restarts nothing, the open-file limit, and the draft pairing rule (issue 45)."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys

import aiohttp
import pytest

from reliability import cmdline, stack_pids
from stack import Stack
from worker.loader import PairingError, check_tokenizers_agree

KEY = "file-key-7f3a"
PR_CAPBSET_DROP, CAP_SYS_RESOURCE = 24, 24


def launch(args: list[str], preexec=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.launch", *args], capture_output=True, text=True, timeout=60,
                          preexec_fn=preexec, env={**os.environ, **(env or {})})


async def test_key_file_serves_and_no_child_sees_the_key_on_its_command_line(tiny_llama, tmp_path, reliability):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    loose = launch(["--model", str(tiny_llama), "--api-key-file", str(key_file)])
    assert loose.returncode == 1 and "only its owner can read" in loose.stderr and "chmod 600" in loose.stderr
    key_file.chmod(0o600)
    with Stack(str(tiny_llama), "--api-key-file", str(key_file), env={"VERITY_API_KEY": ""}) as s:
        pids = stack_pids(s.proc.pid)
        cmdlines = [" ".join(cmdline(p)) for p in pids.values()]
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url + "/v1/models") as r:
                without = r.status
            async with http.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as r:
                with_key = r.status
        for pid in pids.values():  # Ctrl-C reaches launch-stack and its children at once
            os.kill(pid, signal.SIGINT)
        code = s.wait_exit(60)
    assert (without, with_key) == (401, 200)
    assert len(cmdlines) >= 3 and not any(KEY in c for c in cmdlines), cmdlines
    assert code == 0 and "restarting" not in s.log(), s.log()[-2000:]  # a stop restarts nothing
    reliability.record(
        "security", "The API key off every command line",
        "The key from --api-key-file (refused unless only its owner can read it) or VERITY_API_KEY; launch-stack "
        "hands it to the gateway in its environment. --api-key on the command line still works and warns.",
        expected="0644 file refused; no process's command line holds the key",
        loose_file="exit 1, `chmod 600` named", processes_checked=len(cmdlines), key_on_a_command_line=0,
        lost=0, hung=0, leaked="none (the key in no command line)")


def _low_hard_limit() -> None:
    """In the child: a hard open-file limit of 1,024 that it cannot raise (root loses CAP_SYS_RESOURCE)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0) == 0
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_low_hard_open_file_limit_is_a_clear_start_error(tiny_llama):
    r = launch(["--model", str(tiny_llama), "--api-key", "on-the-command-line"], preexec=_low_hard_limit)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "the hard open-file limit is 1024; the worker needs at least 4096" in r.stderr
    assert "--api-key on the command line is readable by every local user" in r.stderr
    assert "Traceback" not in r.stderr


class _Renamed:
    """A tokenizer whose class marks other ids special (as transformers does by model type)."""

    def __init__(self, inner, special: list[int], eos: list[int]):
        self.inner, self.all_special_ids, self.eos_token_ids = inner, special, eos

    def get_vocab(self) -> dict:
        return self.inner.get_vocab()


def test_pairing_compares_the_vocabulary_and_eos_only(tiny_llama_lm):
    tok = tiny_llama_lm.tokenizer
    eos = sorted(tok.eos_token_ids)
    check_tokenizers_agree(_Renamed(tok, [1, 2], eos), _Renamed(tok, [0, 1, 2], eos))  # special ids differ: fine
    with pytest.raises(PairingError, match="end-of-sequence tokens differ"):
        check_tokenizers_agree(_Renamed(tok, [1, 2], eos), _Renamed(tok, [1, 2], eos + [1]))
