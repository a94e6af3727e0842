"""The cache service's table: lookup rules, eviction order, and the byte budget under random use."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from cache_service.index import SnapshotIndex, common_prefix, _packed
from cli.launch import byte_size
from protocol import codec, messages as m

BUDGET = 1000


def meta(tokens, nbytes=100, kind="boundary", identity="a", last_use=0.0, draft=0) -> m.SnapshotMeta:
    return m.SnapshotMeta(f"{identity}:{','.join(map(str, tokens))}", identity, list(tokens), nbytes, kind, last_use,
                          draft)


def test_common_prefix():
    assert common_prefix(_packed([1, 2, 3]), _packed([1, 2, 4, 5])) == 2
    assert common_prefix(_packed([]), _packed([1])) == 0
    assert common_prefix(_packed([7] * 1000), _packed([7] * 999 + [8])) == 999


def test_lookup_exact_prefixes_only_and_never_the_whole_prompt():
    ix = SnapshotIndex(BUDGET)
    for toks in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 9, 9]):
        ix.store(meta(toks), trimmable=False, now=1)
    assert ix.lookup("a", [1, 2, 3, 4, 5], False, now=2) == m.CacheHit(meta([1, 2, 3, 4]).id, 4)
    assert ix.lookup("a", [1, 2, 3, 4], False, now=2).length == 2  # one token is always left to prefill
    assert ix.lookup("a", [1, 2, 3, 7], False, now=2).length == 2  # [1,2,3,9,9] cannot be cut back
    assert ix.lookup("b", [1, 2, 3, 4, 5], False, now=2) is None  # another identity
    assert ix.lookup("a", [5, 1, 2], False, now=2) is None
    assert (ix.stats.lookups, ix.stats.hits, ix.stats.reused_tokens) == (5, 3, 8)


def test_trimmable_lookup_cuts_a_longer_entry_back():
    ix = SnapshotIndex(BUDGET)
    ix.store(meta([1, 2, 3, 9, 9], kind="generation"), trimmable=True, now=1)
    hit = ix.lookup("a", [1, 2, 3, 7], True, now=2)
    assert hit.length == 3 and hit.id == meta([1, 2, 3, 9, 9]).id
    assert ix.lookup("a", [1, 2, 3, 9, 9], True, now=2).length == 4
    assert ix.stats.generation_hits == 2


def test_trimmable_entry_replaces_its_prefixes_and_keeps_their_priority():
    ix = SnapshotIndex(BUDGET)
    ix.store(meta([1, 2], kind="boundary"), trimmable=True, now=1)
    granted, evict = ix.store(meta([1, 2, 3, 4], kind="generation"), trimmable=True, now=2)
    assert granted and evict == [meta([1, 2]).id] and ix.bytes == 100
    assert ix.store(meta([1, 2, 3]), trimmable=True, now=3) == (False, [])  # already given by [1,2,3,4]
    assert ix.entries[meta([1, 2, 3, 4]).id].boundary


def test_a_joint_request_gets_the_entry_whose_draft_state_gives_most():
    """A baseline request's snapshot holds no draft state: a joint request restoring it prefilled
    its draft over the whole prompt (`bench batch`, 8 streams on the CPU: first tokens 431 ms
    against 256). Of entries giving as many tokens, a joint lookup takes the one whose draft
    state gives most (one that lags counts as it is; a longer one, cut back only where trimmable);
    a baseline lookup as before."""
    ix = SnapshotIndex(BUDGET)
    ix.store(meta([1, 2, 3], identity="a", last_use=0, draft=3), trimmable=False, now=1)
    ix.store(meta([1, 2, 3, 4, 5], draft=0), trimmable=False, now=1)
    ix.store(meta([1, 2, 3, 4], draft=2), trimmable=False, now=2)
    ix.store(meta([1, 2, 3, 4, 6], draft=0), trimmable=False, now=3)  # as long as [1,2,3,4,5]: used last
    assert ix.lookup("a", [1, 2, 3, 4, 9], False, now=4) == m.CacheHit(meta([1, 2, 3, 4]).id, 4)
    assert ix.lookup("a", [1, 2, 3, 4, 5, 6], False, now=4, draft=True).id == meta([1, 2, 3, 4, 5]).id  # longest first
    cut = SnapshotIndex(BUDGET)  # trimmable: the longer entries cut back to 4 tokens
    cut.store(meta([1, 2, 3, 4, 5], draft=5), trimmable=True, now=1)
    cut.store(meta([1, 2, 3, 4, 6], draft=0), trimmable=True, now=2)
    assert cut.lookup("a", [1, 2, 3, 4, 7], True, now=3).id == meta([1, 2, 3, 4, 6]).id
    assert cut.lookup("a", [1, 2, 3, 4, 7], True, now=3, draft=True).id == meta([1, 2, 3, 4, 5]).id


def test_an_entry_with_more_of_the_draft_state_replaces_one_with_less():
    """The same tokens kept by a joint request after a baseline one: its snapshot replaces the
    draftless one of the same id; a draftless one never replaces, absorbs nor covers it."""
    ix = SnapshotIndex(BUDGET)
    assert ix.store(meta([1, 2, 3]), trimmable=False, now=1) == (True, [])
    assert ix.store(meta([1, 2, 3], draft=3), trimmable=False, now=2) == (True, [meta([1, 2, 3]).id])
    assert ix.entries[meta([1, 2, 3]).id].meta.draft_tokens == 3 and ix.bytes == 100
    assert ix.store(meta([1, 2, 3]), trimmable=False, now=3) == (False, [])
    t = SnapshotIndex(BUDGET)
    t.store(meta([1, 2], draft=2), trimmable=True, now=1)
    assert t.store(meta([1, 2, 3, 4], kind="generation"), trimmable=True, now=2) == (True, [])  # not absorbed
    assert t.store(meta([1, 2, 3], draft=3), trimmable=True, now=3) == (True, [meta([1, 2]).id])  # not covered
    assert sorted(e.meta.draft_tokens for e in t.entries.values()) == [0, 3]


def test_store_refuses_what_cannot_fit_or_is_held():
    ix = SnapshotIndex(BUDGET)
    assert ix.store(meta([1], nbytes=BUDGET + 1), False, now=1) == (False, [])
    assert ix.store(meta([1]), False, now=1) == (True, [])
    assert ix.store(meta([1]), False, now=5) == (False, [])  # held: only touched
    assert ix.entries[meta([1]).id].meta.last_use == 5


def test_eviction_keeps_boundaries_about_twice_as_long():
    ix = SnapshotIndex(300)
    ix.store(meta([1], kind="boundary"), False, now=0)
    ix.store(meta([2], kind="generation"), False, now=10)
    ix.store(meta([3], kind="generation"), False, now=20)
    # at 30: idle boundary 30 * 0.5 = 15, generations 20 and 10: the older generation goes first
    assert ix.store(meta([4], kind="generation"), False, now=30) == (True, [meta([2]).id])
    # at 50: boundary 25, generation [3] 30: the generation again
    assert ix.store(meta([5], kind="generation"), False, now=50) == (True, [meta([3]).id])
    # at 100: boundary 50, generation [4] 70, [5] 50: [4]
    assert ix.store(meta([6], kind="generation"), False, now=100) == (True, [meta([4]).id])
    # a boundary idle long enough goes before a fresher generation
    ix = SnapshotIndex(200)
    ix.store(meta([1], kind="boundary"), False, now=0)
    ix.store(meta([2], kind="generation"), False, now=100)
    assert ix.store(meta([3], kind="generation"), False, now=250) == (True, [meta([2]).id])  # 125 vs 150
    assert ix.store(meta([4], kind="generation"), False, now=400) == (True, [meta([1]).id])  # 200 vs 150


def test_sync_replaces_the_table_and_fits_the_budget():
    ix = SnapshotIndex(250)
    ix.store(meta([9]), False, now=0)
    over = ix.sync([meta([1], last_use=1), meta([2], last_use=2), meta([3], last_use=3), meta([4], nbytes=999)], now=4)
    assert sorted(over) == sorted([meta([4], nbytes=999).id, meta([1]).id])
    assert set(ix.entries) == {meta([2]).id, meta([3]).id} and ix.bytes == 200


def test_cache_messages_round_trip():
    entry = meta([1, 2, 3], kind="generation", last_use=1.5)
    requests = [m.CacheSync(1, [entry]), m.CacheLookup(2, "s", "a", [1, 2], True), m.CacheStore(3, "s", entry, False),
                m.CacheDrop(4, "s", ["x"]), m.CacheStatsRequest(5, "s")]
    for msg in requests:
        assert codec.cache_request_decoder().decode(codec.encode(msg)) == msg
    reply = m.CacheReply(2, "s", m.CacheStats(budget=9, bytes=3), hit=m.CacheHit("x", 2), granted=True, evict=["y"])
    assert codec.cache_reply_decoder().decode(codec.encode(reply)) == reply


def test_byte_sizes():
    assert [byte_size(x) for x in ("0", "1024", "512M", "2G", "1.5GiB", "3kb")] == [0, 1024, 512 << 20, 2 << 30,
                                                                                     3 << 29, 3072]


# ---- the budget under random use ----

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=6)
ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from("ab"), tokens, st.integers(1, 600), st.sampled_from(["boundary", "generation"])),
    st.tuples(st.just("lookup"), st.sampled_from("ab"), tokens),
    st.tuples(st.just("drop"), st.integers(0, 20)),
    st.tuples(st.just("sync"), st.integers(0, 20)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_budget_is_never_exceeded_and_hits_are_verified_prefixes(ops):
    ix = SnapshotIndex(BUDGET)
    trim = {"a": True, "b": False}  # identity a: pure attention, b: hybrid
    held: dict[str, m.SnapshotMeta] = {}  # what a worker following the answers would hold
    for now, op in enumerate(ops):
        if op[0] == "store":
            _, ident, toks, nbytes, kind = op
            e = meta(toks, nbytes, kind, ident)
            granted, evict = ix.store(e, trim[ident], now)
            for i in evict:
                held.pop(i)
            if granted:
                held[e.id] = e
        elif op[0] == "lookup":
            _, ident, toks = op
            hit = ix.lookup(ident, toks, trim[ident], now)
            if hit is not None:
                got = held[hit.id]
                assert got.identity == ident and 0 < hit.length < len(toks)
                assert got.tokens[: hit.length] == toks[: hit.length]
                assert trim[ident] or hit.length == len(got.tokens)
        elif op[0] == "drop" and held:
            victim = sorted(held)[op[1] % len(held)]
            ix.drop([victim])
            held.pop(victim)
        elif op[0] == "sync":
            keep = [e for i, e in enumerate(sorted(held.values(), key=lambda e: e.id)) if (i + op[1]) % 3]
            held = {e.id: e for e in keep}
            for i in ix.sync(keep, now):
                held.pop(i)
        assert ix.bytes <= BUDGET
        assert set(ix.entries) == set(held) and ix.bytes == sum(e.nbytes for e in held.values())
