"""The model loop: a bounded FIFO of requests, decoded interleaved, one token per request a step.

No sockets here: `submit` and `cancel` are plain calls that any thread may make, `step` runs on
the one MLX thread and returns the events it produced. worker/proc.py moves them over sockets.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream

from protocol import messages as m
from worker import blas_threads
from worker.loader import LoadedModel
from worker.sampling import make_request_sampler
from worker.joint.draft import Drafter
from worker.joint.batch import joint_round
from worker.joint.decoder import CycleStats, JointDecoder, switching_cost
from worker.joint.sampling import SamplingParams
from worker.scheduler import Scheduler
from worker.state.reuse import Plan, PrefixCache, Start
from worker.text import StopMatcher, StreamingDetokenizer, render_prompt


@dataclass
class EngineConfig:
    max_active: int = 4  # requests decoded at once
    max_waiting: int = 64  # requests queued behind them; the gateway bounds it first
    prefill_step: int = 512
    draft_budget: Optional[int] = None  # fixed tokens drafted per joint cycle; None: adaptive
    max_round_budget: int = 16  # adaptive: drafted tokens in one round, all requests together
    decision_log: Optional[str] = None  # adaptive: JSON lines of every budget decision
    batch_verify: bool = True  # joint requests of a round share batched draft and verify forwards
    recovery: str = "fast"  # "fast" (per-position states) or "replay" (checkpoint and re-feed)


class RequestError(Exception):
    """A request the worker refuses before it is queued (maps to an HTTP status)."""

    def __init__(self, code: str, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.code, self.message, self.status, self.param = code, message, status, param


@dataclass
class _Request:
    id: str
    req: m.GenerateRequest
    prompt: list[int]
    received: float
    decoder: Optional["_Baseline | _Joint"] = None
    detok: Optional[StreamingDetokenizer] = None
    stop: Optional[StopMatcher] = None
    tokens: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    done: bool = False
    finished: Optional[m.Finished] = None
    last_token_at: float = 0.0
    plan: Optional[Plan] = None  # prefix reuse (worker/state/reuse.py)


@dataclass
class _Totals:
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # token timestamps
    joint: CycleStats = field(default_factory=CycleStats)  # summed over released joint requests

    def add_joint(self, s: CycleStats) -> None:
        j = self.joint
        j.cycles, j.drafted, j.accepted = j.cycles + s.cycles, j.drafted + s.drafted, j.accepted + s.accepted
        j.rollbacks, j.recovery_s = j.rollbacks + s.rollbacks, j.recovery_s + s.recovery_s
        for pos, (a, t) in enumerate(s.accepted_at):
            if pos == len(j.accepted_at):
                j.accepted_at.append([0, 0])
            j.accepted_at[pos][0] += a
            j.accepted_at[pos][1] += t


class _Baseline:
    """mlx-lm's generate_step: pipelined one-token steps."""

    def __init__(self, gen: Iterator, cache: Optional[list] = None):
        self.gen, self.started = gen, False
        self.cache = cache  # after each token, it holds the prompt and every token emitted

    def advance(self) -> list[int]:
        token = next(self.gen)[0]  # the first call prefills
        self.started = True
        return [token]

    def commit(self, m: int) -> None:
        pass

    def close(self) -> None:
        self.gen.close()


class _Joint:
    """The joint cycle: 1 + accepted tokens per advance; commit recovers both caches.
    `pipelined_start`: plain cycles are likely first (adaptive, or a fixed k of 0)."""

    def __init__(self, decoder: JointDecoder, pipelined_start: bool = False):
        self.decoder, self.budget, self.started, self.cycled = decoder, 0, False, False
        self.pipelined_start = pipelined_start
        self.last = False  # the next cycle emits the request's last token

    def advance(self) -> list[int]:
        if not self.started:
            self.started = True
            return [self.decoder.start(self.pipelined_start)]
        self.cycled = True
        return self.decoder.cycle(self.budget, self.last)

    def commit(self, m: int) -> None:
        if self.cycled:
            self.decoder.commit(m)

    def close(self) -> None:
        pass


