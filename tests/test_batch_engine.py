"""Joint and baseline rows in one batch (worker/batch/): a round is one target forward of every
decoding row, whatever each drafts, and every greedy output stays the target's own while rows
join, leave, are cancelled and draft different lengths."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import KVCache, make_prompt_cache

import pytest

from conftest import FULL
from joint_fixtures import load_pair
from protocol import messages as m
from test_batching import CountingModel, chat, divergences_off_near_ties, drive
from worker.batch import drafts
from worker.batch import runner as runner_module
from worker.engine import Engine, EngineConfig
from worker.round import RoundInput, RoundPlan
from worker.scheduler import POSITIONS, Scheduler

PROMPTS = ["the quick brown fox", "hello world", "once upon a time " * 3, "one two three four",
           "tell me a story about the sea", "hi"]


@pytest.fixture(scope="module", params=["llama+llama", "qwen3_5+qwen3_5"])
def pair(request, tmp_path_factory):
    return load_pair(tmp_path_factory.mktemp("batch-engine"), request.param)


class Waves(Scheduler):
    """A plan that drafts `k` for every joint row in waves (rounds `on` of every `period`) and
    nothing between them: rows turn from plain to drafting and back, their drafts lagging."""

    def __init__(self, k: int = 2, period: int = 7, on: range = range(4, 6)):
        super().__init__(fixed=0)
        self.k, self.period, self.on, self.round, self.reasons = k, period, on, 0, []

    def plan_round(self, inp: RoundInput) -> RoundPlan:
        self.round += 1
        k = self.k if self.round % self.period in self.on else 0
        return RoundPlan({s.request_id: min(k, s.room) for s in inp.rows})

    def observe(self, report) -> None:
        self.reasons.append(report.reason)


def joint(text: str, n: int, **kw) -> m.GenerateRequest:
    return chat(text, n, mode="joint", **kw)


def one_round_of_four(pair, draft_budget: int) -> tuple[list, list]:
    """Two baseline and two joint rows past every prefill: the target forwards' input shapes of
    one round, and its events."""
    counting = CountingModel(pair.target.model)
    target = dataclasses.replace(pair.target, model=counting)
    engine = Engine(target, EngineConfig(max_active=4, draft_budget=draft_budget), pair.drafts["copy"])
    for i, p in enumerate(PROMPTS[:4]):
        engine.submit(f"r{i}", (joint if i % 2 else chat)(p, 60))
    tokens = 0
    while tokens < 4 * 10:  # past every prefill: all four rows decode
        tokens += sum(len(e.token_ids) for e in engine.step() if isinstance(e, m.TextDelta))
    counting.shapes.clear()
    events = engine.step()
    return counting.shapes, sorted({e.request_id for e in events if isinstance(e, m.TextDelta)})


def test_joint_rows_drafting_nothing_decode_in_the_one_forward(pair):
    shapes, emitted = one_round_of_four(pair, draft_budget=0)
    assert shapes == [(4, 1)]  # two baseline and two joint rows, one forward
    assert emitted == ["r0", "r1", "r2", "r3"]


def test_a_round_with_drafting_joint_rows_is_one_target_forward(pair):
    """Baseline rows feed their one token and joint rows [y, d1, d2] in the same forward."""
    shapes, emitted = one_round_of_four(pair, draft_budget=2)
    assert shapes == [(4, 3)]  # two baseline rows and two joint rows drafting 2, one forward
    assert emitted == ["r0", "r1", "r2", "r3"]


def test_the_warm_up_drafts_in_rounds_of_two_rows_and_leaves_the_batch_empty(pair):
    """Besides each width on one row, the warm-up plays drafting rounds of two rows of unequal
    lengths (the kernels many rows use), at the narrowest and widest depth, then frees them."""
    counting = CountingModel(pair.target.model)
    target = dataclasses.replace(pair.target, model=counting)
    engine = Engine(target, EngineConfig(max_active=4), pair.drafts["copy"])
    engine.warm_forwards()
    assert {(1, w) for w in range(1, POSITIONS + 2)} <= set(counting.shapes)
    assert {(2, 1), (2, 2), (2, POSITIONS + 1)} <= set(counting.shapes)
    assert not engine.has_work() and len(engine.runner.target) == 0 and len(engine.runner.draft) == 0
    alone = drive(engine, {0: [("r", chat(PROMPTS[0], 12))]})
    assert drive(engine, {0: [("j", joint(PROMPTS[0], 12))]}) == {"j": alone["r"]}


def test_the_warm_up_for_a_gpu_catches_up_one_lagging_row_while_the_others_ride_along(pair):
    """Where every shape builds kernels, the warm-up also plays joint rows left behind past
    CATCH_UP_LAG: one catches up and drafts while the others feed nothing (a mixed batch's shapes)."""
    counting = CountingModel(pair.drafts["copy"].model)
    engine = Engine(pair.target, EngineConfig(max_active=4), dataclasses.replace(pair.drafts["copy"], model=counting))
    engine.runner.warm(list(range(3, 40)), POSITIONS + 1, every_shape=True)
    assert any(rows == 4 and width > drafts.CATCH_UP_LAG for rows, width in counting.shapes)
    assert not engine.has_work() and len(engine.runner.target) == 0 and len(engine.runner.draft) == 0
    alone = drive(engine, {0: [("r", chat(PROMPTS[0], 12))]})
    assert drive(engine, {0: [("j", joint(PROMPTS[0], 12))]}) == {"j": alone["r"]}


def test_the_warm_up_plays_each_padded_catch_up_width_where_catch_ups_are_padded(pair, monkeypatch):
    """Where catch-ups are padded to recurring widths (off the CPU), the warm-up feeds the draft
    each of them once on one row, a token short of the width (the masked path a catch-up takes)."""
    monkeypatch.setattr(drafts, "CATCH_UP_PADDED", True)
    monkeypatch.setattr(drafts, "CATCH_UP_WARMED", 32)
    counting = CountingModel(pair.drafts["copy"].model)
    engine = Engine(pair.target, EngineConfig(max_active=4), dataclasses.replace(pair.drafts["copy"], model=counting))
    engine.warm_forwards()
    assert {(1, 8), (1, 16), (1, 32)} <= set(counting.shapes) and (1, 64) not in counting.shapes
    assert not engine.has_work() and len(engine.runner.draft) == 0
    alone = drive(engine, {0: [("r", chat(PROMPTS[0], 12))]})
    assert drive(engine, {0: [("j", joint(PROMPTS[0], 12))]}) == {"j": alone["r"]}


@pytest.mark.parametrize("draft", ["copy", "perturbed"])
def test_drafting_joint_rows_beside_baseline_rows_decode_as_each_alone(pair, draft):
    """Joint rows drafting every round (accepting all or some) in the batch's forward, with
    baseline rows joining, leaving and cancelled around them: every greedy output is the
    target's own, and the baseline rows' too."""
    reqs = {f"r{i}": (joint if i % 2 else chat)(p, 12 + 3 * i) for i, p in enumerate(PROMPTS)}
    arrivals = {0: [("r0", reqs["r0"]), ("r1", reqs["r1"])], 2: [("r2", reqs["r2"]), ("r3", reqs["r3"])],
                6: [("r4", reqs["r4"]), ("r5", reqs["r5"])]}
    engine = Engine(pair.target, EngineConfig(max_active=6, prefill_step=16, draft_budget=3), pair.drafts[draft])
    got = drive(engine, arrivals, cancels={9: ["r4"]})
    assert engine.totals.joint.drafted > 0
    assert (engine.totals.joint.rollbacks > 0) == (draft == "perturbed")  # rejections were recovered
    for rid, req in reqs.items():
        want = drive(Engine(pair.target, EngineConfig(max_active=1)),
                     {0: [("x", msgspec.structs.replace(req, mode="baseline"))]})["x"]
        if rid == "r4":
            assert got[rid] == want[: len(got[rid])]
            continue
        assert len(got[rid]) == req.max_tokens
        assert divergences_off_near_ties(pair.target, req, got[rid], want) == 0, (rid, got[rid], want)


@pytest.mark.parametrize("draft_states", ["kept", "replayed"])
def test_greedy_output_is_exact_as_joint_rows_draft_in_waves(pair, draft_states, monkeypatch):
    """A draft that proposed past a rejection takes its state after its last kept token: kept
    from the round's forwards, or (past their byte budget) replayed from the round's start."""
    if draft_states == "replayed":
        monkeypatch.setattr(drafts, "STEPS_BYTES", -1)
    reqs = {f"r{i}": (joint if i % 3 else chat)(p, 14 + 3 * i) for i, p in enumerate(PROMPTS)}
    arrivals = {0: [("r0", reqs["r0"]), ("r1", reqs["r1"]), ("r2", reqs["r2"])], 3: [("r3", reqs["r3"])],
                9: [("r4", reqs["r4"])], 13: [("r5", reqs["r5"])]}
    engine = Engine(pair.target, EngineConfig(max_active=6, prefill_step=16), pair.drafts["perturbed"])
    engine.scheduler = waves = Waves()
    got = drive(engine, arrivals, cancels={20: ["r4"]})
    assert waves.round > 2 * waves.period  # waves came and went
    assert engine.totals.joint.drafted > 0
    for rid, req in reqs.items():
        want = drive(Engine(pair.target, EngineConfig(max_active=1)),
                     {0: [("x", msgspec.structs.replace(req, mode="baseline"))]})["x"]
        if rid == "r4":  # cancelled mid-stream: what it got is the start of its own output
            assert got[rid] == want[: len(got[rid])]
            continue
        assert len(got[rid]) == req.max_tokens
        assert divergences_off_near_ties(pair.target, req, got[rid], want) == 0, (rid, got[rid], want)


@pytest.mark.parametrize("draft_states", ["kept", "replayed"])
def test_a_draft_after_a_rejection_holds_the_state_of_the_tokens_it_kept(pair, draft_states, monkeypatch):
    """After every round, each joint row's draft state (recurrent arrays and keys) is what the
    draft alone computes over the row's tokens up to the draft's length: a wrong state keeps
    outputs exact (the target verifies) but lowers acceptance, so the outputs cannot show it."""
    if draft_states == "replayed":
        monkeypatch.setattr(drafts, "STEPS_BYTES", -1)
    engine = Engine(pair.target, EngineConfig(max_active=4, prefill_step=16), pair.drafts["perturbed"])
    engine.scheduler = Waves(k=3, period=2, on=range(0, 1))
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(f"r{i}", joint(p, 30))
    checked, _ = drive_checking_draft_states(engine)
    assert checked > 20 and engine.totals.joint.rollbacks > 0


def drive_checking_draft_states(engine: Engine) -> tuple[int, dict[str, list[int]]]:
    """Steps the engine to its end, checking after every round that each joint row's draft state
    is the draft's own over the row's tokens up to the draft's length; the checks made and each
    request's tokens."""
    checked, out = 0, {}
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, m.TextDelta):
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        runner = engine.runner
        for rid, row in runner.rows.items():
            n = runner.draft.lengths[rid]
            if not n:
                continue
            ref = make_prompt_cache(runner.draft.model)
            runner.draft.model(mx.array([row.seq[:n]]), cache=ref)
            for got, want in zip(runner.draft.row_cache(rid), ref):
                pairs = ([(got.keys, want.keys), (got.values, want.values)] if isinstance(got, KVCache)
                         else list(zip(got.cache, want.cache)))
                for a, b in pairs:
                    if isinstance(got, KVCache):
                        a, b = a[..., :n, :], b[..., :n, :]
                    assert mx.allclose(a, b, atol=1e-3, rtol=1e-3).item(), (rid, n, type(got).__name__)
            checked += 1
    return checked, out


