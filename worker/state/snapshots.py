"""Snapshots of model state at a token prefix: capture, restore into a private copy, spill to files.

A snapshot holds, per layer, the valid range of the attention KV (copied out of mlx-lm's
preallocated buffer) or the recurrent arrays (conv window and Gated-DeltaNet state, copied too:
the conv window can be a view that pins a whole prefill's input). A restore hands the cache a
fresh copy of the KV range (KVCache writes into its buffer in place) and the recurrent arrays by
reference (ArraysCache replaces them on update, never writes into them; tests/test_reuse.py
checks that a snapshot is bitwise unchanged after a restored branch moves on).

Spill files (`--cache-dir`) are safetensors, 0600 in a 0700 directory (they hold conversation
state), with the metadata and one sha256 over that metadata and the arrays in the header. A file
that is missing, unreadable, not a regular file or fails its checksum is skipped with a warning,
never used; a write that fails (a full disk) leaves no partial file behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from protocol import messages as m
from worker.kvformat import KVFormat

log = logging.getLogger("verity.worker")
FORMAT = "verity-snapshot-2"  # 2: the checksum covers the header too
SUFFIX = ".safetensors"

# per layer: ("kv", (keys, values)) with the valid range only; quantized KV as its format's name
# (worker/kvformat.py, "q4g64") with (packed, scales, biases) of the keys, then of the values; or
# ("arrays", (conv, state)), None where a recurrent slot was never written
State = list[tuple[str, tuple]]


def capture(cache: list) -> State:
    out: State = []
    for c in cache:
        if isinstance(c, KVCache):
            arrays = () if c.keys is None else (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
            out.append(("kv", tuple(mx.array(a) for a in arrays)))
        elif isinstance(c, QuantizedKVCache):
            arrays = () if c.keys is None else tuple(a[..., : c.offset, :] for a in (*c.keys, *c.values))
            out.append((KVFormat(c.bits, c.group_size).name, tuple(mx.array(a) for a in arrays)))
        else:
            out.append(("arrays", tuple(None if a is None else mx.array(a) for a in c.cache)))
    mx.eval(arrays_of(out))
    return out


def restore(state: State, length: int) -> list:
    """A new cache holding the state's first `length` tokens (only KV can be cut back)."""
    cache, copies = [], []
    for kind, arrays in state:
        if kind != "arrays":
            c = KVFormat.parse("native" if kind == "kv" else kind).empty_cache()
            if arrays:
                parts = [mx.array(a[..., :length, :]) for a in arrays]
                half = len(parts) // 2
                c.keys, c.values = (parts[0], parts[1]) if kind == "kv" else (tuple(parts[:half]), tuple(parts[half:]))
                c.offset = length
                copies += parts
        else:
            c = ArraysCache(len(arrays))
            c.cache = list(arrays)
        cache.append(c)
    mx.eval(copies)
    return cache


def arrays_of(state) -> list[mx.array]:
    return [a for _, arrays in state for a in arrays if a is not None]


def trimmable(cache: list) -> bool:
    return all(isinstance(c, (KVCache, QuantizedKVCache)) for c in cache)


@dataclass
class Snapshot:
    meta: m.SnapshotMeta
    target: Optional[State] = None  # None while it is only in its spill file
    draft: Optional[State] = None

    @property
    def draft_tokens(self) -> int:
        """The draft state holds meta.tokens[:draft_tokens] (0: no draft state)."""
        return self.meta.draft_tokens

    @property
    def loaded(self) -> bool:
        return self.target is not None


