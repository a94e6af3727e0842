"""Grammar-constrained decoding with llguidance: a request's grammar (its JSON schema, any JSON
object, or a call of its tools) becomes a logits processor that masks every token the grammar
cannot take next, so the output parses whatever the model's logits say.

Compiling a grammar against the served tokenizer is the dear part (a schema of 10,000 required
properties: about 1.5 s on a CPU core); `Compiler.compile` does it once per distinct request
grammar (cached by the hash of the fields that make it, failures too), within llguidance's limits
on work and lexer states (LIMITS), and each request's matcher is a copy of the compiled one.
worker/proc.py runs the compiles on a small pool of threads, never on the jobs or decode thread.

The processor is a function of its context alone (the tokens through the position's input): it
moves its matcher to the tokens generated so far, rolling back those a joint verify rejected, so
a baseline row, each joint verify position and a pipelined look-ahead all get their own prefix's
mask, and constrained joint greedy output equals constrained baseline greedy output.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Optional

import llguidance
import llguidance.hf
import mlx.core as mx
import msgspec
import numpy as np

from protocol import messages as m
from protocol.tool_rules import needs_grammar
from worker import tools

# compact JSON: no free whitespace for a weak model to loop in
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# What one grammar may cost (llguidance's own accounting). Lexer states take memory (1-2 kB each:
# 100,000 is at most ~200 MB); fuel is work (the lexer's construction ~50k a ms; each token's mask
# ~14k a ms, on the decode thread); the grammar's size bounds the rest. A schema of 10,000 required
# properties fits (max_grammar_size 500,000, llguidance's default; see docs/design.md).
LIMITS = dict(max_lexer_states=100_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_grammar_size=500_000, verbose_errors=False)
# llguidance's words for each limit, and the limit's name in a refusal
LIMIT_WORDS = {"initial lexer configuration": "initial_lexer_fuel (the work of compiling it)",
               "grammar size": "max_grammar_size", "lexer states": "max_lexer_states (memory)",
               "too many items": "step_max_items", "too many expressions": "step_lexer_fuel",
               "schema too large": "llguidance's own bound on a JSON schema's grammar"}
CACHED = 16  # compiled grammars kept (least recently used dropped first)
CACHED_TEXT = 4 << 20  # and at most this much grammar text among them (~80 bytes of memory a byte)


class GrammarInvalid(Exception):
    """A schema the grammar compiler refuses (HTTP 400 naming `param`; `code` invalid_schema, or
    grammar_too_large for one past LIMITS)."""

    def __init__(self, message: str, param: str, code: str = "invalid_schema"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class Grammar:
    """A grammar; compiled, `matcher` holds its matcher in the start state (each request gets a
    copy) and `compile_s` what compiling it took. `what` names it in errors."""

    text: str
    what: str
    matcher: Optional[llguidance.LLMatcher] = field(default=None, compare=False, repr=False)
    compile_s: float = 0.0


def json_grammar(schema: dict, strict: bool, param: str) -> str:
    """A JSON schema's grammar; `strict`: a keyword the grammar cannot enforce is an error
    (else it is ignored, as llguidance's lenient mode does)."""
    if not isinstance(schema, dict):
        raise GrammarInvalid(f"`{param}` must be a JSON schema object", param)
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": not strict})
    except (ValueError, TypeError) as e:
        raise GrammarInvalid(f"`{param}` is not a usable JSON schema: {e}", param) from None
    is_error, notes = llguidance.LLMatcher.validate_grammar_with_warnings(
        text, limits=llguidance.LLParserLimits(**LIMITS))
    if is_error:
        raise _refusal("; ".join(notes), param)
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


def request_grammar(req: m.GenerateRequest, native: bool = False) -> Optional[Grammar]:
    """The grammar a request's output must follow: a required or named tool call; else its
    response_format (json_object or json_schema), or, with tools on "auto", a call or that
    format's JSON; None for free text. `native`: the template's own tool format (worker/tools.py)."""
    answer = _answer(req)
    call = tools.call_grammar(req, lambda schema, param: json_grammar(schema, False, param),
                              None if answer is None else answer.inline, native)
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


def grammar_key(req: m.GenerateRequest) -> Optional[str]:
    """The hash of the fields a request's grammar is made of; None when its text is free."""
    if not needs_grammar(req):
        return None
    parts = (req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)
    return hashlib.sha256(msgspec.msgpack.encode(parts)).hexdigest()


class Compiler:
    """Grammars compiled and matched against the served tokenizer: its llguidance view is built at
    the first constrained request (about 0.9 s for a 49k vocabulary on a CPU), not at start.
    `compile` may run on any thread; a grammar compiled (or refused) once is kept by its key."""

    def __init__(self, tokenizer):
        self.served = tokenizer
        self._view: Optional[llguidance.LLTokenizer] = None
        self._lock = threading.Lock()
        self._done: OrderedDict[str, Grammar | GrammarInvalid] = OrderedDict()
        self._running: dict[str, Future] = {}  # key -> the compile under way, for requests that share it

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._view is None:
                hf = getattr(self.served, "_tokenizer", self.served)
                self._view = llguidance.hf.from_tokenizer(hf, eos_token=sorted(self.served.eos_token_ids))
            return self._view

    def ready(self, req: m.GenerateRequest) -> bool:
        """Its grammar needs no compiling now (none, or kept): compile(req) returns at once."""
        key = grammar_key(req)
        with self._lock:
            return key is None or key in self._done

    def compile(self, req: m.GenerateRequest) -> Optional[Grammar]:
        """The request's grammar, compiled and checked (GrammarInvalid naming the schema or the
        limit); one compile for every request with the same key, the first's."""
        key = grammar_key(req)
        if key is None:
            return None
        with self._lock:
            done = self._done.get(key)
            if done is not None:
                self._done.move_to_end(key)
            running, mine = self._running.get(key), None
            if done is None and running is None:
                mine = self._running[key] = Future()
        if done is None and running is not None:
            done = running.result()
        if done is None:
            done = self._build(req)
            self._keep(key, done)
            mine.set_result(done)
        if isinstance(done, GrammarInvalid):  # a fresh one each time: a kept one would gather tracebacks
            raise GrammarInvalid(done.message, done.param, done.code) from None
        return done

    def _build(self, req: m.GenerateRequest) -> Grammar | GrammarInvalid:
        t0 = time.perf_counter()
        try:
            grammar = request_grammar(req, tools.native(self.served))
            matcher = llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0,
                                           limits=llguidance.LLParserLimits(**LIMITS))
        except GrammarInvalid as e:
            return e
        if matcher.is_error():
            return _refusal(matcher.get_error(), grammar.what)
        return replace(grammar, matcher=matcher, compile_s=time.perf_counter() - t0)

    def _keep(self, key: str, done: Grammar | GrammarInvalid) -> None:
        with self._lock:
            self._running.pop(key, None)
            self._done[key] = done
            size = lambda x: len(x.text) if isinstance(x, Grammar) else 0  # noqa: E731
            while len(self._done) > CACHED or sum(size(x) for x in self._done.values()) > CACHED_TEXT:
                if len(self._done) == 1:
                    break
                self._done.popitem(last=False)

    def processor(self, grammar: Grammar) -> "GrammarMask":
        """A request's mask: a copy of its compiled matcher (cheap, on the decode thread)."""
        matcher = grammar.matcher
        if matcher is None:  # compiled elsewhere than compile(): do it here
            matcher = llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0,
                                           limits=llguidance.LLParserLimits(**LIMITS))
        return GrammarMask(matcher.deep_copy(), self.tokenizer.vocab_size, self.tokenizer.eos_token)


def _refusal(error: str, what: str) -> GrammarInvalid:
    """A compile error: past one of LIMITS (named), or a grammar the tokenizer cannot serve."""
    limit = next((name for words, name in LIMIT_WORDS.items() if words in error.lower()), None)
    if limit is not None:
        return GrammarInvalid(f"`{what}` is too large to enforce: it exceeds the grammar compiler's limit "
                              f"{limit} ({error.strip()})", what, "grammar_too_large")
    return GrammarInvalid(f"`{what}` cannot be enforced: {error.strip()}", what)


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