def test_drafts_two_tokens_behind_catch_up_in_a_forward_of_their_own_where_rows_take_one(pair, monkeypatch):
    """Where the draft's forward takes many rows only a token each (its rows kernels), a round
    whose rows lag two tokens (the last round kept every proposal) first feeds the lagging token
    alone: every step after it is one token a row, outputs stay exact and each draft's state is
    its own."""
    fed = []
    feed = drafts._feed_lacking
    monkeypatch.setattr(drafts, "_feed_lacking", lambda batch, ids, *a: fed.append(len(ids)) or feed(batch, ids, *a))
    engine = Engine(pair.target, EngineConfig(max_active=4, prefill_step=16), pair.drafts["copy"])
    engine.runner.draft.one_token_rows = True
    engine.scheduler = Waves(k=2, period=1, on=range(0, 1))
    reqs = {f"r{i}": joint(p, 24) for i, p in enumerate(PROMPTS[:3])}
    for rid, req in reqs.items():
        engine.submit(rid, req)
    checked, got = drive_checking_draft_states(engine)
    assert checked > 20
    assert fed and min(fed) > 1  # rows lagged two tokens and caught up together
    for rid, req in reqs.items():
        want = drive(Engine(pair.target, EngineConfig(max_active=1)),
                     {0: [("x", msgspec.structs.replace(req, mode="baseline"))]})["x"]
        assert divergences_off_near_ties(pair.target, req, got[rid], want) == 0, (rid, got[rid], want)


