"""Prompt rendering and the text side of generation: stop strings over streamed text."""

from __future__ import annotations

from typing import Optional

import msgspec

from protocol import messages as m
from protocol.messages import GenerateRequest
from protocol.schema import message_text
from worker import tools
from worker.thinking import THINK_CLOSE, THINK_OPEN


class PromptInvalid(ValueError):
    """A prompt the model cannot take (a token id outside its vocabulary)."""


def render_prompt(tokenizer, req: GenerateRequest, vocab_size: Optional[int] = None) -> list[int]:
    """Token ids of the request's prompt: the chat template for messages, raw text otherwise,
    or the token ids a completion request sent."""
    if req.messages is not None:
        return _render(tokenizer, req, len(req.messages), add_generation_prompt=True)
    if isinstance(req.prompt, str):
        return list(tokenizer.encode(req.prompt))
    bad = [t for t in req.prompt if vocab_size is not None and t >= vocab_size]
    if bad:
        raise PromptInvalid(f"token id {bad[0]} is outside this model's vocabulary of {vocab_size}")
    return list(req.prompt)


def template_message(msg, template: Optional[str]) -> dict:
    """A message as a chat template takes it: its text, `developer` as `system` where the template
    knows no such role, and `name` passed on (templates that know it render it)."""
    role = "system" if msg.role == "developer" and "developer" not in (template or "") else msg.role
    out = {"role": role, "content": message_text(msg)}
    if msg.name is not None:
        out["name"] = msg.name
    thought = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
    if thought is not None:  # Qwen3's templates render it (or drop it) by their own rules
        out["reasoning_content"] = thought
    return out


def message_boundaries(tokenizer, req: GenerateRequest, prompt: list[int]) -> list[int]:
    """Token indices in `prompt` where the first, the next-to-last and the last message end: the
    template rendered for the first i messages, kept only where its tokens are a prefix of the
    whole prompt (a template may render a message differently once others follow it)."""
    if req.messages is None:
        return []
    n, out = len(req.messages), set()
    for i in {1, n - 1, n} - {0}:
        try:
            ids = _render(tokenizer, req, i, add_generation_prompt=False)
        except Exception:  # a template may refuse a partial conversation
            continue
        if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids:
            out.add(len(ids))
    return sorted(out)


def answer_message(text: str, thinks: bool, inside: bool) -> m.Message:
    """The assistant message a client resends for a reply's `text`: a thinking model's think block
    (open in the prompt: `inside`, or opened at the reply's start) as its reasoning, what follows
    `</think>`, less its leading whitespace, as its content (gateway/reasoning.py's split)."""
    head = text.lstrip()
    opened = thinks and head.startswith(THINK_OPEN)
    if not thinks or not (inside or opened):
        return m.Message("assistant", text)
    reasoning, closed, rest = (head[len(THINK_OPEN):] if opened else text).partition(THINK_CLOSE)
    return m.Message("assistant", rest.lstrip() if closed else "", reasoning_content=reasoning)


def answer_rendered(tokenizer, req: GenerateRequest, answer: m.Message) -> list[int]:
    """The conversation with `answer` as the assistant's next message, as the template renders it
    (no generation prompt): what the next turn's prompt starts with when its client resends the
    answer (a call in the generic format renders as the text that made it)."""
    nxt = msgspec.structs.replace(req, messages=[*req.messages, answer])
    return _render(tokenizer, nxt, len(nxt.messages), add_generation_prompt=False)


def tokenize(tokenizer, job: m.TokenizeJob, vocab_size: int) -> m.Tokens:
    """/tokenize (messages through the chat template, or a prompt string) and /detokenize."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    req = job.request
    if job.tokens is not None:
        bad = [t for t in job.tokens if t >= vocab_size]
        if bad:
            raise PromptInvalid(f"token id {bad[0]} is outside this model's vocabulary of {vocab_size}")
        ids = job.tokens
    elif req.messages is not None:
        ids = _render(tokenizer, req, len(req.messages), job.add_generation_prompt, job.add_special_tokens)
    else:
        ids = list(hf.encode(req.prompt, add_special_tokens=job.add_special_tokens))
    strs = [hf.decode([t]) for t in ids] if job.token_strs else None
    return m.Tokens(job.request_id, ids, hf.decode(ids), strs)


def _render(tokenizer, req: GenerateRequest, n_messages: int, add_generation_prompt: bool,
            add_special_tokens: bool = False) -> list[int]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper would force a thinking default
    template = getattr(hf, "chat_template", None)
    msgs = [template_message(m, template if isinstance(template, str) else None) for m in req.messages[:n_messages]]
    msgs, kwargs = tools.render(tokenizer, req, msgs, req.messages[:n_messages])
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking
    text = hf.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class StopMatcher:
    """Finds stop strings in streamed text, holding back only a tail that may start one."""

    def __init__(self, stops: Optional[list[str]]):
        self.stops = stops or []
        self.pending = ""
        self.hit: Optional[str] = None  # the stop string found (the first in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda h: h[0])
            self.pending = ""
            return buf[:at], True
        keep = self._partial_tail(buf)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


class StreamingDetokenizer:
    """Incremental decoding that never splits a UTF-8 character.

    Decodes a short window twice (with and without the newest tokens) and emits the
    difference, as TGI and vLLM do; the prompt's last tokens seed the window so that a
    continuation keeps its leading space.
    """

    CONTEXT = 4

    def __init__(self, tokenizer, prompt: list[int]):
        self._decode = getattr(tokenizer, "_tokenizer", tokenizer).decode
        self.ids = list(prompt[-self.CONTEXT :])
        self.prefix, self.read = 0, len(self.ids)

    def text_of(self, ids: list[int]) -> str:
        """Token ids as text, decoded whole (echo's prompt)."""
        return self._decode(ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(before) and (final or not text.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before) :]
        return ""
