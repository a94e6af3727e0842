"""`verity monitor`: a live dashboard of a running stack, read from GET /v1/verity/stats.

The gateway relays what the processes publish (the worker's StatsSnapshot) with its own
counters, so the URL is all the monitor needs. It never gives up: while the gateway does not
answer it says since when, and it picks up again when a (restarted) stack answers.
In a terminal it redraws in place; piped, it prints one frame per interval (like `top -b`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.client import DEFAULT_URL, ServerError

STATS_PATH = "/v1/verity/stats"
OFF, NONE = "off", "–"


def fetch_stats(url: str, api_key: Optional[str], timeout: float = 2.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + STATS_PATH,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            raise ServerError.from_body(json.loads(e.read()), e.code) from None
        except ValueError:
            raise ServerError(f"HTTP {e.code}", status=e.code) from None
    except (OSError, ValueError) as e:
        raise ServerError(f"unreachable ({getattr(e, 'reason', e)})") from None


@dataclass
class Monitor:
    """What the dashboard knows: the last answer, the connection state and a short event log."""

    url: str
    stats: Optional[dict] = None
    error: Optional[str] = None
    down_since: Optional[float] = None
    events: deque = field(default_factory=lambda: deque(maxlen=6))

    def update(self, stats: Optional[dict], error: Optional[str] = None) -> None:
        now = time.time()
        if stats is None:
            if self.error is None:
                self._event("disconnected: " + error)
                self.down_since = now
            self.error = error
            return
        old, self.stats, self.error, self.down_since = self.stats, stats, None, None
        gw, w = stats["gateway"], stats["worker"]
        if old is None:
            self._event(f"connected: gateway pid {gw['pid']}")
        elif old["gateway"]["pid"] != gw["pid"]:
            self._event(f"reconnected: the stack restarted (gateway pid {old['gateway']['pid']} → {gw['pid']})")
        elif self.events and self.events[-1][1].startswith("disconnected"):
            self._event(f"reconnected: gateway pid {gw['pid']}")
        ow = old["worker"] if old and old["gateway"]["pid"] == gw["pid"] else None
        if ow and not w:
            self._event(f"worker {ow['pid']} is down")
        elif w and (not ow or ow["pid"] != w["pid"]) and old is not None:
            self._event(f"worker {w['pid']} ready")

    def _event(self, text: str) -> None:
        self.events.append((time.time(), text))


# ---- formatting ----


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _ratio(num: float, den: float, fmt: str = "{:.0%}") -> str:
    return fmt.format(num / den) if den else NONE


def _ms(s: Optional[float]) -> str:
    return NONE if s is None else f"{s * 1000:.0f} ms"


def _by_class(counts: dict) -> dict[int, int]:
    """HTTP statuses -> counts by class (4: client errors, 5: server errors)."""
    out = {4: 0, 5: 0}
    for status, n in counts.items():
        if str(status)[:1] in ("4", "5"):
            out[int(str(status)[0])] += n
    return out


def _kinds(kinds: dict) -> tuple[str, str]:
    """Generation requests by kind (the API they came by): the kinds as the label, counts as the value."""
    names = sorted(kinds) or ["chat"]
    return " · ".join(names), " · ".join(str(kinds.get(k, 0)) for k in names)


def _kv(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_header=False,
              pad_edge=False, expand=True)
    t.add_column(style="dim", ratio=3)  # labels wrap rather than crowd out the values
    t.add_column(justify="right", no_wrap=True, min_width=7)
    for k, v in rows:
        t.add_row(k, v)
    return t


def render(mon: Monitor, now: Optional[float] = None) -> Group:
    now = time.time() if now is None else now
    s = mon.stats
    head = Text.assemble(("verity monitor", "bold"), f"  {mon.url}  ")
    if mon.error is not None:
        head.append(f"DISCONNECTED for {_age(now - mon.down_since)}: {mon.error}; retrying", style="bold red")
    elif s and s["worker"]:
        w = s["worker"]
        head.append(w["model"] + (f" + draft {w['draft_id']}" if w["draft_id"] else ""), style="cyan")
    parts: list = [head]
    if s is not None:
        parts += [_processes(s, now, mon.error is not None), _figures(s)]
    parts.append(Text("\n".join(f"{time.strftime('%H:%M:%S', time.localtime(t))}  {e}" for t, e in mon.events),
                      style="dim"))
    return Group(*parts)


def _processes(s: dict, now: float, stale: bool) -> Table:
    gw, w, ws = s["gateway"], s["worker"], s["worker_stats"]
    t = Table(box=box.SIMPLE_HEAD, title="processes" + (" (last seen)" if stale else ""),
              title_justify="left", title_style="bold")
    for col in ("process", "pid", "status", "detail"):
        t.add_column(col, no_wrap=True)
    up = lambda ok, text: Text(text, style="green" if ok else "red")  # noqa: E731
    t.add_row("launch-stack", str(s["launcher"]["pid"]), up(not stale, "up" if not stale else "?"), "supervises the others")
    t.add_row("gateway", str(gw["pid"]), up(not stale and not gw["draining"], "draining" if gw["draining"] else "up"),
              f"uptime {_age(s['time'] - gw['started_at'])}, capacity {gw['capacity']}")
    wdetail = f"restarts {gw['worker_restarts']}" + (f", stats {now - ws['time']:.1f}s old" if ws else "")
    t.add_row("worker", str(w["pid"]) if w else NONE, up(bool(w), "ready" if w else "down"), wdetail)
    for r in (ws or {}).get("ranks", []):  # a distributed worker: its group moves as one
        t.add_row(f"  rank {r['rank']}", str(r["pid"]), up(bool(w), "up" if w else "down"), f"on {r['host']}")
    cache_on = bool(ws and ws.get("cache_bytes") is not None)
    t.add_row("cache", NONE, Text("up" if cache_on else OFF, style="green" if cache_on else "dim"),
              "" if cache_on else "no cache service: no prefix reuse")
    return t


def _figures(s: dict) -> Table:
    gw, ws, tot, rec = s["gateway"], s["worker_stats"] or {}, s["totals"], s["recent"]
    finished = tot["finished"]
    answered, ended = _by_class(tot["responses"]), _by_class(tot.get("error_statuses", {}))
    load = _kv("load", [
        ("running", str(gw["running"])), ("waiting", str(gw["waiting"])),
        ("worker queue depth", str(ws.get("queue_depth", 0))), ("worker active", str(ws.get("active", 0))),
        ("tokens/s", f"{ws.get('tokens_per_s', 0.0):.1f}"),
    ])
    requests = _kv("requests", [
        ("finished", str(sum(finished.values()))),
        _kinds(tot.get("kinds", {})),
        ("stop · length · cancelled", f"{finished.get('stop', 0)} · {finished.get('length', 0)} · {finished.get('cancelled', 0)}"),
        ("answered 4xx · 5xx", f"{answered[4]} · {answered[5]}"),  # client errors apart from server errors
        ("admitted, then 4xx · 5xx", f"{ended[4]} · {ended[5]}"),
        ("prompt · generated tokens", f"{tot['prompt_tokens']} · {tot['generation_tokens']}"),
        ("TTFT p50 · p95", f"{_ms(rec['ttft_p50_s'])} · {_ms(rec['ttft_p95_s'])}"),
    ])
    drafted, cycles, rollbacks = ws.get("drafted_total", 0), ws.get("cycles_total", 0), ws.get("rollbacks_total", 0)
    recent_acc = NONE if rec["acceptance"] is None else f"{rec['acceptance']:.0%}"
    recent_budget = NONE if rec["budget_per_cycle"] is None else f"{rec['budget_per_cycle']:.2f}"
    spec = _kv("joint decoding", [
        ("acceptance", f"{ws.get('accepted_total', 0)}/{drafted} = {_ratio(ws.get('accepted_total', 0), drafted)}"),
        ("budget per cycle", _ratio(drafted, cycles, "{:.2f}")),
        ("recent acceptance · budget", f"{recent_acc} · {recent_budget}"),
        ("rollbacks", str(rollbacks)),
        ("recovery total · per rollback", f"{ws.get('recovery_s_total', 0.0):.3f} s · "
                                          f"{_ratio(ws.get('recovery_s_total', 0.0) * 1000, rollbacks, '{:.2f} ms')}"),
    ])
    cb = ws.get("cache_bytes")
    budget = ws.get("cache_budget_bytes")
    cache = _kv("cache", [("bytes", OFF if cb is None else _bytes(cb) + (f" of {_bytes(budget)}" if budget else "")),
                          ("hit rate", OFF if cb is None else _ratio(ws.get("cache_hits", 0), ws.get("cache_lookups", 0))),
                          ("reused prompt tokens", str(tot["cached_tokens"]))])
    grid = Table.grid(padding=(0, 2), expand=True)  # halves of the width: labels wrap, values never cut
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(load, requests)
    grid.add_row(spec, cache)
    return grid


# ---- the loop ----


def run_monitor(args: argparse.Namespace) -> int:
    # Ctrl-C stops the dashboard even when a parent started it with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mon = Monitor(args.url)
    key = args.api_key or os.environ.get("VERITY_API_KEY") or None
    console = Console(width=args.width) if args.width else Console()

    def poll() -> None:
        try:
            mon.update(fetch_stats(args.url, key))
        except ServerError as e:
            if e.status == 401:
                raise
            mon.update(None, e.message)

    try:
        if args.once or not console.is_terminal:
            while True:
                poll()
                console.print(render(mon))
                if args.once:
                    return 0 if mon.error is None else 1
                console.print()
                sys.stdout.flush()
                time.sleep(args.interval)
        with Live(render(mon), console=console, screen=True, auto_refresh=False) as live:
            while True:
                poll()
                live.update(render(mon), refresh=True)
                time.sleep(args.interval)
    except ServerError as e:
        Console(stderr=True).print(f"[bold red]{e}[/] (pass --api-key or set VERITY_API_KEY)")
        return 1
    except KeyboardInterrupt:
        return 0


def add_commands(sub) -> None:
    p = sub.add_parser("monitor", help="live dashboard of a running stack")
    p.add_argument("--url", default=os.environ.get("VERITY_URL", DEFAULT_URL), help=f"the stack (default {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="bearer token (default: $VERITY_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit (1 when the stack is unreachable)")
    p.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")
    p.set_defaults(run=run_monitor)
