"""The context policy (docs/memory.md): the context a request may fill (--max-context, at most the
model's own), and what a request past it gets (--context-overflow; a request's `context_overflow`
overrides it):

- `refuse`: a prompt that does not fit is refused (400 naming the limit); an answer that reaches
  the end of the context ends there ("length").
- `truncate-middle`: a chat request's system and developer messages and its latest turns are
  kept; whole messages are dropped from the middle, oldest first, until the prompt leaves room
  for max_tokens (for half the context where max_tokens asks more). The metrics say how many
  messages and prompt tokens were dropped.
- `rolling`: a prompt must fit as with `refuse`; the answer goes on past the end of the context
  over a sliding window, as mlx-lm's RotatingKVCache(max_size=limit, keep=ROLLING_KEEP) would
  (worker/batch/slots.py, Rolling). Only where every layer is full attention: a recurrent layer's
  state holds all of the history, which no window can drop (hybrid models such as qwen3_5), and
  a model's own sliding-window layers already mask another way; those refuse it by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import msgspec

from protocol import messages as m
from protocol.schema import message_text
from worker.batch.slotbatch import slot_layers
from worker.batch.slots import Rolling, SlotKV

KEPT_ROLES = ("system", "developer")


class ContextRefused(Exception):
    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class Fitted:
    """A request as it is served: its (truncated) messages and its prompt's tokens."""

    req: m.GenerateRequest
    prompt: list[int]
    dropped_messages: int = 0
    dropped_tokens: int = 0


ROLLING_KEEP = 4  # the first positions a rolling window keeps: mlx-lm's make_prompt_cache(max_kv_size=...)


def rolling_refusal(model) -> Optional[str]:
    """Why `rolling` is not sound for this model (None: it is)."""
    layers = slot_layers(model)
    if not all(isinstance(x, SlotKV) for x in layers):
        return ("`context_overflow` \"rolling\" is not supported for this model: its recurrent layers keep "
                "all of the history in their state, which no window can drop (a hybrid model)")
    if any(x.window is not None for x in layers):
        return "`context_overflow` \"rolling\" is not supported for this model: it has sliding-window layers of its own"
    return None


class ContextPolicy:
    def __init__(self, limit: int, default: str, render: Callable[[m.GenerateRequest], list[int]], count_text,
                 rolling_refused: Optional[str] = None):
        """`render(req)`: the prompt's tokens (raises the engine's refusal); `count_text(text)`: tokens
        of a text; `rolling_refused`: why this model cannot roll (None: it can)."""
        self.limit, self.default, self.render, self.count_text = limit, default, render, count_text
        self.rolling_refused = rolling_refused

    def policy(self, req: m.GenerateRequest) -> str:
        return req.context_overflow or self.default

    def fit(self, req: m.GenerateRequest) -> Fitted:
        """The request's prompt within the context by its policy, or ContextRefused."""
        policy = self.policy(req)
        if policy == "rolling" and self.rolling_refused:
            raise ContextRefused("context_policy_unsupported", self.rolling_refused, "context_overflow")
        prompt = self.render(req)
        if policy == "truncate-middle" and req.messages is not None and len(prompt) + self.room(req) > self.limit:
            return self._truncated(req, prompt)
        if len(prompt) >= self.limit:
            raise self._refusal(req, len(prompt))
        return Fitted(req, prompt)

    def rolling(self, req: m.GenerateRequest) -> Optional[Rolling]:
        """The window of a request that rolls past the context (None: it ends there)."""
        return Rolling(self.limit, ROLLING_KEEP) if self.policy(req) == "rolling" else None

    def room(self, req: m.GenerateRequest) -> int:
        """Tokens truncation leaves for the answer: max_tokens, at most half the context."""
        return min(req.max_tokens or self.limit // 2, self.limit // 2)

    def _refusal(self, req: m.GenerateRequest, n: int, note: str = "") -> ContextRefused:
        return ContextRefused("context_length_exceeded", f"the prompt has {n} tokens; this server's context limit "
                              f"is {self.limit}{note}", "messages" if req.messages is not None else "prompt")

    def _truncated(self, req: m.GenerateRequest, prompt: list[int]) -> Fitted:
        """Drops the fewest oldest middle messages (never a system one, never the last) that make
        the prompt fit with room for the answer; a tool result whose call went goes with it."""
        middle = [i for i, x in enumerate(req.messages[:-1]) if x.role not in KEPT_ROLES]
        budget = self.limit - self.room(req)
        k = self._estimate(req, middle, len(prompt) - budget, len(prompt))
        best = None
        while 0 <= k <= len(middle):  # from the estimate: down while it fits, else up until it does
            fitted = self._without(req, middle, k, len(prompt))
            if fitted is not None and len(fitted.prompt) <= budget:
                best, k = fitted, k - 1
            elif best is not None:
                return best
            else:
                k += 1
        if best is not None:
            return best
        raise self._refusal(req, len(prompt), f", and dropping every message between the system messages and the "
                                              f"last one leaves no room for {self.room(req)} tokens of answer")

    def _estimate(self, req: m.GenerateRequest, middle: list[int], excess: int, total: int) -> int:
        """Messages to drop by their text's tokens and the template's share of each."""
        texts = [self.count_text(message_text(x)) for x in req.messages]
        share = max(0, total - sum(texts)) / len(req.messages)
        dropped = 0.0
        for k, i in enumerate(middle):
            dropped += texts[i] + share
            if dropped >= excess:
                return k + 1
        return len(middle)

    def _without(self, req: m.GenerateRequest, middle: list[int], k: int, total: int) -> Optional[Fitted]:
        """The request without its first k middle messages (and tool results left without their
        call); None where the template refuses what is left."""
        while k < len(middle) and req.messages[middle[k]].role == "tool":
            k += 1
        drop = set(middle[:k])
        cut = msgspec.structs.replace(req, messages=[x for i, x in enumerate(req.messages) if i not in drop])
        try:
            shorter = self.render(cut)
        except Exception:  # a template that refuses this order of turns
            return None
        return Fitted(cut, shorter, len(drop), total - len(shorter))