class SnapshotStore:
    """The snapshots this worker holds, by id; with `spill_dir`, each one in a file too, written by
    a thread of its own so that no request waits on the disk (the arrays are immutable)."""

    def __init__(self, spill_dir: Optional[str] = None):
        self.snapshots: dict[str, Snapshot] = {}  # changed by the MLX thread only
        self.high_water = 0  # the most bytes ever held at once (tests check it against the budget)
        self.dir = Path(spill_dir) if spill_dir else None
        self._files = threading.Lock()  # a file appears only while its snapshot is held
        self._writes: queue.Queue = queue.Queue()
        if self.dir is not None:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.dir.stat().st_mode & 0o077:
                log.warning("cache dir %s was readable by others; making it 0700", self.dir)
                try:
                    self.dir.chmod(0o700)
                except OSError as e:
                    log.warning("could not make %s 0700: %s", self.dir, e.strerror)
            self._scan()
            threading.Thread(target=self._write_loop, name="spill", daemon=True).start()

    @property
    def nbytes(self) -> int:
        return sum(s.meta.nbytes for s in self.snapshots.values())

    def metas(self) -> list[m.SnapshotMeta]:
        return [s.meta for s in self.snapshots.values()]

    def add(self, snap: Snapshot) -> None:
        self.snapshots[snap.meta.id] = snap
        self.high_water = max(self.high_water, self.nbytes)
        if self.dir is not None:
            self._writes.put(snap)

    def drop(self, ids) -> None:
        with self._files:
            for i in ids:
                if self.snapshots.pop(i, None) is not None and self.dir is not None:
                    _unlink_quietly(self._path(i))

    def flush(self) -> None:
        """Waits until every snapshot added so far is in its file."""
        self._writes.join()

    def close(self) -> None:
        if self.dir is not None:
            self.flush()

    def release_memory(self) -> list[str]:
        """Idle unload: spilled snapshots keep only their files (read again on use); the ids of
        those that had none, dropped here, are returned for the cache service."""
        if self.dir is not None:
            self.flush()
        with self._files:
            gone = [i for i in self.snapshots if self.dir is None or not self._path(i).exists()]
            for i in gone:
                del self.snapshots[i]
            for snap in self.snapshots.values():
                snap.target = snap.draft = None
        return gone

    def get(self, entry_id: str) -> Optional[Snapshot]:
        """The snapshot with its arrays (loaded from its file if need be); None if it is gone."""
        snap = self.snapshots.get(entry_id)
        if snap is None or snap.loaded:
            return snap
        try:
            self._load(snap)
        except Exception as e:  # a missing, truncated or tampered file is never trusted
            log.warning("dropped spilled snapshot %s: %s", entry_id, e)
            self.drop([entry_id])
            return None
        return snap

    # ---- files ----

    def _path(self, entry_id: str) -> Path:
        return self.dir / f"{entry_id}{SUFFIX}"

    def _write_loop(self) -> None:
        while True:
            snap = self._writes.get()
            try:
                self._spill(snap)
            except Exception as e:
                log.warning("could not spill snapshot %s: %s", snap.meta.id, e)
            finally:
                self._writes.task_done()

    def _spill(self, snap: Snapshot) -> None:
        arrays, layout = {}, {}
        for part, state in (("target", snap.target), ("draft", snap.draft)):
            if state is None:
                continue
            layout[part] = [[kind, [a is not None for a in slots]] for kind, slots in state]
            for i, (_, slots) in enumerate(state):
                arrays.update({f"{part}.{i}.{j}": a for j, a in enumerate(slots) if a is not None})
        header = {"meta": msgspec.to_builtins(snap.meta), "draft_tokens": snap.draft_tokens, "layout": layout}
        header["sha256"] = _checksum(header, arrays)
        final = self._path(snap.meta.id)
        tmp = final.with_name(f".{final.name}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                mx.save_safetensors(f, arrays, metadata={"format": FORMAT, "verity": json.dumps(header)})
        except BaseException:  # a full disk: the partial file goes, or it keeps the disk full
            _unlink_quietly(tmp)
            raise
        with self._files:
            if self.snapshots.get(snap.meta.id) is snap:
                os.replace(tmp, final)
            else:  # evicted while it was being written
                tmp.unlink()

    def _load(self, snap: Snapshot) -> None:
        path = self._path(snap.meta.id)
        os.close(_open_regular(path))
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
        header = json.loads(metadata["verity"])
        if metadata.get("format") != FORMAT or _checksum(header, arrays) != header.get("sha256"):
            raise ValueError("its checksum (over header and arrays) does not match")
        if header["meta"]["tokens"] != list(snap.meta.tokens) or header["draft_tokens"] != snap.draft_tokens:
            raise ValueError("it changed since it was registered")
        for part, layout in header["layout"].items():
            state = [(kind, tuple(arrays[f"{part}.{i}.{j}"] if present else None for j, present in enumerate(slots)))
                     for i, (kind, slots) in enumerate(layout)]
            setattr(snap, part, state)

    def _scan(self) -> None:
        """Registers the snapshots a previous worker spilled (their headers only; arrays on use)."""
        for path in sorted(self.dir.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):  # a write that never finished
                _unlink_quietly(path)
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                header = json.loads(_read_header(path)["verity"])
                meta = msgspec.convert(header["meta"], m.SnapshotMeta)
                if path.name != f"{meta.id}{SUFFIX}":
                    raise ValueError("its name does not match its id")
                meta.draft_tokens = header["draft_tokens"]  # files written before the meta carried it
                self.snapshots[meta.id] = Snapshot(meta)
            except NotRegular as e:  # never removed: it is not ours
                log.warning("skipped %s in the cache dir: %s", path.name, e)
            except Exception as e:
                log.warning("dropped spill file %s: %s", path.name, e)
                _unlink_quietly(path)
        self.high_water = self.nbytes
        if self.snapshots:
            log.info("found %d spilled snapshots (%d bytes) in %s", len(self.snapshots), self.nbytes, self.dir)


class NotRegular(ValueError):
    """A directory, FIFO, device or link where a snapshot file should be."""


def _checksum(header: dict, arrays: dict[str, mx.array]) -> str:
    """One sha256 over the header (all but its checksum) and the arrays."""
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode() + b"\n")
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{a.shape}\n".encode())
        h.update(memoryview(a))
    return h.hexdigest()


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:  # a read-only directory: left as it is
        log.warning("could not remove %s: %s", path.name, e.strerror)


def _open_regular(path: Path) -> int:
    """An fd of a regular file; opening never blocks (a FIFO) nor follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            raise NotRegular("not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular("not a regular file")
    return fd


def _read_header(path: Path) -> dict:
    """A safetensors file's `__metadata__`, without reading its arrays."""
    with open(_open_regular(path), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 64 << 20:
            raise ValueError("implausible header length")
        header = json.loads(f.read(n))["__metadata__"]
    if header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format')!r}, not {FORMAT}")
    return header