class OneRowInTurn(Scheduler):
    """Drafts one token for one joint row every `period` rounds, the rows in turn, nothing between:
    each drafting row's draft sat out the plain rounds before (a probe's shape)."""

    def __init__(self, period: int = 2 * drafts.CATCH_UP_LAG):
        super().__init__(fixed=0)
        self.period, self.round = period, 0

    def plan_round(self, inp: RoundInput) -> RoundPlan:
        self.round += 1
        rows = [s for s in inp.rows if s.room]
        if self.round % self.period or len(rows) < 4:
            return RoundPlan({})
        return RoundPlan({rows[(self.round // self.period) % len(rows)].request_id: 1})


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_a_draft_left_behind_catches_up_without_computing_the_rows_beside_it(pair, padded, monkeypatch):
    """A row drafting after plain rounds first feeds what its draft lacks in a forward of its own
    slot: the joint rows beside it that feed nothing are not computed (padded to its lag, a probe's
    catch-up of one row among 8 took 0.99 s where alone it takes 0.12); outputs stay exact and
    every draft state is its own."""
    computed = []
    catch_up = drafts.catch_up

    def spy(batch, ids, rows, ks):
        forward = batch.forward
        batch.forward = lambda rids, x, widths, **kw: computed.append((len(ids), x.shape[0], x.shape[1])) or forward(rids, x, widths, **kw)
        try:
            return catch_up(batch, ids, rows, ks)
        finally:
            del batch.forward

    monkeypatch.setattr(drafts, "catch_up", spy)
    monkeypatch.setattr(drafts, "CATCH_UP_PADDED", padded)  # padded as off the CPU: to a power of two
    engine = Engine(pair.target, EngineConfig(max_active=4, prefill_step=16), pair.drafts["perturbed"])
    engine.scheduler = OneRowInTurn()
    reqs = {f"r{i}": joint(p, 40) for i, p in enumerate(PROMPTS[:4])}
    for rid, req in reqs.items():
        engine.submit(rid, req)
    checked, got = drive_checking_draft_states(engine)
    assert checked > 20 and engine.totals.joint.drafted >= 3
    assert len(computed) >= 3 and all(joint_rows == 4 and rows == 1 for joint_rows, rows, _ in computed)
    assert not padded or all(w == drafts.catch_up_width(w) for _, _, w in computed)
    for rid, req in reqs.items():
        want = drive(Engine(pair.target, EngineConfig(max_active=1)),
                     {0: [("x", msgspec.structs.replace(req, mode="baseline"))]})["x"]
        assert divergences_off_near_ties(pair.target, req, got[rid], want) == 0, (rid, got[rid], want)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_a_leaving_row_s_slot_pads_the_target_s_forwards_till_the_rows_fill_a_power_of_two(pair, padded, monkeypatch):
    """Off the CPU a decoding row that leaves (finished or cancelled) keeps its slot in the
    target's forwards, fed a token nobody reads, until the rows left fill a power of two: six rows
    ending at different rounds meet forwards of 6 rows or a power of two, never 5 or 3 (exact:
    those too), and every output stays its own while rows draft in waves beside them."""
    monkeypatch.setattr(runner_module, "ROWS_PADDED", padded)
    counting = CountingModel(pair.target.model)
    engine = Engine(dataclasses.replace(pair.target, model=counting), EngineConfig(max_active=6, prefill_step=64),
                    pair.drafts["perturbed"])
    engine.scheduler = Waves(k=2, period=3, on=range(1, 2))
    reqs = {f"r{i}": (joint if i % 2 else chat)(p, 8 + 3 * i) for i, p in enumerate(PROMPTS)}
    got = drive(engine, {0: list(reqs.items())}, cancels={7: ["r5"]})
    rows = {shape[0] for shape in counting.shapes}
    assert len(rows) >= 3 and 6 in rows and (rows <= {6, 4, 2, 1}) == padded, rows
    assert engine.totals.joint.drafted > 0 and not engine.runner.padding and len(engine.runner.target) == 0
    for rid, req in reqs.items():
        want = drive(Engine(pair.target, EngineConfig(max_active=1)),
                     {0: [("x", msgspec.structs.replace(req, mode="baseline"))]})["x"]
        if rid == "r5":
            assert 0 < len(got[rid]) < req.max_tokens and got[rid] == want[: len(got[rid])]
            continue
        assert len(got[rid]) == req.max_tokens
        assert divergences_off_near_ties(pair.target, req, got[rid], want) == 0, (rid, got[rid], want)


@pytest.mark.parametrize("budget", [0, 2])
def test_a_seeded_joint_request_samples_the_same_alone_or_batched(pair, budget):
    """A row draws from its own keys, in its own order: alone or beside others, plain or
    drafting, a seeded joint request's tokens are the same."""
    seeded = joint("once upon a time", 16, temperature=0.9, top_p=0.95, seed=77)
    others = [(f"o{i}", chat(p, 20, temperature=1.0)) for i, p in enumerate(PROMPTS[:3])]

    def run(arrivals):
        return drive(Engine(pair.target, EngineConfig(max_active=6, draft_budget=budget), pair.drafts["perturbed"]),
                     arrivals)["s"]

    alone = run({0: [("s", seeded)]})
    assert alone == run({0: others[:2] + [("s", seeded)], 1: others[2:]})
    assert alone != run({0: [("s", msgspec.structs.replace(seeded, seed=78))]})


@pytest.mark.slow
def test_the_embedded_pair_in_a_batch_decodes_as_each_request_alone():
    """The embedded model and its draft: baseline and joint rows joining and leaving mid-stream,
    the plan adaptive; each greedy output equals the request alone (off near-ties)."""
    from worker.loader import load_draft, load_model

    target = load_model("embedded")
    draft = load_draft("embedded", target)
    n, tokens = (8, 48) if FULL else (4, 16)
    reqs = {f"r{i}": (joint if i % 2 else chat)(p, tokens + 2 * i) for i, p in enumerate((PROMPTS * 2)[:n])}
    ids = list(reqs)
    arrivals = {0: [(rid, reqs[rid]) for rid in ids[: n // 2]], 4: [(rid, reqs[rid]) for rid in ids[n // 2 :]]}
    got = drive(Engine(target, EngineConfig(max_active=n), draft), arrivals)
    for rid, req in reqs.items():
        want = drive(Engine(target, EngineConfig(max_active=1)), {0: [("x", msgspec.structs.replace(req, mode="baseline"))]})["x"]
        assert len(got[rid]) == req.max_tokens
        assert divergences_off_near_ties(target, req, got[rid], want) == 0, (rid, got[rid], want)


def test_a_long_joint_prompt_prefills_a_chunk_a_round_while_others_stream(pair):
    """A joint request's prompt is fed `prefill_step` tokens a round beside the running rows'
    step: they get tokens every round of it, and its output is still the target's own."""
    counting = CountingModel(pair.target.model)
    target = dataclasses.replace(pair.target, model=counting)
    engine = Engine(target, EngineConfig(max_active=4, prefill_step=16, draft_budget=2), pair.drafts["copy"])
    long = joint("tell me a story about the sea " * 12, 12)
    got = {"a": [], "b": [], "long": []}
    engine.submit("a", chat(PROMPTS[0], 60))
    engine.submit("b", joint(PROMPTS[1], 60))

    def step() -> set[str]:
        events = engine.step()
        for ev in events:
            assert not isinstance(ev, m.Error), ev
            if isinstance(ev, m.TextDelta):
                got[ev.request_id] += ev.token_ids
        return {ev.request_id for ev in events if isinstance(ev, m.TextDelta) and ev.token_ids}

    while not (got["a"] and got["b"]):
        step()
    engine.submit("long", long)
    chunks = 0
    while not got["long"]:
        counting.shapes.clear()
        assert {"a", "b"} <= step()  # the running rows got tokens this round
        chunks += 1
        assert all(s[1] <= 16 for s in counting.shapes if s[0] == 1)  # a chunk at most
    assert chunks >= 4  # the prompt took several rounds
    while engine.has_work():
        step()
    want = drive(Engine(pair.target, EngineConfig(max_active=1)), {0: [("x", msgspec.structs.replace(long, mode="baseline"))]})["x"]
    assert divergences_off_near_ties(pair.target, long, got["long"], want) == 0


def test_mlx_s_buffer_cache_is_emptied_every_so_many_rounds_and_when_the_batch_empties(pair, monkeypatch):
    """MLX keeps freed buffers for reuse, and a batch's growing contexts leave ever larger ones
    behind (a tiny llama's 4 rows of 900 tokens: 23 MiB cached beside 3.5 MiB active)."""
    from worker import engine as engine_module

    monkeypatch.setattr(engine_module, "CLEAR_CACHE_ROUNDS", 50)
    engine = Engine(pair.target, EngineConfig(max_active=4))
    for i, p in enumerate(PROMPTS[:4]):
        engine.submit(f"r{i}", chat(p, 160))
    rounds, cached = 0, []
    while engine.has_work():
        engine.step()
        rounds += 1
        cached.append(mx.get_cache_memory())
    assert rounds > 100 and max(cached) > 0
    assert all(cached[r - 1] == 0 for r in range(50, rounds, 50)), [cached[r - 1] for r in range(50, rounds, 50)]
    assert cached[-1] == 0  # the batch is empty: nothing waits on the buffers
