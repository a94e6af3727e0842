"""Exact prefix reuse, as plain calls the engine makes on the MLX thread.

A request's caches start from the longest snapshot the cache service finds for its identity
(restored into a private copy), are prefilled up to each verified message boundary past it (a
snapshot kept at each), and the rest is the decoder's. At the end of a generation the target
cache, which then holds exactly the prompt and the tokens it consumed, is kept too. Where the
template renders the answer, resent as the next turn's assistant message, as other tokens than
those generated (`continuation`), the engine prefills that rendering between the turns and keeps
a snapshot at its end: the next turn then reuses its whole answer, on hybrid models too. A snapshot
is kept only when the cache service grants it, after dropping what the service evicts.

Hybrid models (recurrent state) reuse only snapshots that end exactly at a prefix of the prompt;
pure-attention models may also cut a longer one back to the common prefix (`trimmable`). A
snapshot of a joint request carries the draft's state too (it may lag the target's).
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from protocol import messages as m
from worker.cache_client import CacheClient, ReuseClient
from worker.state.snapshots import Snapshot, SnapshotStore, capture, restore, trimmable
from worker.state import checkpoint as st
from worker.text import answer_rendered, message_boundaries

log = logging.getLogger("verity.worker")


@dataclass
class Plan:
    """Made when the request is tokenized (off the MLX thread)."""

    identity: str
    boundaries: list[int]
    reused: int = 0  # prompt tokens restored from a snapshot


@dataclass
class Start:
    """Caches holding the prompt's first `pos` tokens (the draft's, its first `draft_pos`);
    None: the decoder makes fresh ones."""

    cache: Optional[list] = None
    draft_cache: Optional[list] = None
    pos: int = 0
    draft_pos: int = 0


@dataclass
class Held:
    """What a finished request's caches hold: its target's exactly `tokens`, its draft's (a joint
    request's) the first `draft_tokens` of them."""

    tokens: list[int]
    cache: list
    draft_cache: Optional[list] = None
    draft_tokens: int = 0


def entry_id(identity: str, tokens: list[int]) -> str:
    return hashlib.sha256(identity.encode() + array("I", tokens).tobytes()).hexdigest()[:32]


