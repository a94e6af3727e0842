"""What the gateway counts, and the Prometheus text exposition of it (GET /metrics).

The gateway sees every admitted request's end (a Finished event with the request's metrics, or
an Error), so request counters live here; live gauges come from the worker's StatsSnapshot.
Names follow vLLM's (`vllm:` becomes `verity:`), so existing dashboards need only the prefix.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from protocol import messages as m

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
RECENT = 64  # finished requests summarised for the monitor


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # le: value <= bound
        self.sum += value

    def samples(self) -> list[tuple[str, float]]:
        bounds = [_num(b) for b in self.buckets] + ["+Inf"]
        return list(zip(bounds, itertools.accumulate(self.counts)))


@dataclass
class Counters:
    http: Counter = field(default_factory=Counter)  # generation responses by HTTP status
    kinds: Counter = field(default_factory=Counter)  # the same, by request kind (gateway/surfaces.py GENERATE_KINDS)
    finished: Counter = field(default_factory=Counter)  # by finish_reason
    errors: Counter = field(default_factory=Counter)  # admitted requests ended by an Error, by code
    error_statuses: Counter = field(default_factory=Counter)  # the same, by HTTP status (4xx: the client's)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    recovery_s: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # RequestMetrics

    def observe(self, tracked, event) -> None:
        """WorkerLink.on_end observer: every admitted request ends here exactly once."""
        if isinstance(event, m.Error):
            self.errors[event.code] += 1
            self.error_statuses[str(event.status)] += 1
            return
        mx = event.metrics
        self.finished[event.finish_reason] += 1
        self.prompt_tokens += mx.prompt_tokens
        self.generation_tokens += mx.completion_tokens
        self.cached_tokens += mx.reused_tokens
        if mx.mode == "joint":
            self.cycles += mx.cycles
            self.drafted += mx.drafted
            self.accepted += mx.accepted
            self.rollbacks += mx.rollbacks
            self.recovery_s += mx.recovery_s
        if mx.completion_tokens:
            self.ttft.observe(mx.ttft_s)
            self.recent.append(mx)
        self.e2e.observe(time.monotonic() - tracked.admitted_at)

    def totals(self) -> dict:
        return {
            "responses": dict(self.http), "kinds": dict(self.kinds), "finished": dict(self.finished), "errors": dict(self.errors),
            "error_statuses": dict(self.error_statuses),
            "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
            "cached_tokens": self.cached_tokens, "cycles": self.cycles, "drafted": self.drafted,
            "accepted": self.accepted, "rollbacks": self.rollbacks, "recovery_s": self.recovery_s,
        }

    def recent_summary(self) -> dict:
        """Over the last RECENT finished requests: what the monitor shows as 'now'."""
        rs = list(self.recent)
        joint = [r for r in rs if r.mode == "joint" and r.cycles]
        ttfts = sorted(r.ttft_s for r in rs)
        drafted = sum(r.drafted for r in joint)
        return {
            "requests": len(rs),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None,
            "decode_tps": statistics.fmean(r.decode_tps for r in rs) if rs else None,
            "joint_requests": len(joint),
            "acceptance": sum(r.accepted for r in joint) / drafted if drafted else None,
            "budget_per_cycle": drafted / sum(r.cycles for r in joint) if joint else None,
        }


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class Exposition:
    """Builds the Prometheus text format (version 0.0.4), one family at a time."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, prefix: str = "verity:"):
        self.prefix, self.lines = prefix, []

    def family(self, name: str, kind: str, help: str, samples: Iterable[tuple[dict, float]]) -> None:
        full = self.prefix + name
        self.lines += [f"# HELP {full} {help}", f"# TYPE {full} {kind}"]
        self.lines += [f"{full}{_labels(labels)} {_num(value)}" for labels, value in samples]

    def one(self, name: str, kind: str, help: str, value: float, **labels) -> None:
        self.family(name, kind, help, [(labels, value)])

    def by(self, name: str, label: str, help: str, counts: Counter, keys: Iterable[str] = ()) -> None:
        """A counter with one label; `keys` are shown at 0 before they first happen."""
        merged = {k: 0 for k in keys} | dict(counts)
        self.family(name, "counter", help, [({label: k}, v) for k, v in sorted(merged.items())])

    def histogram(self, name: str, help: str, h: Histogram) -> None:
        full = self.prefix + name
        self.lines += [f"# HELP {full} {help}", f"# TYPE {full} histogram"]
        self.lines += [f'{full}_bucket{{le="{le}"}} {n}' for le, n in h.samples()]
        self.lines += [f"{full}_sum {_num(h.sum)}", f"{full}_count {sum(h.counts)}"]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(c: Counters, *, model: Optional[str], draft: Optional[str], worker_up: bool, running: int,
           waiting: int, worker_restarts: int, stats: Optional[m.StatsSnapshot]) -> str:
    e = Exposition()
    e.one("info", "gauge", "The served model and draft (value 1).", 1, model=model or "", draft=draft or "")
    e.one("worker_up", "gauge", "1 while a worker is ready to serve.", int(worker_up))
    e.one("worker_restarts_total", "counter", "Worker processes that died and were restarted.", worker_restarts)
    e.by("requests_total", "status", "Generation requests answered, by HTTP status.", c.http, ["200"])
    e.by("requests_by_kind_total", "kind", "Generation requests answered, by kind (the API they came by).", c.kinds,
         ["chat", "completion", "messages", "responses"])
    e.by("request_success_total", "finished_reason", "Requests that finished, by reason.", c.finished,
         ["stop", "length", "cancelled"])
    e.by("request_errors_total", "code", "Admitted requests that ended with an error, by code.", c.errors)
    e.one("num_requests_running", "gauge", "Requests being decoded.", running)
    e.one("num_requests_waiting", "gauge", "Requests admitted and waiting to start.", waiting)
    e.one("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", c.prompt_tokens)
    e.one("generation_tokens_total", "counter", "Tokens generated by finished requests.", c.generation_tokens)
    e.one("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the cache.", c.cached_tokens)
    e.one("spec_decode_num_drafts_total", "counter", "Joint cycles (one draft each).", c.cycles)
    e.one("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", c.drafted)
    e.one("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted by the target.", c.accepted)
    e.one("spec_decode_rollbacks_total", "counter", "Joint cycles that rejected a draft token.", c.rollbacks)
    e.one("spec_decode_recovery_seconds_total", "counter", "Time spent recovering caches after rejections.",
          c.recovery_s)
    e.histogram("time_to_first_token_seconds", "Time to first token, per request.", c.ttft)
    e.histogram("e2e_request_latency_seconds", "Admission to last event, per request.", c.e2e)
    s = stats or m.StatsSnapshot(process="worker", pid=0, time=0.0)
    e.one("worker_queue_depth", "gauge", "Requests queued inside the worker.", s.queue_depth)
    e.one("generation_tokens_per_second", "gauge", "Tokens generated per second, last 5 s.", s.tokens_per_s)
    e.one("cache_bytes", "gauge", "Bytes of reusable snapshots held (0 when no cache service).", s.cache_bytes or 0)
    e.one("cache_queries_total", "counter", "Cache lookups by the worker.", s.cache_lookups)
    e.one("cache_hits_total", "counter", "Cache lookups that found a reusable prefix.", s.cache_hits)
    e.family("worker_rank_up", "gauge", "1 for each rank of a distributed worker while it serves.",
             [({"rank": str(r.rank), "pid": str(r.pid), "host": r.host}, int(worker_up)) for r in s.ranks])
    return e.text()
