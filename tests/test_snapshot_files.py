"""Spilled snapshot files under attack on real stacks: a tampered header, hostile and read-only
cache directories, a full disk, and two stacks on one directory (issue 45)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from cli.stack_process import StackError
from reliability import stack_pids
from stack import Stack, until, wait_until
from test_stack import post

ROOT = os.geteuid() == 0
Q = "the robot read many books and"
P = "hello world, how are you today"


def completion(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0}


def spilled(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.suffix == ".safetensors"}


def rewrite_tokens(path: Path, tokens: list[int]) -> None:
    """Replaces the token ids in a spill file's header, its arrays and checksum left as they are."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    verity = json.loads(header["__metadata__"]["verity"])
    verity["meta"]["tokens"] = tokens
    header["__metadata__"]["verity"] = json.dumps(verity)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def header_tokens(path: Path) -> list[int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["verity"])["meta"]["tokens"]


async def test_tampered_header_is_dropped_and_two_stacks_cannot_share_a_dir(tiny_llama, tmp_path, reliability):
    d = tmp_path / "spill"
    with Stack(str(tiny_llama), "--cache-dir", str(d)) as a:
        _, q_plain, _ = await post(a.url, completion(Q), headers={}, path="/v1/completions")  # an empty cache
        await until(lambda: len(spilled(d)) == 1, 10, "Q's spill file")
        q_file = spilled(d).pop()
        await post(a.url, completion(P), headers={}, path="/v1/completions")
        await until(lambda: len(spilled(d)) == 2, 10, "P's spill file")
        p_file = (spilled(d) - {q_file}).pop()
        with pytest.raises(StackError) as second:
            Stack(str(tiny_llama), "--cache-dir", str(d)).start()
    assert f"is in use by launch-stack pid {a.proc.pid}" in str(second.value)
    q_tokens = header_tokens(d / q_file)[: q_plain["usage"]["prompt_tokens"]]
    p_tokens = header_tokens(d / p_file)
    assert len(p_tokens) > len(q_tokens)
    (d / q_file).unlink()
    rewrite_tokens(d / p_file, q_tokens + p_tokens[len(q_tokens):])  # P's state now claims Q's prompt
    with Stack(str(tiny_llama), "--cache-dir", str(d)) as b:
        _, q_after, _ = await post(b.url, completion(Q), headers={}, path="/v1/completions")
        log = b.log()
    assert q_after["choices"][0]["text"] == q_plain["choices"][0]["text"]
    assert q_after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert f"dropped spilled snapshot {p_file.removesuffix('.safetensors')}" in log and "checksum" in log
    reliability.record(
        "faults", "Spilled snapshot with a tampered header; a second stack on the same --cache-dir",
        "A snapshot file whose header is edited so its state claims another prompt's tokens (arrays and checksum "
        "untouched), then that prompt asked of a new stack on the directory. One sha256 covers the header and "
        "the arrays; it is checked before a snapshot is used. A second launch-stack given a --cache-dir in use "
        "(flock on .verity.lock) refuses to start.",
        expected="dropped with a warning; the answer equals the cache-off answer; the second stack exits 1",
        answer_equals_cache_off=True, cached_tokens=0, second_stack="exit 1 naming the first's pid",
        lost=0, hung=0, leaked="none")


@contextmanager
def read_only(d: Path):
    """The directory read-only: a read-only bind mount as root (root writes through modes), else 0500."""
    if ROOT:
        subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(d)], check=True)
    else:
        d.chmod(0o500)
    try:
        yield
    finally:
        if ROOT:
            subprocess.run(["umount", str(d)], check=True)
        else:
            d.chmod(0o700)


async def test_hostile_and_read_only_cache_dirs_start_and_serve(tiny_llama, tmp_path, reliability):
    d = tmp_path / "hostile"
    d.mkdir(mode=0o700)
    (d / "a-directory.safetensors").mkdir()
    os.mkfifo(d / "a-fifo.safetensors")
    (d / "a-link.safetensors").symlink_to("/dev/zero")
    (d / ".stale.safetensors.tmp").write_bytes(b"partial")
    with read_only(d):
        t0 = time.monotonic()
        with Stack(str(tiny_llama), "--cache-dir", str(d)) as s:
            start_s = time.monotonic() - t0
            status, body, _ = await post(s.url, completion(P), headers={}, path="/v1/completions")
            await until(lambda: "could not spill" in s.log(), 10, "the failed spill's warning")
            log = s.log()
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    for name in ("a-directory", "a-fifo", "a-link"):
        assert f"skipped {name}.safetensors in the cache dir" in log
    assert "could not remove .stale.safetensors.tmp" in log
    assert s.exit_code == 0
    reliability.record(
        "faults", "Hostile and read-only --cache-dir",
        "A directory, a FIFO and a symbolic link named *.safetensors and a stale .tmp, in a read-only directory "
        "(a read-only bind mount as root). Files are opened without following links and without blocking, and "
        "only regular files are read; what cannot be removed or written is left with a warning.",
        expected="starts and serves; each entry skipped with a warning",
        start_s=round(start_s, 2), served=status, skipped="directory, FIFO, link", lost=0, hung=0, leaked="none")


@contextmanager
def small_disk(d: Path):
    """A 16 KiB tmpfs as root; else the files the worker may write are capped (RLIMIT_FSIZE)."""
    d.mkdir(mode=0o700)
    if ROOT:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(d)], check=True)
    try:
        yield ROOT
    finally:
        if ROOT:
            subprocess.run(["umount", str(d)], check=True)


async def test_full_disk_leaves_no_partial_file(tiny_llama, tmp_path, reliability):
    d = tmp_path / "full"
    with small_disk(d) as tmpfs:
        with Stack(str(tiny_llama), "--cache-dir", str(d)) as s:
            if not tmpfs:
                import resource

                resource.prlimit(stack_pids(s.proc.pid)["worker"], resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
            statuses = []
            for i in range(6):
                status, _, _ = await post(s.url, completion(f"{P} {i} " * (4 + 4 * i)), headers={}, path="/v1/completions")
                statuses.append(status)
            await until(lambda: "could not spill" in s.log(), 20, "a failed spill")
            wait_until(lambda: not [p for p in d.iterdir() if p.name.endswith(".tmp")], 10, "no partial file left")
            status, _, _ = await post(s.url, completion(Q), headers={}, path="/v1/completions")
            statuses.append(status)
            failed = s.log().count("could not spill")
            kept = len(spilled(d))
    assert statuses == [200] * 7
    reliability.record(
        "faults", "Full disk under --cache-dir",
        "Seven requests whose snapshots do not fit a 16 KiB filesystem (tmpfs as root; else RLIMIT_FSIZE). A write "
        "that fails removes its partial file.",
        expected="every request served; no partial file left", served=f"{statuses.count(200)} of 7",
        spills_failed=failed, files_kept=kept, partial_files_left=0, lost=0, hung=0, leaked="none")
