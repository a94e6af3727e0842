"""Several choices in one response: `n` > 1, or several prompts on /v1/completions.

Each choice is its own request in the worker's batch (a row; those sharing a prompt share its
prefix through the reuse cache); the gateway merges their events. Choices are indexed prompt by
prompt, `index = prompt * n + j`, as OpenAI orders them. With a `seed`, choice j samples with
seed + j, so the choices differ and each reproduces.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgspec
from aiohttp import web

from gateway.link import QueueFull, Tracked, WorkerLink
from gateway.openai_format import Shaper, error_body
from protocol import messages as m
from protocol.schema import split_prompts, top_logprobs

SEED_SPAN = 2**63
SETTLE_S = 2.0  # how long a refused or failed request waits for its other choices' cancels


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


def admit_all(link: WorkerLink, rid: str, choices: list[Choice]) -> list[Tracked]:
    """Admits every choice or none (QueueFull after cancelling those admitted)."""
    tracked: list[Tracked] = []
    try:
        for c in choices:
            tracked.append(link.admit(f"{rid}-{c.index}", c.request))
    except QueueFull:
        for t in tracked:
            link.cancel(t.id)
        raise
    return tracked


def usage_of(rows: list[Row]) -> dict:
    prompt = sum(r.finished.metrics.prompt_tokens for r in rows if r.choice.first_of_prompt)
    completion = sum(r.finished.metrics.completion_tokens for r in rows)
    cached = sum(r.finished.metrics.reused_tokens for r in rows if r.choice.first_of_prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Merged:
    """The events of several rows in arrival order, each with its row; `firsts`: an event
    already taken from each row (None: none)."""

    def __init__(self, rows: list[Row], firsts: list):
        self.rows = rows
        self.queue: asyncio.Queue = asyncio.Queue()
        for r, ev in zip(rows, firsts):
            if ev is not None:
                self.queue.put_nowait((r, ev))
        self.tasks = [asyncio.create_task(self._pump(r)) for r, ev in zip(rows, firsts)
                      if not isinstance(ev, (m.Finished, m.Error))]

    async def _pump(self, row: Row) -> None:
        while True:
            ev = await row.tracked.events.get()
            await self.queue.put((row, ev))
            if isinstance(ev, (m.Finished, m.Error)):
                return

    async def next(self) -> tuple[Row, object]:
        return await self.queue.get()

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


def make_rows(rid: str, model: str, chat: bool, choices: list[Choice], tracked: list[Tracked],
              tool_calls: bool) -> list[Row]:
    want = top_logprobs(choices[0].request) is not None
    return [Row(c, t, Shaper(rid, model, chat, tool_calls=tool_calls, index=c.index, logprobs=want))
            for c, t in zip(choices, tracked)]


async def whole(rows: list[Row], firsts: list, cancel: Callable[[], None]) -> web.Response:
    """One response with every choice; the first error ends them all."""
    merged = Merged(rows, firsts)
    try:
        done = 0
        while done < len(rows):
            row, ev = await merged.next()
            if isinstance(ev, m.TextDelta):
                row.text.append(ev.text)
                row.logprobs.extend(ev.logprobs or [])
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


async def stream(resp: web.StreamResponse, rows: list[Row], firsts: list, include_usage: bool,
                 cancel: Callable[[], None]) -> None:
    """The SSE events of every choice, interleaved as they come, then usage and [DONE]."""
    if rows[0].shaper.chat:
        for r in rows:
            await _sse(resp, r.shaper.chunk(role=True, text=""))
    merged = Merged(rows, firsts)
    try:
        done = 0
        while done < len(rows):
            row, ev = await merged.next()
            if isinstance(ev, m.TextDelta) and (chunk := row.shaper.delta(ev)) is not None:
                await _sse(resp, chunk)
            elif isinstance(ev, m.Finished):
                row.finished, done = ev, done + 1
                await _sse(resp, row.shaper.chunk(finished=ev))
            elif isinstance(ev, m.Error):
                cancel()
                await _sse(resp, error_body(ev.status, ev.message, ev.code, ev.param))
                await merged.drain()
                break
        else:
            if include_usage:
                await _sse(resp, rows[0].shaper.usage_chunk(rows[0].finished, usage_of(rows)))
    finally:
        merged.close()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
