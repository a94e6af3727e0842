"""Thinking models: whether the served model thinks, where a request's generation starts, and
the think block's budget.

A model thinks when its chat template writes both `<think>` and `</think>` and its tokenizer knows
each as one token (Qwen3, Qwen3.5, DeepSeek-R1's distills; read from the template, never a model
name). Its template takes `enable_thinking` (worker/text.py passes the request's `thinking`).
A Qwen3.5 template opens `<think>\\n` at the end of the generation prompt; a Qwen3 one leaves the
model to write `<think>` itself; with thinking off both render an empty, closed block.

`ThinkGate` is a logits processor, a function of its context alone like the grammar's mask (so a
baseline row, each joint verify position and the draft's proposals agree): after `budget` tokens
inside the block it forces `</think>` and then the template's separator; and it holds back the
processors of the answer (a grammar) until the separator is written, so thinking is free text and
the answer is constrained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from worker.sampling import LogitsProcessor

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DEFAULT_SEPARATOR = "\n\n"  # after `</think>`, where the template's empty block does not say
TAIL = 8  # prompt tokens read for an open block: the generation prompt's own


@dataclass(frozen=True)
class ThinkFormat:
    open_id: int
    close_id: int
    separator: tuple[int, ...]  # tokens the template writes between `</think>` and the answer
    opens_in_prompt: bool  # the generation prompt opens the block (the model never writes `<think>`)


def detect(tokenizer, template: Optional[str]) -> Optional[ThinkFormat]:
    """The served model's think format, or None when it does not think."""
    if not isinstance(template, str) or THINK_OPEN not in template or THINK_CLOSE not in template:
        return None
    vocab = tokenizer.get_vocab()
    if THINK_OPEN not in vocab or THINK_CLOSE not in vocab:
        return None
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper would force a thinking default
    msgs = [{"role": "user", "content": "hi"}]
    try:
        on = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        off = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    except Exception:  # a template that cannot render a plain turn: no thinking split
        return None
    sep = off.rsplit(THINK_CLOSE, 1)[1] if THINK_CLOSE in off else DEFAULT_SEPARATOR
    sep_ids = tuple(tokenizer.encode(sep or DEFAULT_SEPARATOR, add_special_tokens=False))
    opens = on.rstrip().endswith(THINK_OPEN)
    return ThinkFormat(vocab[THINK_OPEN], vocab[THINK_CLOSE], sep_ids, opens)


def starts_inside(fmt: Optional[ThinkFormat], prompt: list[int]) -> bool:
    """The prompt's generation prompt leaves a think block open."""
    if fmt is None:
        return False
    tail = prompt[-TAIL:]
    if fmt.open_id not in tail:
        return False
    last_open = len(tail) - 1 - tail[::-1].index(fmt.open_id)
    return fmt.close_id not in tail[last_open:]


class ThinkGate:
    """mlx-lm's `(tokens, logits) -> logits` for one request: the think block's budget, and the
    answer's processors (`after`) from the first token after the block and its separator.
    `inside`: the prompt opened the block; `may_open`: the model may open it with its first token."""

    def __init__(self, fmt: ThinkFormat, prompt_len: int, inside: bool, may_open: bool,
                 budget: Optional[int], after: list[LogitsProcessor]):
        self.fmt, self.base, self.inside, self.may_open = fmt, prompt_len, inside, may_open
        self.budget, self.after = budget, after
        for p in after:  # a grammar's mask reads the answer alone: its tokens from index 0
            if hasattr(p, "base"):
                p.base = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        gen = tokens[self.base:].tolist()
        start = 0 if self.inside else (1 if gen[:1] == [self.fmt.open_id] else None)
        if start is None:
            if not gen and self.may_open:  # the first token: the block, or the answer
                return mx.maximum(self._answer(tokens[self.base:], logits), self._only(self.fmt.open_id, logits))
            return self._answer(tokens[self.base:], logits)
        try:
            close = gen.index(self.fmt.close_id, start)
        except ValueError:
            if self.budget is not None and len(gen) - start >= self.budget:
                return self._only(self.fmt.close_id, logits)
            return logits
        written = len(gen) - close - 1  # of the separator
        if written < len(self.fmt.separator):
            return self._only(self.fmt.separator[written], logits)
        return self._answer(tokens[self.base + close + 1 + len(self.fmt.separator):], logits)

    def _answer(self, answer: mx.array, logits: mx.array) -> mx.array:
        for p in self.after:
            logits = p(answer, logits)
        return logits

    @staticmethod
    def _only(token: int, logits: mx.array) -> mx.array:
        keep = mx.arange(logits.shape[-1]) == token
        return mx.where(keep, logits, mx.array(-mx.inf, logits.dtype))


def reasoning_tokens(fmt: Optional[ThinkFormat], inside: bool, tokens: list[int]) -> int:
    """Generated tokens inside the think block (its tags not counted)."""
    if fmt is None:
        return 0
    start = 0 if inside else (1 if tokens[:1] == [fmt.open_id] else None)
    if start is None:
        return 0
    try:
        return tokens.index(fmt.close_id, start) - start
    except ValueError:
        return len(tokens) - start


def gate(fmt: Optional[ThinkFormat], prompt: list[int], thinking: Optional[bool], budget: Optional[int],
         after: list[LogitsProcessor]) -> list[LogitsProcessor]:
    """The processors a request's answer ends with: `after` alone (no think block can open, or
    nothing to enforce), else one ThinkGate holding them."""
    if fmt is None or thinking is False:
        return after
    inside = starts_inside(fmt, prompt)
    may_open = not inside and not fmt.opens_in_prompt and not _closed_at_end(fmt, prompt)
    if not (inside or may_open) or (budget is None and not after):
        return after
    return [ThinkGate(fmt, len(prompt), inside, may_open, budget, after)]


def _closed_at_end(fmt: ThinkFormat, prompt: list[int]) -> bool:
    """The generation prompt already holds a closed (empty) block."""
    return fmt.close_id in prompt[-TAIL:]
