"""Every message that crosses a process boundary, as msgspec Structs.

Wire messages are tagged by class name so one decoder per socket dispatches by type.
Nothing here imports MLX or aiohttp.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from msgspec import Meta, Struct

PROTOCOL_VERSION = 1

Role = Literal["system", "developer", "user", "assistant", "tool"]
Mode = Literal["baseline", "joint"]
ContextOverflow = Literal["refuse", "truncate-middle", "rolling"]  # docs/memory.md
FinishReason = Literal["stop", "length", "cancelled", "error"]


# ---- the one request schema (CLI, web UI and OpenAI API all send this) ----


class ContentPart(Struct, forbid_unknown_fields=True):
    """One part of a message's `content` list: `text` (or an assistant's `refusal`) is served;
    the other OpenAI part types are decoded only to be refused by name."""

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(Struct, forbid_unknown_fields=True):
    role: Role
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    refusal: Optional[str] = None  # an assistant turn that refused: rendered as its content
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers
    # an assistant turn's thinking, as a reply carried it (the template decides whether to render it)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class FunctionDef(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None


class Tool(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
# how a call appears in generated text (Hermes/Qwen's format; worker/tools.py renders it, the gateway parses it)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class JsonSchemaFormat(Struct, forbid_unknown_fields=True, rename={"schema_": "schema"}):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = None  # the JSON schema (absent: any JSON object)
    strict: Optional[bool] = None  # true: a keyword the grammar cannot enforce is refused, not ignored


class ResponseFormat(Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatTemplateKwargs(Struct, forbid_unknown_fields=True):
    """vLLM's `chat_template_kwargs`: the one key verity passes to the template (another: 400 by name)."""

    enable_thinking: Optional[bool] = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
THINKING_OFF_EFFORTS = ("none", "minimal")  # reasoning_effort values that switch thinking off


TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Prompt = Union[str, list[Union[str, TokenId, list[TokenId]]]]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
MAX_N = 8  # choices per prompt (each one a row of the batch)
MAX_TOP_LOGPROBS = 20


class GenerateRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI chat/completions fields verity implements, plus its own extensions. Every
    optional field takes null for its default; an omitted sampling field (None) gets the
    server's default (worker/defaults.py).

    Exactly one of `messages` (chat) and `prompt` (raw completion) is set. What reaches the
    worker has one prompt (a string or token ids) and n of 1: the gateway splits the rest.
    Range rules live in protocol.schema.check_request.
    """

    model: Optional[str] = None
    messages: Optional[list[Message]] = None
    prompt: Optional[Prompt] = None
    max_tokens: Optional[Annotated[int, Meta(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Meta(ge=1)]] = None
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Meta(ge=0)]] = None  # 0: off
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    repetition_penalty: Optional[Annotated[float, Meta(gt=0.0, le=10.0)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Annotated[float, Meta(ge=-100.0, le=100.0)]]] = None
    logprobs: Union[bool, Annotated[int, Meta(ge=0, le=5)], None] = None  # chat: a bool; completions: 0-5 alternatives
    top_logprobs: Optional[Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    n: Optional[Annotated[int, Meta(ge=1, le=MAX_N)]] = 1  # null: 1 (check_request normalizes every null to its default)
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    seed: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None  # json_object, json_schema: grammar-constrained (worker/grammar.py)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None  # null: "auto" with tools, else "none"
    parallel_tool_calls: Optional[bool] = None  # null: true
    # OpenAI fields accepted only as null (or their neutral value): protocol.schema.NULL_ONLY
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Optional[ReasoningEffort] = None  # none/minimal: thinking off; the others on
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None  # enable_thinking: as `thinking`
    web_search_options: Any = None
    best_of: Optional[Annotated[int, Meta(ge=1)]] = None
    functions: Any = None  # deprecated for `tools`
    function_call: Any = None
    verbosity: Any = None
    safety_identifier: Optional[str] = None  # accepted, unused (as `user`)
    prompt_cache_key: Optional[str] = None  # accepted, unused: prefix reuse is automatic
    # verity's own
    mode: Optional[Mode] = "baseline"
    thinking: Optional[bool] = None  # a thinking model's think block: None the model's default (check_request resolves the aliases)
    max_thinking_tokens: Optional[Annotated[int, Meta(ge=0)]] = None  # tokens inside the think block, then it is closed
    ignore_eos: Optional[bool] = False
    context_overflow: Optional[ContextOverflow] = None  # a request past the context (null: the server's --context-overflow)


# ---- gateway -> worker ----


class SubmitRequest(Struct, tag=True):
    request_id: str
    request: GenerateRequest  # normalized by protocol.schema (max_tokens resolved, stop a list)
    gateway_pid: int = 0  # the gateway that admitted it: a restarted gateway disowns the dead one's


class TokenizeJob(Struct, tag=True):
    """gateway -> worker, on the jobs socket: /tokenize (`request`: messages through the chat
    template, or a prompt string) or /detokenize (`tokens`); answered by a Tokens event."""

    request_id: str
    request: Optional[GenerateRequest] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tokens: Optional[list[int]] = None
    token_strs: bool = False  # each token's own text too


class CancelRequest(Struct, tag=True):
    request_id: str


class DropOrphans(Struct, tag=True):
    """gateway -> worker, on each worker READY: stop every request that another gateway submitted
    (a gateway that died, whose clients are gone with it)."""

    gateway_pid: int


# ---- handshake and supervision ----


class SamplingDefaults(Struct, frozen=True):
    """What a request that omits a sampling field gets (launch-stack's flags, else the model's
    generation_config.json, else its card's recommendation, else OpenAI's neutral values)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: Optional[int] = None  # None: until the context is full, within --max-tokens-cap
    source: str = "openai"  # where the sampling values came from: flags, generation_config, model_card, openai


