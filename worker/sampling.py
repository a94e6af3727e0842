"""Per-request sampling on mlx-lm's sampling functions, reproducible under concurrency.

mlx-lm's samplers draw from MLX's global random state, which interleaved requests would
share; here each request owns a key and splits it once per token. A request's `RowSampling`
carries its sampler and its logits processors (mlx-lm's `(tokens, logits) -> logits`): the
baseline batch gives them to its row, the joint cycle applies them to each verify position.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_logits_processors

from protocol.messages import GenerateRequest, SamplingDefaults
from protocol.schema import top_logprobs

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
GREEDY_BELOW = 1e-5  # a temperature under this is greedy decoding (1/T overflows long before 0)
PENALTY_CONTEXT = 20  # tokens (prompt included) the penalties look back over: mlx-lm's default


@dataclass(frozen=True)
class SamplingParams:
    """The truncation and temperature every sampled token goes through (0 for top_k: off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def truncate(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's make_sampler chain, in its order: top-p, min-p, top-k (masked to -inf)."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def make_request_sampler(params: SamplingParams, seed: Optional[int]) -> Sampler:
    """A sampler with the request's own key (greedy below GREEDY_BELOW)."""
    if params.greedy:
        return greedy_sampler
    state = [mx.random.key(seed if seed is not None else secrets.randbits(63))]
    inv_temp = 1.0 / params.temperature

    def sampler(logprobs: mx.array) -> mx.array:
        state[0], sub = mx.random.split(state[0])
        return mx.random.categorical(truncate(logprobs, params) * inv_temp, key=sub)

    return sampler


@dataclass
class RowSampling:
    """One request's sampling, handed to the row that decodes it. `processors` run in order on
    the logits before the log-softmax (other processors, such as a grammar mask, append here).
    `logprobs`: alternatives wanted per emitted token (None: no log-probabilities at all)."""

    params: SamplingParams = SamplingParams()
    seed: Optional[int] = None
    processors: list[LogitsProcessor] = field(default_factory=list)
    logprobs: Optional[int] = None
    sampler: Sampler = field(init=False)

    def __post_init__(self):
        self.sampler = make_request_sampler(self.params, self.seed)


def penalty_processors(repetition: Optional[float], presence: Optional[float], frequency: Optional[float],
                       logit_bias: Optional[dict[int, float]]) -> list[LogitsProcessor]:
    """mlx-lm's processors for the OpenAI penalties and logit_bias (neutral values add none)."""
    return make_logits_processors(
        logit_bias=logit_bias or None,
        repetition_penalty=None if repetition in (None, 1.0) else repetition, repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=presence or None, presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=frequency or None, frequency_context_size=PENALTY_CONTEXT)


def process(processors: list[LogitsProcessor], context: mx.array, logits: mx.array) -> mx.array:
    """Logits [L, V] of the positions whose inputs are the last L tokens of `context` [N]: each
    row gets the processors with the context through its own input, as one-token decoding would."""
    if not processors:
        return logits
    n, rows = context.shape[0], []
    for i in range(logits.shape[0]):
        row, ctx = logits[i : i + 1], context[: n - logits.shape[0] + 1 + i]
        for p in processors:
            row = p(ctx, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass
class Chosen:
    """An emitted token's log-probability and the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def chosen(logprobs: mx.array, token: int, top: int) -> Chosen:
    """From one position's log-probabilities [V] (after the processors, before temperature)."""
    logprobs = logprobs.reshape(-1).astype(mx.float32)
    best = mx.argsort(-logprobs)[:top].tolist() if top else []
    values = logprobs[mx.array(best + [token])].tolist()
    return Chosen(token, values[-1], list(zip(best, values[:-1])))


class SamplingInvalid(ValueError):
    """A sampling field the model cannot take (a logit_bias token outside its vocabulary)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def sampling_for(req: GenerateRequest, defaults: SamplingDefaults, vocab_size: int) -> RowSampling:
    """The request's RowSampling; first fills its omitted sampling fields from `defaults`."""
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(req, name) is None:
            setattr(req, name, getattr(defaults, name))
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    outside = [t for t in bias if t >= vocab_size]
    if outside:
        raise SamplingInvalid(f"`logit_bias` names token {outside[0]}, outside this model's vocabulary of "
                              f"{vocab_size}", "logit_bias")
    params = SamplingParams(req.temperature, req.top_p, req.top_k, req.min_p)
    processors = penalty_processors(req.repetition_penalty, req.presence_penalty, req.frequency_penalty, bias)
    return RowSampling(params, req.seed, processors, top_logprobs(req))
