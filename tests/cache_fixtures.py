"""A real cache service process for engine-level tests, and engines that reuse through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import zmq

from protocol import codec, messages as m, runtime
from worker.engine import Engine, EngineConfig, cache_identity
from worker.loader import LoadedModel
from worker.state.reuse import PrefixCache

READY_TIMEOUT_S = 30


class CacheServiceProcess:
    """`python -m cache_service` in a private runtime dir; its READY is awaited as launch-stack does."""

    def __init__(self, budget: int):
        self.budget = budget
        self.runtime_dir = tempfile.mkdtemp(prefix="verity-test-")
        os.chmod(self.runtime_dir, 0o700)
        self.endpoint = runtime.endpoint(self.runtime_dir, runtime.CACHE)
        self.ctx = zmq.Context()
        self.supervisor = self.ctx.socket(zmq.PULL)
        self.supervisor.bind(runtime.endpoint(self.runtime_dir, runtime.SUPERVISOR))
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "CacheServiceProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "cache_service", "--runtime-dir", self.runtime_dir,
                                      "--cache-bytes", str(self.budget)])
        if not self.supervisor.poll(READY_TIMEOUT_S * 1000):
            raise TimeoutError("the cache service sent no READY")
        ready = codec.supervisor_decoder().decode(self.supervisor.recv())
        assert ready.process == "cache" and ready.pid == self.proc.pid
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.ctx.destroy(linger=0)


def reuse_engine(lm: LoadedModel, service: CacheServiceProcess, draft: Optional[LoadedModel] = None,
                 spill_dir: Optional[Path] = None, chat_template: Optional[str] = None, **config) -> Engine:
    """An engine reusing prefixes through `service` (as worker/proc.py builds it); `chat_template`
    overrides the identity's template (what a changed template does to the identity)."""
    draft_id = f"{draft.model_id}@{draft.revision}" if draft else None
    ident_lm = lm if chat_template is None else LoadedModel(**{**lm.__dict__, "chat_template": chat_template})
    config = EngineConfig(**config)
    reuse = PrefixCache.connect(service.endpoint, cache_identity(ident_lm, draft_id, config.kv), lm,
                                draft.model if draft else None, str(spill_dir) if spill_dir else None)
    return Engine(lm, config, draft, reuse=reuse)


def chat(messages: list[tuple[str, str]], n: int = 10, **kw) -> m.GenerateRequest:
    kw.setdefault("temperature", 0.0)
    return m.GenerateRequest(messages=[m.Message(r, c) for r, c in messages], max_tokens=n, ignore_eos=True, **kw)


def run_one(engine: Engine, req: m.GenerateRequest, rid: str = "r") -> tuple[list[int], m.RequestMetrics]:
    engine.submit(rid, req)
    tokens, finished = [], None
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, m.TextDelta):
                tokens += ev.token_ids
            elif isinstance(ev, (m.Finished, m.Error)):
                finished = ev
    assert isinstance(finished, m.Finished), finished
    return tokens, finished.metrics
