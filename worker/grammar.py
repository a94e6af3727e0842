"""Grammar-constrained decoding with llguidance: a request's grammar (its JSON schema, any JSON
object, or a call of its tools) becomes a logits processor that masks every token the grammar
cannot take next, so the output parses whatever the model's logits say.

The processor is a function of its context alone (the tokens through the position's input): it
moves its matcher to the tokens generated so far, rolling back those a joint verify rejected, so
a baseline row, each joint verify position and a pipelined look-ahead all get their own prefix's
mask, and constrained joint greedy output equals constrained baseline greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from protocol import messages as m
from worker import tools

# compact JSON: no free whitespace for a weak model to loop in
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarInvalid(Exception):
    """A schema the grammar compiler refuses (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, checked against the served tokenizer; `what` names it in errors."""

    text: str
    what: str


def json_grammar(schema: dict, strict: bool, param: str) -> str:
    """A JSON schema's grammar; `strict`: a keyword the grammar cannot enforce is an error
    (else it is ignored, as llguidance's lenient mode does)."""
    if not isinstance(schema, dict):
        raise GrammarInvalid(f"`{param}` must be a JSON schema object", param)
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": not strict})
    except (ValueError, TypeError) as e:
        raise GrammarInvalid(f"`{param}` is not a usable JSON schema: {e}", param) from None
    is_error, notes = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise GrammarInvalid(f"`{param}` cannot be enforced: {'; '.join(notes)}", param)
    return text


@dataclass(frozen=True)
class Answer:
    """What response_format asks the text to be: a JSON schema (`param` names it in errors)."""

    schema: dict
    param: str
    strict: bool
    text: str = ""  # its grammar alone

    @property
    def inline(self) -> dict:
        """The schema with its compile options, for a lark grammar's `%json`."""
        return {**self.schema, "x-guidance": {**JSON_OPTIONS, "lenient": not self.strict}}


def request_grammar(req: m.GenerateRequest) -> Optional[Grammar]:
    """The grammar a request's output must follow: a required or named tool call; else its
    response_format (json_object or json_schema), or, with tools on "auto", a call or that
    format's JSON; None for free text."""
    answer = _answer(req)
    call = tools.call_grammar(req, lambda schema, param: json_grammar(schema, False, param),
                              None if answer is None else answer.inline)
    if call is not None:
        return Grammar(llguidance.LLMatcher.grammar_from_lark(call), "tools")
    if answer is None:
        return None
    return Grammar(answer.text, answer.param)


def _answer(req: m.GenerateRequest) -> Optional[Answer]:
    """response_format's schema, checked; None for text."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        answer = Answer({"type": "object"}, "response_format", True)
    else:
        spec = rf.json_schema
        answer = Answer(spec.schema_ if spec.schema_ is not None else {"type": "object"},
                        "response_format.json_schema.schema", bool(spec.strict))
    return replace(answer, text=json_grammar(answer.schema, answer.strict, answer.param))  # refuses an unusable one by name


class Compiler:
    """Grammars checked and matched against the served tokenizer: its llguidance view is built at
    the first constrained request (about 0.9 s for a 49k vocabulary on a CPU), not at start."""

    def __init__(self, tokenizer):
        self.served = tokenizer
        self._view: Optional[llguidance.LLTokenizer] = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._view is None:
            hf = getattr(self.served, "_tokenizer", self.served)
            self._view = llguidance.hf.from_tokenizer(hf, eos_token=sorted(self.served.eos_token_ids))
        return self._view

    def check(self, grammar: Grammar) -> None:
        is_error, notes = llguidance.LLMatcher.validate_grammar_with_warnings(grammar.text, self.tokenizer)
        if is_error:
            raise GrammarInvalid(f"`{grammar.what}` cannot be enforced: {'; '.join(notes)}", grammar.what)

    def processor(self, grammar: Grammar) -> "GrammarMask":
        return GrammarMask(llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0),
                           self.tokenizer.vocab_size, self.tokenizer.eos_token)


class GrammarMask:
    """mlx-lm's logits processor `(tokens, logits) -> logits` for one request: -inf on every
    token its grammar forbids after the generated tokens in `tokens`. The first call's context
    is the prompt (every decoder calls it first for the first token)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos: int):
        self.matcher, self.vocab, self.eos = matcher, vocab, eos
        self.base: Optional[int] = None  # the prompt's length
        self.fed: list[int] = []  # the generated tokens the matcher has consumed

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        context = tokens.tolist()
        if self.base is None:
            self.base = len(context)
        self._move_to(context[self.base :])
        return mx.where(mx.array(self._allowed(logits.shape[-1])), logits, mx.array(-mx.inf, logits.dtype))

    def _move_to(self, generated: list[int]) -> None:
        """Rolls back to the common prefix and consumes the rest (stopping at a token the grammar
        refuses: a rejected draft, whose later positions are never used)."""
        same = 0
        while same < min(len(generated), len(self.fed)) and generated[same] == self.fed[same]:
            same += 1
        if same < len(self.fed):
            self.matcher.rollback(len(self.fed) - same)
            del self.fed[same:]
        new = generated[same:]
        if new and not self.matcher.is_stopped():
            taken = self.matcher.try_consume_tokens(new)
            self.fed += new[:taken]

    def _allowed(self, width: int) -> np.ndarray:
        """The mask over `width` logits (a model's padded vocabulary past the tokenizer's is
        forbidden); only EOS once the grammar is done or broken."""
        allowed = np.zeros(width, dtype=bool)
        if self.matcher.is_error() or self.matcher.is_stopped():
            allowed[self.eos] = True
            return allowed
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(width, self.vocab)
        allowed[:n] = bits[:n].astype(bool)
        if not allowed.any():
            allowed[self.eos] = True
        return allowed