def cache_identity(lm: LoadedModel, draft_id: Optional[str] = None) -> str:
    """Identity under which cached state is valid (per-request thinking mode is mixed in later)."""
    parts = [lm.revision, lm.chat_template or "", lm.quantization, draft_id or "no-draft"]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


class Engine:
    def __init__(self, lm: LoadedModel, config: EngineConfig = EngineConfig(), draft: Optional[LoadedModel] = None,
                 drafter_factory=None, reuse: Optional[PrefixCache] = None):
        """drafter_factory(request_id, prompt) -> Drafter replaces the draft model's own drafter
        (benchmarks: the controlled-acceptance draft; never served). reuse: exact prefix reuse."""
        self.lm, self.config, self.draft, self.reuse = lm, config, draft, reuse
        self.drafter_factory = drafter_factory
        self.draft_id = f"{draft.model_id}@{draft.revision}" if draft else None
        self.eos_ids = set(lm.tokenizer.eos_token_ids)
        self._lock = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._cancels: set[str] = set()
        self._active: list[_Request] = []
        self.totals = _Totals()
        self.scheduler = Scheduler(config.draft_budget, config.max_round_budget, config.decision_log)
        self._params = _n_params(lm.model)  # what a prompt token's prefill costs, for blas_threads
        self._draft_params = _n_params(draft.model) if draft else 0

    # ---- any thread ----

    def submit(self, request_id: str, req: m.GenerateRequest) -> int:
        """Tokenizes and queues a request; returns its prompt length or raises RequestError."""
        if req.mode == "joint" and self.draft is None:
            raise RequestError("joint_unavailable", "`mode` \"joint\" needs a draft model; this server has none (start launch-stack with --draft)", param="mode")
        try:
            prompt = render_prompt(self.lm.tokenizer, req)
        except Exception as e:  # a template may raise on odd conversations
            raise RequestError("invalid_prompt", f"the prompt could not be rendered: {e}", param="messages") from None
        if not prompt:
            raise RequestError("invalid_prompt", "the prompt is empty after tokenization", param="prompt")
        if len(prompt) >= self.lm.context_limit:
            raise RequestError(
                "context_length_exceeded",
                f"the prompt has {len(prompt)} tokens; this model's context limit is {self.lm.context_limit}",
                param="messages" if req.messages is not None else "prompt",
            )
        plan = self.reuse.plan(req, prompt) if self.reuse else None
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise RequestError("queue_full", "the worker's waiting line is full", status=429)
            self._waiting.append(_Request(request_id, req, prompt, time.perf_counter(), plan=plan))
            self.totals.requests += 1
            self._lock.notify()
        return len(prompt)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify()

    def wait_for_work(self, timeout: float) -> bool:
        with self._lock:
            if not self.has_work():
                self._lock.wait(timeout)
            return self.has_work()

    def has_work(self) -> bool:
        return bool(self._active or self._waiting or self._cancels)

    def active_count(self) -> int:
        return len(self._active)

    def stats(self, pid: int) -> m.StatsSnapshot:
        t = self.totals
        now = time.perf_counter()
        recent = [x for x in list(t.recent) if now - x < 5.0]
        tps = (len(recent) - 1) / (now - recent[0]) if len(recent) > 1 and now > recent[0] else 0.0
        return m.StatsSnapshot(
            process="worker", pid=pid, time=time.time(), queue_depth=len(self._waiting),
            active=len(self._active), requests_total=t.requests, requests_finished=t.finished,
            prompt_tokens_total=t.prompt_tokens, generated_tokens_total=t.generated_tokens,
            tokens_per_s=tps, drafted_total=t.joint.drafted, accepted_total=t.joint.accepted,
            cycles_total=t.joint.cycles, rollbacks_total=t.joint.rollbacks, recovery_s_total=t.joint.recovery_s,
            **(self.reuse.stats_fields() if self.reuse else {}),
        )

    # ---- the MLX thread ----

    def step(self) -> list:
        """Applies cancels, admits waiting requests, decodes one token for each active one."""
        events: list = []
        self._apply_cancels(events)
        with mx.stream(generation_stream):  # mlx-lm's own: the joint path runs where generate_step does
            if self._waiting and len(self._active) < self.config.max_active:
                with self._lock:  # admission prefills (with reuse, up to the prompt's boundaries)
                    admitted = list(self._waiting)[: self.config.max_active - len(self._active)]
                blas_threads.use(self._params * sum(len(r.prompt) for r in admitted))
            self._admit(events)
            self._round(events)
        if not self._active:  # idle: the decision log's held-back records go out now
            self.scheduler.flush_log()
        return events

    def _round(self, events: list) -> None:
        """One decode round: a token for each baseline request, a cycle for each joint one, with
        draft lengths from the scheduler; the round's time feeds its cost model."""
        joint = [r for r in self._active if isinstance(r.decoder, _Joint) and r.decoder.started]
        decoders = [r.decoder.decoder for r in joint]
        behind = [d.draft_behind for d in decoders]
        room = [max(0, self._tokens_left(r) - 1 - d.looking_ahead) for r, d in zip(joint, decoders)]  # a cycle emits its accepted drafts and one more (and a taken look-ahead)
        batching = self.config.batch_verify and len(joint) > 1
        plan = self.scheduler.plan([r.id for r in joint], len(self._active), behind, room,
                                   [d.looking_ahead for d in decoders], pipelined=not batching,
                                   feeds=[d.draft_feed for d in decoders])
        for r, k in zip(joint, plan):
            r.decoder.budget, r.decoder.last = k, self._tokens_left(r) <= 1
        # a prefill is no decode round; nor is one that pays a switching cost, unless the cost
        # is paid on its own and timed apart (a draft's catch-up, a discarded look-ahead)
        reason = "" if all(r.decoder.started for r in self._active) else "prefill or error"
        reason = reason or switching_cost(decoders, [r.decoder.budget for r in joint], batching, timed_apart=True)
        if not reason and not batching and any(r.decoder.last and not r.decoder.budget for r in joint):
            reason = "last plain round"  # it computes nothing ahead: only the wait for the token computed before
        complete = not reason
        blas_threads.use(self._params * sum(len(r.prompt) for r in self._active if not r.decoder.started)
                         + self._draft_params * sum(d.prompt_len for d, k in zip(decoders, plan)
                                                    if k and d.draft_lacks_prompt))  # a draft's first cycle prefills it
        for d in decoders:
            d.take_apart()  # what a snapshot's settle paid since is no part of this round
        t0 = time.perf_counter()
        batched = self._batched_cycles(joint, events) if batching else {}
        complete = complete and (not batching or len(batched) == len(joint))
        for r in list(self._active):
            try:
                tokens = batched[r.id] if r.id in batched else r.decoder.advance()
            except Exception as e:  # a failure of one request must not take the others down
                complete = False
                self._fail(r, e, events)
                continue
            kept = 0
            for token in tokens:
                kept += 1
                if self._on_token(r, token, events):
                    break
            r.decoder.commit(kept)
            if r in joint:
                self.scheduler.observe_cycle(r.id, *r.decoder.decoder.last_cycle)
            if r.done:
                r.finished.metrics = self._metrics(r)  # with the last cycle's recovery
                self._release(r)
        apart: dict[str, tuple] = {}
        for d in decoders:
            for why, paid in d.take_apart().items():
                apart[why] = tuple(a + b for a, b in zip(apart.get(why, (0.0, 0, 0)), paid))
        drafting = sum(d.last_draft_s for k, d in zip(plan, decoders) if k)
        self.scheduler.observe_round(time.perf_counter() - t0 - sum(s for s, *_ in apart.values()), complete,
                                     reason or ("" if complete else "prefill or error"), apart, drafting)

    def _tokens_left(self, r: _Request) -> int:
        return min(r.req.max_tokens - len(r.tokens), self.lm.context_limit - len(r.prompt) - len(r.tokens))

    def _batched_cycles(self, joint: list, events: list) -> dict[str, list[int]]:
        """One cycle for every started joint request in batched forwards; {id: emitted tokens}."""
        try:
            emitted = joint_round([r.decoder.decoder for r in joint], [r.decoder.budget for r in joint])
        except Exception as e:  # the batch failed: each of its requests ends with the error
            for r in joint:
                self._fail(r, e, events)
            return {}
        for r in joint:
            r.decoder.cycled = True
        return {r.id: e for r, e in zip(joint, emitted)}

    def _apply_cancels(self, events: list) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            waiting = [r for r in self._waiting if r.id in cancels]
            for r in waiting:
                self._waiting.remove(r)
        for r in waiting:
            events.append(m.Finished(r.id, "cancelled", self._metrics(r)))
        self.totals.finished += len(waiting)  # they never reach _release
        for r in [r for r in self._active if r.id in cancels]:
            self._finish(r, "cancelled", events)
            self._release(r)

    def _alone_and_plain_first(self) -> bool:
        """A new joint request's first cycles are likely plain and unbatched: a fixed k of 0, or
        the adaptive scheduler whose last decision drafted nothing, and no other joint request
        active or waiting to batch with. (Started pipelined, a drafting first cycle takes the
        token computed ahead, but the start's second forward costs ~7 ms more than that token
        saves at α = 0.6 on this CPU's embedded model.)"""
        with self._lock:
            others = any(w.req.mode == "joint" for w in self._waiting)
        others = others or any(a.req.mode == "joint" for a in self._active)
        plain = self.config.draft_budget == 0 or (self.config.draft_budget is None and not self.scheduler.drafting)
        return plain and not (self.config.batch_verify and others)

    def _admit(self, events: list) -> None:
        while len(self._active) < self.config.max_active:
            with self._lock:
                if not self._waiting:
                    return
                r = self._waiting.popleft()
            r.decoder = self._decoder(r)
            r.detok = StreamingDetokenizer(self.lm.tokenizer, r.prompt)
            r.stop = StopMatcher(r.req.stop)
            self.totals.prompt_tokens += len(r.prompt)
            self._active.append(r)
            events.append(m.Started(r.id, len(r.prompt)))

    def _decoder(self, r: _Request):
        req = r.req
        # with reuse: caches that hold a prefix of the prompt (restored, then prefilled to its boundaries)
        s = self.reuse.start(r.plan, r.prompt, req.mode == "joint") if r.plan else Start()
        if req.mode == "joint":
            params = SamplingParams(req.temperature, req.top_p)
            drafter = (self.drafter_factory(r.id, r.prompt) if self.drafter_factory
                       else Drafter(self.draft.model, self.config.recovery, self.config.prefill_step,
                                    s.draft_cache, r.prompt[: s.draft_pos]))
            jd = JointDecoder(self.lm.model, drafter, r.prompt, params, req.seed, self.config.recovery,
                              self.config.prefill_step, s.cache, s.pos)
            return _Joint(jd, pipelined_start=self._alone_and_plain_first())
        return _Baseline(generate_step(
            mx.array(r.prompt[s.pos :]), self.lm.model, max_tokens=-1,
            sampler=make_request_sampler(req.temperature, req.top_p, req.seed),
            prefill_step_size=self.config.prefill_step, prompt_cache=s.cache,
        ), s.cache)

    def _on_token(self, r: _Request, token: int, events: list) -> bool:
        """Handles one emitted token; True when it ended the request."""
        now = time.perf_counter()
        if not r.tokens:
            r.first_token_at = now
        r.last_token_at = now
        r.tokens.append(token)
        self.totals.generated_tokens += 1
        self.totals.recent.append(now)
        if token in self.eos_ids and not r.req.ignore_eos:
            return self._finish(r, "stop", events)
        text, stopped = r.stop.feed(r.detok.add(token))
        if text or not stopped:
            events.append(m.TextDelta(r.id, text, [token]))
        if stopped:
            return self._finish(r, "stop", events, flush=False)
        if len(r.tokens) >= r.req.max_tokens or len(r.prompt) + len(r.tokens) >= self.lm.context_limit:
            return self._finish(r, "length", events)
        return False

    def _finish(self, r: _Request, reason: str, events: list, flush: bool = True) -> bool:
        """Emits the end of a request; the caller releases it after recovering its state."""
        if flush and r.detok is not None:
            text, stopped = r.stop.feed(r.detok.flush())
            tail = text if stopped else text + r.stop.flush()
            if tail:
                events.append(m.TextDelta(r.id, tail, []))
        r.done = True
        r.finished = m.Finished(r.id, reason, self._metrics(r))
        events.append(r.finished)
        return True

    def _fail(self, r: _Request, exc: Exception, events: list) -> None:
        self._release(r)
        events.append(m.Error(r.id, "generation_failed", f"generation failed: {type(exc).__name__}: {exc}", 500))

    def _release(self, r: _Request) -> None:
        self.scheduler.forget(r.id)
        if r in self._active:
            self._active.remove(r)
        if isinstance(r.decoder, _Joint):
            self.totals.add_joint(r.decoder.decoder.stats)
        if r.plan is not None and r.finished and r.finished.finish_reason in ("stop", "length") and r.decoder is not None:
            self._keep_generation(r)
        if r.decoder is not None:
            r.decoder.close()
            r.decoder = None
        self.totals.finished += 1

    def _keep_generation(self, r: _Request) -> None:
        """The end-of-generation snapshot, of the tokens the target cache consumed: baseline's
        generate_step has fed every emitted token (it runs one ahead), the joint path all but the last."""
        if isinstance(r.decoder, _Joint):
            jd = r.decoder.decoder
            jd.settle()
            self.reuse.keep_generation(r.plan, jd.tokens[:-1], jd.cache, jd.drafter)
        else:
            self.reuse.keep_generation(r.plan, r.prompt + r.tokens, r.decoder.cache)

    def _metrics(self, r: _Request) -> m.RequestMetrics:
        n = len(r.tokens)
        span = r.last_token_at - r.first_token_at
        out = m.RequestMetrics(
            mode=r.req.mode, prompt_tokens=len(r.prompt), completion_tokens=n,
            reused_tokens=r.plan.reused if r.plan else 0,
            cycles=n, ttft_s=(r.first_token_at - r.received) if n else 0.0,
            decode_tps=(n - 1) / span if n > 1 and span > 0 else 0.0,
        )
        if isinstance(r.decoder, _Joint):
            s = r.decoder.decoder.stats
            out.draft, out.cycles, out.drafted, out.accepted = self.draft_id, s.cycles, s.drafted, s.accepted
            out.rollbacks, out.recovery_s = s.rollbacks, s.recovery_s
            out.budget_mean = s.drafted / s.cycles if s.cycles else 0.0
        return out

    def warmup(self) -> None:
        """Runs the shapes serving uses (prefill chunk, one-token decode) once before READY."""
        req = m.GenerateRequest(messages=[m.Message("user", "Hello")], max_tokens=4, temperature=0.0)
        self.submit("warmup", req)
        if self.draft is not None:
            self.submit("warmup-joint", m.GenerateRequest(messages=req.messages, max_tokens=8, temperature=0.0, mode="joint"))
        while self.has_work():
            self.step()
        self.totals = _Totals()
