"""OpenAI wire shapes: responses, stream chunks, usage and error objects."""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

import msgspec

from gateway.reasoning import Parts, ReasoningSplit, split
from gateway.tools import Dropped, ToolCallStream, split_whole_dropping
from protocol import messages as m

log = logging.getLogger("verity.gateway")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


def error_body(status: int, message: str, code: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}


def metrics_dict(metrics: m.RequestMetrics) -> dict:
    return msgspec.structs.asdict(metrics)


def usage(metrics: m.RequestMetrics) -> dict:
    return {
        "prompt_tokens": metrics.prompt_tokens,
        "completion_tokens": metrics.completion_tokens,
        "total_tokens": metrics.prompt_tokens + metrics.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": metrics.reused_tokens},
        "completion_tokens_details": {"reasoning_tokens": metrics.reasoning_tokens},
    }


class Shaper:
    """Builds the response objects of one request for its endpoint (chat or completion)."""

    def __init__(self, request_id: str, model: str, chat: bool, tool_calls: bool = False, index: int = 0,
                 logprobs: bool = False, thinks: bool = False):
        """`tool_calls`: the request offered tools; calls in the text become `tool_calls`. `index`:
        the choice this shaper builds; `logprobs`: each choice carries its tokens' log-probabilities;
        `thinks`: the model thinks (chat: its think block goes to `reasoning_content` and `reasoning`)."""
        self.id, self.model, self.chat = request_id, model, chat
        self.thinks, self.inside = thinks and chat, False
        self.split: Optional[ReasoningSplit] = None  # made at the first text
        self.index, self.logprobs, self._offset = index, logprobs, 0
        self._drafted: list[bool] = []  # origins of tokens whose text is held back, for the next chunk
        self.calls = ToolCallStream() if tool_calls else None
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def queued(self, ev: m.Queued) -> None:
        """The worker's verdict: whether the generation starts inside a think block."""
        self.inside = ev.thinking

    def whole(self, text: str, finished: m.Finished, logprobs: Optional[list[m.TokenLogprob]] = None) -> dict:
        choice = {"index": self.index, "finish_reason": finish_reason(finished.finish_reason)}
        if self.logprobs:
            choice["logprobs"] = self._logprobs(logprobs or [], 0)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.thinks:  # the answer alone is content (and tool calls are read from it)
                parts = split(text, self.inside)
                text = choice["message"]["content"] = parts.content
                reasoning = parts.reasoning or None
                choice["message"].update(reasoning_content=reasoning, reasoning=reasoning)
            if self.calls is not None:
                content, calls, dropped = split_whole_dropping(text, finished.finish_reason == "length")
                self._log_dropped(dropped, finished.finish_reason)
                choice["message"]["content"] = content  # never a block's markup
                if calls:
                    choice["message"]["tool_calls"] = [c.as_dict() for c in calls]
                    choice["finish_reason"] = calls_finish(choice["finish_reason"])
        else:
            choice["text"] = text
        return {**self._base(self.object), "choices": [choice], "usage": usage(finished.metrics),
                "metrics": metrics_dict(finished.metrics)}

    def delta(self, ev: m.TextDelta) -> Optional[dict]:
        """A worker delta's chunk, or None while its text is held back (a stop string's prefix,
        an incomplete character): its tokens' origins then go with the next chunk."""
        self._drafted += ev.drafted or []
        if not (ev.text or ev.logprobs):
            return None
        drafted, self._drafted = self._drafted, []
        parts = self._parts(ev.text)
        content = parts.content if parts.content or not self.thinks else None  # a thinking delta has no content
        out = self.chunk(text=content, logprobs=ev.logprobs, drafted=drafted, reasoning=parts.reasoning)
        choice = out["choices"][0]
        if self.chat and not choice["delta"] and "logprobs" not in choice:  # all held back (an open tool call)
            self._drafted = drafted + self._drafted
            return None
        return out

    def _parts(self, text: str) -> Parts:
        """A thinking model's text as (reasoning, answer); any other's as the answer."""
        if not self.thinks:
            return Parts(content=text)
        if self.split is None:
            self.split = ReasoningSplit(self.inside)
        return self.split.feed(text)

    def chunk(self, text: Optional[str] = None, role: bool = False, finished: Optional[m.Finished] = None,
              logprobs: Optional[list[m.TokenLogprob]] = None, drafted: Optional[list[bool]] = None,
              reasoning: str = "") -> dict:
        """`drafted`: a joint request's tokens' origins, as the `verity` extension (TokenOrigin);
        `reasoning`: think-block text (the last chunk adds what the splitter held back)."""
        choice: dict = {"index": self.index, "finish_reason": finish_reason(finished.finish_reason) if finished else None}
        if self.logprobs and (logprobs or not self.chat):
            choice["logprobs"] = self._logprobs(logprobs or [], self._offset)
        self._offset += _chars(logprobs) if logprobs else len(text or "") + len(reasoning)
        if finished is not None and self.split is not None:
            tail = self.split.finish()
            reasoning += tail.reasoning
            text = (text or "") + tail.content if tail.content else text
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if self.calls is not None and (text or finished):
                self._calls_delta(delta, text or "", finished)
                if finished is not None and self.calls.calls:
                    choice["finish_reason"] = calls_finish(choice["finish_reason"])
            elif text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {**self._base(self.object + ".chunk" if self.chat else self.object), "choices": [choice]}
        if finished is not None:
            out["metrics"] = metrics_dict(finished.metrics)
        if drafted:
            out["verity"] = {"drafted": drafted}
        return out

    def _calls_delta(self, delta: dict, text: str, finished: Optional[m.Finished]) -> None:
        """Content and tool-call pieces out of streamed text (the last chunk flushes)."""
        cut = finished is not None and finished.finish_reason == "length"
        splits = [self.calls.feed(text)] + ([self.calls.flush(cut)] if finished is not None else [])
        content = "".join(s.content for s in splits if s.content)
        pieces = [p.as_dict() for s in splits for p in s.pieces]
        if finished is not None:
            self._log_dropped(self.calls.dropped, finished.finish_reason)
        if content:
            delta["content"] = content
        if pieces:
            delta["tool_calls"] = pieces

    def _log_dropped(self, dropped: list[Dropped], reason: str) -> None:
        log_dropped(self.id, self.index, dropped, reason)

    def _logprobs(self, lps: list[m.TokenLogprob], offset: int) -> dict:
        """Chat's `{"content": [...]}`, or the legacy completion shape (its offsets from `offset`)."""
        lps = [_finite(x) for x in lps]
        if self.chat:
            return {"content": msgspec.to_builtins(lps), "refusal": None}
        offsets = [offset + _chars(lps[:i]) for i in range(len(lps))]
        return {"tokens": [x.token for x in lps], "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{t.token: t.logprob for t in x.top_logprobs} for x in lps], "text_offset": offsets}

    def usage_chunk(self, finished: m.Finished, totals: Optional[dict] = None) -> dict:
        """The last chunk's usage: this request's, or `totals` over several choices."""
        return {**self._base(self.object + ".chunk" if self.chat else self.object), "choices": [],
                "usage": totals or usage(finished.metrics), "metrics": metrics_dict(finished.metrics)}


def log_dropped(rid: str, index: int, dropped: list[Dropped], reason: str) -> None:
    """One line per block that was not a call: it never reaches `content`."""
    for d in dropped:
        what = f"`{d.name}`" if d.name else "an unnamed call"
        why = "whose JSON does not parse" if d.closed else f"cut before its end (finish_reason {reason})"
        log.warning("[%s] choice %d: dropped a tool call of %s %s", rid, index, what, why)


IMPOSSIBLE = -9999.0  # OpenAI's log-probability for a token of probability 0: JSON has no -Infinity


def _finite(x: m.TokenLogprob) -> m.TokenLogprob:
    """A token's log-probabilities as JSON can carry them (a penalty of 5e-324 made them -inf)."""
    fix = lambda v: v if math.isfinite(v) else IMPOSSIBLE  # noqa: E731
    if math.isfinite(x.logprob) and all(math.isfinite(t.logprob) for t in x.top_logprobs):
        return x
    top = [msgspec.structs.replace(t, logprob=fix(t.logprob)) for t in x.top_logprobs]
    return msgspec.structs.replace(x, logprob=fix(x.logprob), top_logprobs=top)


def _chars(lps: Optional[list[m.TokenLogprob]]) -> int:
    return sum(len(x.token) for x in lps or [])


def calls_finish(reason: str) -> str:
    """A reply with tool calls ends with "tool_calls", unless max_tokens cut it ("length")."""
    return "tool_calls" if reason == "stop" else reason


def finish_reason(reason: str) -> str:
    # OpenAI has no "cancelled"/"error"; a cancelled request's client is gone anyway
    return reason if reason in ("stop", "length") else "stop"
