"""Several choices in one response: `n` > 1, or several prompts on /v1/completions.

Each choice is its own request in the worker's batch (a row; those sharing a prompt share its
prefix through the reuse cache); the gateway merges their events. Choices are indexed prompt by
prompt, `index = prompt * n + j`, as OpenAI orders them. With a `seed`, choice j samples with
seed + j, so the choices differ and each reproduces.

A request holds at most a quarter of the batch's rows at once (`row_share`): its other choices
are admitted (they count against the queue) but held here, each sent when one of its running
choices ends, so no two requests take every row.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgspec
from aiohttp import web

from gateway.link import QueueFull, Tracked, WorkerLink
from gateway.openai_format import Shaper, error_body
from gateway.sse import SseWriter
from protocol import messages as m
from protocol.schema import split_prompts, top_logprobs

SEED_SPAN = 2**63
SETTLE_S = 2.0  # how long a refused or failed request waits for its other choices' cancels
ROW_SHARE = 4  # a request decodes at most max_active / ROW_SHARE rows at once (at least one)


@dataclass
class Choice:
    index: int
    first_of_prompt: bool  # usage counts each prompt once
    request: m.GenerateRequest  # n of 1, one prompt


@dataclass
class Row:
    choice: Choice
    tracked: Tracked
    shaper: Shaper
    text: list[str] = field(default_factory=list)
    logprobs: list[m.TokenLogprob] = field(default_factory=list)
    finished: Optional[m.Finished] = None


def expand(req: m.GenerateRequest, chat: bool) -> list[Choice]:
    """The request's choices: each prompt (completions) times n."""
    prompts = [None] if chat else split_prompts(req.prompt)
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(req.n):
            seed = None if req.seed is None else (req.seed + j) % SEED_SPAN
            one = msgspec.structs.replace(req, n=1, seed=seed, prompt=req.prompt if chat else prompt)
            out.append(Choice(p * req.n + j, j == 0, one))
    return out


