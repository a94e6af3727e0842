"""The routes people look at: the web UI at /, GET /metrics, and the verity extensions
GET /v1/verity/info (what the UI needs) and GET /v1/verity/stats (what `verity monitor` shows).

/v1/ routes need the API key when one is set; /, /static/ and /metrics do not.
"""

from __future__ import annotations

import os
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

import msgspec
from aiohttp import web

from gateway.link import WorkerLink
from gateway.metrics import Counters, Exposition, render


STATIC_DIR = Path(__file__).parent / "static"
# the generation routes, each its request kind (/metrics and `verity monitor` count them by kind)
GENERATE_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/messages": "messages",
                  "/v1/responses": "responses"}
# Everything the page uses comes from this server: no CDN, no fonts, no analytics.
UI_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
              "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def _version() -> str:
    try:
        return metadata.version("verity-serve")
    except metadata.PackageNotFoundError:
        return "dev"


class Surfaces:
    """The web UI, /metrics, /v1/verity/info and /v1/verity/stats, from what they read."""

    def __init__(self, link: WorkerLink, max_tokens_cap: int, started_at: float, draining: Callable[[], bool]):
        self.link, self.max_tokens_cap, self.started_at, self.draining = link, max_tokens_cap, started_at, draining
        self.counters = Counters()
        self.aliases: tuple[str, ...] = ()  # --served-model-name
        link.on_end.append(self.counters.observe)

    def register(self, app: web.Application) -> None:
        app.on_response_prepare.append(self._count_response)
        app.router.add_get("/", self.index)
        app.router.add_static("/static/", STATIC_DIR, append_version=False)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/verity/info", self.info)
        app.router.add_get("/v1/verity/stats", self.stats)

    async def _count_response(self, request: web.Request, response: web.StreamResponse) -> None:
        if request.method == "POST" and request.path in GENERATE_KINDS:
            self.counters.http[str(response.status)] += 1
            self.counters.kinds[GENERATE_KINDS[request.path]] += 1
        if request.path == "/" or request.path.startswith("/static/"):
            response.headers.update(UI_HEADERS)

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    def _worker(self) -> dict | None:
        w = self.link.worker
        return None if w is None else {"pid": w.pid, "model": w.model_id, "draft_id": w.draft_id,
                                       "joint_available": w.joint_available, "context_limit": w.context_limit,
                                       "thinks": w.thinks, "max_thinking_tokens": w.max_thinking_tokens,
                                       "kv_format": w.kv_format}

    async def info(self, request: web.Request) -> web.Response:
        w = self._worker() or {}
        return web.json_response({
            "ready": bool(w), "model": w.get("model"), "joint_available": w.get("joint_available", False),
            "draft_id": w.get("draft_id"), "context_limit": w.get("context_limit"),
            "max_tokens_cap": self.max_tokens_cap, "version": _version(),
            "max_active": self.link.max_active, "capacity": self.link.capacity,
            "served_model_names": [w["model"], *self.aliases] if w else [],
            "defaults": msgspec.to_builtins(self.link.worker.defaults) if w else None,
            "thinks": w.get("thinks", False), "max_thinking_tokens": w.get("max_thinking_tokens"),
            "model_state": self.model_state(), "kv_format": w.get("kv_format"),
        })

    def model_state(self) -> Optional[str]:
        """The worker's weights: "loaded", "unloaded" (--idle-unload-s) or "loading"; None without a worker."""
        snap = self.link.worker_stats
        if self.link.worker is None:
            return None
        return snap.model_state if snap is not None and snap.pid == self.link.worker.pid else "loaded"

    def _load(self) -> tuple[int, int]:
        """(running, waiting) among the admitted requests."""
        waiting = self.link.waiting_count()
        return len(self.link.requests) - waiting, waiting

    async def stats(self, request: web.Request) -> web.Response:
        link = self.link
        running, waiting = self._load()
        snap = link.worker_stats
        return web.json_response({
            "time": time.time(),
            "launcher": {"pid": os.getppid()},
            "gateway": {"pid": os.getpid(), "started_at": self.started_at, "draining": self.draining(),
                        "admitted": running + waiting, "running": running, "waiting": waiting,
                        "capacity": link.capacity, "worker_restarts": link.worker_restarts},
            "worker": self._worker(),
            "worker_stats": None if snap is None else msgspec.to_builtins(snap),
            "totals": self.counters.totals(),
            "recent": self.counters.recent_summary(),
        })

    async def metrics(self, request: web.Request) -> web.Response:
        link = self.link
        running, waiting = self._load()
        text = render(self.counters, model=link.worker.model_id if link.worker else None,
                      draft=link.worker.draft_id if link.worker else None, worker_up=link.ready,
                      running=running, waiting=waiting, worker_restarts=link.worker_restarts,
                      stats=link.worker_stats)
        return web.Response(body=text.encode(), headers={"Content-Type": Exposition.CONTENT_TYPE})