class PrefixCache:
    def __init__(self, base_identity: str, lm, draft_model, client: ReuseClient, store: SnapshotStore,
                 prefill_step: int = 512):
        self.base, self.tokenizer = base_identity, lm.tokenizer
        self.model, self.draft_model = lm.model, draft_model
        self.client, self.store, self.prefill_step = client, store, prefill_step
        self.trimmable = all(trimmable(st.make_cache(x)) for x in (lm.model, draft_model) if x is not None)

    @classmethod
    def connect(cls, endpoint: str, identity: str, lm, draft_model=None, spill_dir: Optional[str] = None) -> "PrefixCache":
        """Reuse through the cache service at `endpoint`, spilling to `spill_dir` if given."""
        store = SnapshotStore(spill_dir)
        reuse = cls(identity, lm, draft_model, CacheClient(endpoint, store), store)
        reuse.heartbeat()  # first contact: registers what the spill directory holds
        return reuse

    @staticmethod
    def supports(model) -> bool:
        """Only attention KV and recurrent arrays can be snapshotted (not rotating or quantized KV)."""
        try:
            st.make_cache(model)
            return True
        except ValueError:
            return False

    def identity(self, thinking: Optional[bool]) -> str:
        return hashlib.sha256(f"{self.base}\x00thinking={thinking}".encode()).hexdigest()[:16]

    def plan(self, req: m.GenerateRequest, prompt: list[int]) -> Plan:
        return Plan(self.identity(req.thinking), message_boundaries(self.tokenizer, req, prompt))

    # ---- start of a request ----

    def restored(self, plan: Plan, prompt: list[int], joint: bool) -> Start:
        """Caches holding the longest prefix a snapshot has (fresh ones where none has)."""
        try:
            s = self._restore(plan, prompt, joint)
        except Exception:  # reuse must never fail a request
            log.exception("prefix reuse failed; this request starts without it")
            s = None
        s = s or Start(st.make_cache(self.model), st.make_cache(self.draft_model) if joint else None)
        plan.reused = s.pos
        return s

    def boundaries(self, plan: Plan, pos: int, length: int) -> list[int]:
        """The prompt's boundaries past `pos` to keep a snapshot at (with attention only, the last
        one: its snapshot gives the earlier ones too, cut back)."""
        return [b for b in (plan.boundaries[-1:] if self.trimmable else plan.boundaries) if pos < b < length]

    def keep_boundary(self, plan: Plan, tokens: list[int], cache: list, draft_cache: Optional[list] = None,
                      draft_tokens: int = 0) -> None:
        self.keep(plan.identity, tokens, "boundary", cache, draft_cache, draft_tokens)

    def continuation(self, req: m.GenerateRequest, plan: Plan, prompt: list[int], held: list[int],
                     answer: m.Message) -> Optional[list[int]]:
        """The tokens the next turn starts with when its client resends `answer`, where the held
        ones are not a prefix of them (another tokenization than the generated one, a thinking
        block the template drops, a cut call); None where they are, or where the rendering
        changes the prompt before its last message's end (reaching it would cost a long prefill)."""
        if req.messages is None:
            return None
        try:
            ids = answer_rendered(self.tokenizer, req, answer)
        except Exception:  # a template may refuse the conversation it would get
            return None
        end = plan.boundaries[-1] if plan.boundaries else len(prompt)
        if ids[: len(held)] == held or ids[:end] != prompt[:end]:
            return None
        return ids

    def _restore(self, plan: Plan, prompt: list[int], joint: bool) -> Optional[Start]:
        hit = self.client.lookup(plan.identity, prompt, self.trimmable, joint)
        if hit is None:
            return None
        snap = self.store.get(hit.id)
        if snap is None or (hit.length != len(snap.meta.tokens) and not self.trimmable):
            self.client.drop([hit.id])
            return None
        snap.meta.last_use = time.time()
        s = Start(restore(snap.target, hit.length), None, hit.length)
        if joint:
            # a draft state that lags may be used as it is; a longer one only cut back
            if snap.draft is not None and (snap.draft_tokens <= hit.length or self.trimmable):
                s.draft_pos = min(snap.draft_tokens, hit.length)
                s.draft_cache = restore(snap.draft, s.draft_pos)
            else:
                s.draft_cache = st.make_cache(self.draft_model)
        return s

    # ---- keeping a snapshot ----

    def keep(self, identity: str, tokens: list[int], kind: str, cache: list, draft_cache: Optional[list] = None,
             draft_tokens: int = 0) -> None:
        """Asks the cache service, drops what it evicts, then keeps a copy of the state."""
        try:
            if draft_tokens == 0:
                draft_cache = None
            if not (_holds(cache, len(tokens)) and (draft_cache is None or _holds(draft_cache, draft_tokens))):
                log.error("not keeping a snapshot whose caches disagree with its %d tokens", len(tokens))
                return
            nbytes = st.state_nbytes(cache) + (st.state_nbytes(draft_cache) if draft_cache else 0)
            meta = m.SnapshotMeta(entry_id(identity, tokens), identity, list(tokens), nbytes, kind, time.time(),
                                  draft_tokens if draft_cache else 0)
            evict = self.client.store(meta, self.trimmable)
            if evict is None:
                return
            self.store.drop(evict)
            self.store.add(Snapshot(meta, capture(cache), capture(draft_cache) if draft_cache else None))
        except Exception:
            log.exception("could not keep a snapshot")

    def keep_generation(self, plan: Plan, held: Held) -> None:
        """The end of a generation: a snapshot of what its caches hold."""
        self.keep(plan.identity, held.tokens, "generation", held.cache, held.draft_cache, held.draft_tokens)

    # ---- stats and upkeep ----

    def stats_fields(self) -> dict:
        """The cache fields of the worker's StatsSnapshot (cache_bytes None: no cache service)."""
        s = self.client.stats
        if s is None:
            return {}
        return dict(cache_bytes=s.bytes, cache_hits=s.hits, cache_lookups=s.lookups, cache_entries=s.entries,
                    cache_budget_bytes=s.budget, cache_generation_hits=s.generation_hits,
                    cache_reused_tokens=s.reused_tokens, cache_evictions=s.evictions)

    def heartbeat(self) -> None:
        self.client.heartbeat()

    def release_memory(self) -> None:
        """Idle unload: no snapshot arrays stay in memory (spilled ones stay in their files)."""
        gone = self.store.release_memory()
        if gone:
            self.client.drop(gone)

    def close(self) -> None:
        self.client.close()
        self.store.close()


def _holds(cache: list, n: int) -> bool:
    """Every attention layer holds n tokens (recurrent state carries no count to check)."""
    return all(c.offset == n for c in cache if isinstance(c, (KVCache, QuantizedKVCache)))