class Ready(Struct, tag=True):
    process: str  # "worker" | "gateway" | "cache"
    pid: int
    protocol_version: int = PROTOCOL_VERSION
    model_id: str = ""
    cache_identity: str = ""
    context_limit: int = 0
    joint_available: bool = False
    draft_id: Optional[str] = None
    url: str = ""
    defaults: SamplingDefaults = SamplingDefaults()
    max_active: int = 0  # a worker's: requests it decodes at once
    thinks: bool = False  # the model's chat template thinks (<think>...</think>, worker/thinking.py)
    max_thinking_tokens: Optional[int] = None  # the worker's default thinking budget (None: none)
    kv_format: str = "native"  # the attention KV's format: "native" (the model's dtype) or e.g. "q4g64" (--kv-bits)


class WorkerDown(Struct, tag=True):
    """launch-stack -> gateway: the worker process exited."""

    pid: int
    exit_code: int


# ---- worker -> gateway events ----


class RequestMetrics(Struct):
    """The `metrics` extension object. Keys and types are fixed."""

    mode: str = "baseline"
    draft: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    ttft_s: float = 0.0
    decode_tps: float = 0.0
    recovery_s: float = 0.0
    budget_mean: float = 0.0
    reasoning_tokens: int = 0  # of completion_tokens, those inside a thinking model's think block
    dropped_messages: int = 0  # context_overflow "truncate-middle": messages left out of the prompt
    dropped_tokens: int = 0  # and the prompt tokens that took away


class Queued(Struct, tag=True):
    """The worker tokenized and queued the request."""

    request_id: str
    prompt_tokens: int
    thinking: bool = False  # the generation starts inside the template's think block (gateway/reasoning.py)


class Started(Struct, tag=True):
    """The request left the waiting line: it will not be resubmitted."""

    request_id: str
    prompt_tokens: int


class TopLogprob(Struct):
    token: str  # the token's own text (bytes that are not UTF-8 alone come out as U+FFFD)
    logprob: float
    bytes: list[int]  # the token's UTF-8 bytes