def row_share(max_active: int) -> int:
    return max(1, max_active // ROW_SHARE)


def admit_all(link: WorkerLink, rid: str, choices: list[Choice]) -> list[Tracked]:
    """Admits every choice or none (QueueFull after cancelling those admitted); those past the
    request's row share are held until running ones end."""
    tracked: list[Tracked] = []
    share = row_share(link.max_active)
    try:
        for i, c in enumerate(choices):
            tracked.append(link.admit(f"{rid}-{c.index}", c.request, hold=i >= share))
    except QueueFull:
        for t in tracked:
            link.cancel(t.id)
        raise
    return tracked


def usage_of(rows: list[Row]) -> dict:
    prompt = sum(r.finished.metrics.prompt_tokens for r in rows if r.choice.first_of_prompt)
    completion = sum(r.finished.metrics.completion_tokens for r in rows)
    cached = sum(r.finished.metrics.reused_tokens for r in rows if r.choice.first_of_prompt)
    reasoning = sum(r.finished.metrics.reasoning_tokens for r in rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


class Merged:
    """The events of several rows in arrival order, each with its row; `firsts`: an event
    already taken from each row (None: none). `ended` is told each row's end (to release a held one)."""

    def __init__(self, rows: list[Row], firsts: list, ended: Callable[[], None] = lambda: None):
        self.rows, self.ended = rows, ended
        self.queue: asyncio.Queue = asyncio.Queue()
        for r, ev in zip(rows, firsts):
            if ev is not None:
                self.queue.put_nowait((r, ev))
            if isinstance(ev, (m.Finished, m.Error)):
                ended()
        self.tasks = [asyncio.create_task(self._pump(r)) for r, ev in zip(rows, firsts)
                      if not isinstance(ev, (m.Finished, m.Error))]

    async def _pump(self, row: Row) -> None:
        while True:
            ev = await row.tracked.events.get()
            await self.queue.put((row, ev))
            if isinstance(ev, (m.Finished, m.Error)):
                self.ended()
                return

    async def next(self, within_s: Optional[float] = None) -> Optional[tuple[Row, object]]:
        """The next (row, event); None when none came within `within_s`."""
        try:
            async with asyncio.timeout(within_s):
                return await self.queue.get()
        except TimeoutError:
            return None

    async def drain(self, within_s: float = SETTLE_S) -> None:
        """After a cancel: waits for every row's end, so their admission slots are free again."""
        try:
            async with asyncio.timeout(within_s):
                await asyncio.gather(*self.tasks, return_exceptions=True)
        except TimeoutError:
            pass
        self.close()

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


def release_next(link: WorkerLink, tracked: list[Tracked]) -> None:
    """One of a request's rows ended: its next held choice goes to the worker."""
    held = next((t for t in tracked if t.held), None)
    if held is not None:
        link.release(held)


def make_rows(rid: str, model: str, chat: bool, choices: list[Choice], tracked: list[Tracked],
              tool_calls: bool, thinks: bool = False) -> list[Row]:
    want = top_logprobs(choices[0].request) is not None
    return [Row(c, t, Shaper(rid, model, chat, tool_calls=tool_calls, index=c.index, logprobs=want, thinks=thinks))
            for c, t in zip(choices, tracked)]


async def whole(rows: list[Row], firsts: list, cancel: Callable[[], None], ended: Callable[[], None]) -> web.Response:
    """One response with every choice; the first error ends them all."""
    merged = Merged(rows, firsts, ended)
    try:
        done = 0
        while done < len(rows):
            row, ev = await merged.next()
            if isinstance(ev, m.TextDelta):
                row.text.append(ev.text)
                row.logprobs.extend(ev.logprobs or [])
            elif isinstance(ev, m.Queued):
                row.shaper.queued(ev)
            elif isinstance(ev, m.Finished):
                row.finished, done = ev, done + 1
            elif isinstance(ev, m.Error):
                cancel()
                await merged.drain()
                return web.json_response(error_body(ev.status, ev.message, ev.code, ev.param), status=ev.status,
                                         headers={"X-Request-Id": rows[0].shaper.id})
    finally:
        merged.close()
    shaped = [r.shaper.whole("".join(r.text), r.finished, r.logprobs) for r in rows]
    body = {**shaped[0], "choices": [s["choices"][0] for s in shaped], "usage": usage_of(rows)}
    return web.json_response(body, headers={"X-Request-Id": rows[0].shaper.id})


async def stream(out: SseWriter, rows: list[Row], firsts: list, include_usage: bool, cancel: Callable[[], None],
                 ended: Callable[[], None], keepalive_s: float) -> None:
    """The SSE events of every choice, interleaved as they come (a keep-alive comment while none
    comes for keepalive_s), then usage and [DONE]. Raises ClientStalled (gateway/sse.py)."""
    if rows[0].shaper.chat:
        for r in rows:
            await out.event(r.shaper.chunk(role=True, text=""))
    merged = Merged(rows, firsts, ended)
    try:
        done = 0
        while done < len(rows):
            got = await merged.next(keepalive_s)
            if got is None:
                await out.keepalive()
                continue
            row, ev = got
            if isinstance(ev, m.Queued):
                row.shaper.queued(ev)
            elif isinstance(ev, m.TextDelta) and (chunk := row.shaper.delta(ev)) is not None:
                await out.event(chunk)
            elif isinstance(ev, m.Finished):
                row.finished, done = ev, done + 1
                await out.event(row.shaper.chunk(finished=ev))
            elif isinstance(ev, m.Error):
                cancel()
                await out.event(error_body(ev.status, ev.message, ev.code, ev.param))
                await merged.drain()
                break
        else:
            if include_usage:
                await out.event(rows[0].shaper.usage_chunk(rows[0].finished, usage_of(rows)))
    finally:
        merged.close()
    await out.done()