class TokenLogprob(Struct):
    """An emitted token's log-probability under the target (after logits processors, before
    temperature and truncation) and the most likely tokens at its position."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class TextDelta(Struct, tag=True):
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id, when the request asked
    drafted: Optional[list[bool]] = None  # joint: one per token id, True where the draft proposed it and the target accepted


class Finished(Struct, tag=True):
    request_id: str
    finish_reason: FinishReason
    metrics: RequestMetrics
    stop_sequence: Optional[str] = None  # the stop string that ended it (finish_reason "stop")


class Error(Struct, tag=True):
    """A request-level failure. `status` is the HTTP status it maps to."""

    request_id: str
    code: str
    message: str
    status: int = 500
    param: Optional[str] = None


class Tokens(Struct, tag=True):
    """The answer to a TokenizeJob: the token ids and their text."""

    request_id: str
    tokens: list[int]
    text: str
    token_strs: Optional[list[str]] = None


Event = Union[Queued, Started, TextDelta, Finished, Error, Tokens]


class EventBatch(Struct, tag=True):
    """All events of one engine step, sent as one message."""

    worker_pid: int
    events: list[Event]


class RankStatus(Struct):
    """A rank of a distributed worker group (launch-stack --ranks/--hostfile)."""

    rank: int
    pid: int
    host: str


ModelState = Literal["loaded", "unloaded", "loading"]


class StatsSnapshot(Struct, tag=True):
    process: str
    pid: int
    time: float
    queue_depth: int = 0
    active: int = 0
    requests_total: int = 0
    requests_finished: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    tokens_per_s: float = 0.0
    drafted_total: int = 0  # joint decoding, summed over finished requests
    accepted_total: int = 0
    cycles_total: int = 0
    rollbacks_total: int = 0
    recovery_s_total: float = 0.0
    # the reuse cache: cache_bytes None = no cache service (the monitor shows "off")
    cache_bytes: Optional[int] = None
    cache_hits: int = 0
    cache_lookups: int = 0
    cache_entries: int = 0
    cache_budget_bytes: int = 0
    cache_generation_hits: int = 0  # of cache_hits, those on end-of-generation snapshots
    cache_reused_tokens: int = 0
    cache_evictions: int = 0
    ranks: list[RankStatus] = []  # a distributed worker's ranks (empty: one process)
    # idle unload (--idle-unload-s): the weights' state and its changes since the worker started
    model_state: ModelState = "loaded"
    model_loads_total: int = 0  # reloads after an unload (the start's load is not counted)
    model_unloads_total: int = 0
    model_load_s_total: float = 0.0  # seconds those reloads took


# ---- worker <-> cache service (DEALER -> ROUTER): snapshot metadata and the byte budget ----

SnapshotKind = Literal["boundary", "generation"]  # a verified message boundary, or the end of a generation


class SnapshotMeta(Struct):
    """What the cache service knows of one snapshot; its arrays stay in the worker (or its spill file)."""

    id: str  # hash of identity and tokens: the same prefix under the same identity is the same entry
    identity: str  # model revision, chat template, quantization, thinking mode, draft
    tokens: list[int]  # the exact token prefix the target state holds
    nbytes: int  # KV and recurrent state of target and draft
    kind: SnapshotKind
    last_use: float  # time.time()
    draft_tokens: int = 0  # the draft's state it holds covers tokens[:draft_tokens] (0: none)


class CacheStats(Struct):
    budget: int = 0
    bytes: int = 0  # never above budget
    entries: int = 0
    lookups: int = 0
    hits: int = 0
    generation_hits: int = 0  # of hits, those on end-of-generation snapshots
    reused_tokens: int = 0
    evictions: int = 0


class CacheSync(Struct, tag=True):
    """Everything the worker holds, on first contact with a service (or after either restarted):
    the service replaces its table with it and answers what to drop to fit the budget."""

    seq: int
    entries: list[SnapshotMeta]


class CacheLookup(Struct, tag=True):
    """The longest snapshot that is a verified prefix of `tokens`, leaving at least one to prefill."""

    seq: int
    service_id: str  # the service the worker synced with; another one answers `resync`
    identity: str
    tokens: list[int]
    trimmable: bool  # pure attention: a longer snapshot may be cut back to the common prefix
    draft: bool = False  # a joint request's: of entries giving as many tokens, the one whose draft state gives most


class CacheStore(Struct, tag=True):
    """Asks to keep a new snapshot. The worker keeps nothing before the answer, and drops what
    the answer evicts before it keeps the new one."""

    seq: int
    service_id: str
    entry: SnapshotMeta
    trimmable: bool  # a trimmable entry replaces the entries that are its prefixes


class CacheDrop(Struct, tag=True):
    """The worker lost these (a spill file missing or corrupt)."""

    seq: int
    service_id: str
    ids: list[str]


class CacheStatsRequest(Struct, tag=True):
    """A heartbeat: the answer carries the stats (and says `resync` to a worker it does not know)."""

    seq: int
    service_id: str


class CacheHit(Struct):
    id: str
    length: int  # prompt tokens the snapshot gives: its own length, or less when trimmed


class CacheReply(Struct, tag=True):
    """The one answer to every cache request; each request reads the fields it asked for."""

    seq: int
    service_id: str
    stats: CacheStats
    resync: bool = False  # not the service the worker synced with: sync, then ask again
    hit: Optional[CacheHit] = None  # CacheLookup
    granted: bool = False  # CacheStore: keep the new snapshot
    evict: list[str] = []  # CacheStore, CacheSync: drop these first


# One union per socket direction: decoders reject anything else.
JobMessage = Union[SubmitRequest, TokenizeJob]
ControlMessage = Union[CancelRequest, DropOrphans]
WorkerOutMessage = Union[Ready, EventBatch]
SupervisorMessage = Union[Ready, WorkerDown]
CacheRequest = Union[CacheSync, CacheLookup, CacheStore, CacheDrop, CacheStatsRequest]
CacheServiceMessage = CacheReply

__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "msgspec")]
