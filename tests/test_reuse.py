"""Exact prefix reuse in the engine (in-process), through a real cache service process."""

from __future__ import annotations

import logging
import random
import stat

import mlx.core as mx
import numpy as np
import pytest

from cache_fixtures import CacheServiceProcess, chat, reuse_engine, run_one
from conftest import FULL
from joint_fixtures import first_divergence, load_pair, top2_gap
from stack import wait_until
from worker.engine import Engine, EngineConfig
from worker.state.snapshots import SnapshotStore, arrays_of, restore
from worker.text import render_prompt

ARCHS = ("llama", "qwen3_5")  # pure attention (snapshots may be cut back) and hybrid (exact boundaries only)
N_TOKENS = 24 if FULL else 10
NEAR_TIE = 1e-3
SYSTEM = "You are a helpful robot who likes stories."
TURNS = ["hello world", "tell me a story", "what is the capital", "one two three four"][: 4 if FULL else 3]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse-pairs")
    return {arch: load_pair(root, f"{arch}+{arch}") for arch in ARCHS}


@pytest.fixture
def service():
    s = CacheServiceProcess(64 << 20).start()
    yield s
    s.stop()


class Exactness:
    """The joint path's rule: a divergence only where the target's top two logits are within 1e-3."""

    def __init__(self, lm):
        self.lm, self.divergences, self.compared = lm, [], 0

    def check(self, req, got: list[int], ref: list[int]) -> None:
        self.compared += 1
        i = first_divergence(got, ref)
        if i is None:
            return
        gap = top2_gap(self.lm, render_prompt(self.lm.tokenizer, req) + ref[:i])
        assert gap < NEAR_TIE, f"output with reuse differs at token {i} where the target is not near a tie ({gap:.2e})"
        self.divergences.append(i)

    def done(self) -> None:
        assert len(self.divergences) <= max(1, self.compared // 20), self.divergences


def boundary(lm, messages) -> int:
    """Tokens of the template rendered for these messages (no generation prompt)."""
    hf = lm.tokenizer._tokenizer
    text = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False)
    return len(lm.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("mode", ["baseline", "joint"])
@pytest.mark.parametrize("arch", ARCHS)
def test_output_with_reuse_equals_output_without(pairs, service, arch, mode):
    lm = pairs[arch].target
    draft = pairs[arch].drafts["perturbed"] if mode == "joint" else None
    budget = {"draft_budget": 3} if mode == "joint" else {}  # fixed: on this CPU the scheduler would choose 0
    warm, cold = reuse_engine(lm, service, draft, **budget), Engine(lm, EngineConfig(**budget), draft)
    exact = Exactness(lm)
    history, reused = [("system", SYSTEM)], []
    for text in TURNS:
        req = chat(history + [("user", text)], N_TOKENS, mode=mode)
        got, metrics = run_one(warm, req)
        exact.check(req, got, run_one(cold, req)[0])
        reused.append(metrics.reused_tokens)
        history += [("user", text), ("assistant", lm.tokenizer.decode(got))]
    # the last message changed: the snapshot at the previous message boundary serves it
    changed = chat(history[:-2] + [("user", "something else entirely")], N_TOKENS, mode=mode)
    got, metrics = run_one(warm, changed)
    exact.check(changed, got, run_one(cold, changed)[0])
    exact.done()
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused
    assert metrics.reused_tokens >= boundary(lm, history[:-2])
    if mode == "joint":
        assert metrics.drafted > 0


@pytest.mark.parametrize("mode", ["baseline", "joint"])
@pytest.mark.parametrize("arch", ARCHS)
def test_end_of_generation_snapshot_holds_exactly_its_tokens(pairs, service, arch, mode):
    """A row's caches hold every token it read, and a round feeds the token it emits first (the
    batch runs one ahead, as generate_step does), baseline and joint alike: the snapshot's state,
    target and draft, is that of its own tokens."""
    lm = pairs[arch].target
    draft = pairs[arch].drafts["perturbed"] if mode == "joint" else None
    engine = reuse_engine(lm, service, draft, **({"draft_budget": 3} if draft else {}))
    req = chat([("system", SYSTEM), ("user", "hello world")], mode=mode)
    out, _ = run_one(engine, req)
    (snap,) = [s for s in engine.reuse.store.snapshots.values() if s.meta.kind == "generation"]
    tokens = snap.meta.tokens
    assert tokens == render_prompt(lm.tokenizer, req) + out
    parts = [(lm.model, snap.target, len(tokens))] + ([(draft.model, snap.draft, snap.draft_tokens)] if draft else [])
    assert not draft or 0 < snap.draft_tokens <= len(tokens)
    for model, state, n in parts:
        nxt = tokens[n] if n < len(tokens) else out[-1]
        got = model(mx.array([[nxt]]), cache=restore(state, n))[0, -1]
        ref = model(mx.array([tokens[:n] + [nxt]]))[0, -1]
        assert mx.allclose(got, ref, atol=1e-3).item(), mx.abs(got - ref).max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_joint_request_after_a_baseline_one_leaves_and_finds_the_drafts_state(pairs, service, arch):
    """A baseline request and a joint one of the same conversation end in the same tokens: the
    joint one's snapshots (its answer's end, and the answer as the next turn resends it), holding
    the draft's state too, replace the baseline one's, and the next joint turn restores the
    draft's state instead of prefilling its draft over the whole conversation (before, the first
    snapshot of an id stayed, with no draft state)."""
    lm, draft = pairs[arch].target, pairs[arch].drafts["perturbed"]
    engine = reuse_engine(lm, service, draft, draft_budget=3)
    history = [("system", SYSTEM), ("user", "hello world")]
    out, _ = run_one(engine, chat(history, mode="baseline"), "base")
    assert run_one(engine, chat(history, mode="joint"), "joint")[0] == out
    engine.step()  # the answer as the next turn resends it, prefilled between the turns
    snaps = list(engine.reuse.store.snapshots.values())
    (ended,) = [s for s in snaps if s.meta.kind == "generation"]
    resent = max((s for s in snaps if s.meta.kind == "boundary"), key=lambda s: len(s.meta.tokens))
    assert len(resent.meta.tokens) > len(ended.meta.tokens) - len(out)  # past the prompt: the answer resent
    assert all(0 < s.draft_tokens == s.meta.draft_tokens <= len(s.meta.tokens) for s in (ended, resent))
    req = chat(history + [("assistant", lm.tokenizer.decode(out)), ("user", "tell me a story")], mode="joint")
    prompt = render_prompt(lm.tokenizer, req)
    start = engine.reuse.restored(engine.reuse.plan(req, prompt), prompt, joint=True)
    assert start.pos > 0 and start.draft_pos > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_changed_last_message_reuses_the_previous_boundary(pairs, service, arch):
    lm = pairs[arch].target
    warm, cold = reuse_engine(lm, service), Engine(lm, EngineConfig())
    first = [("system", SYSTEM), ("user", "hello world")]
    answer = lm.tokenizer.decode(run_one(warm, chat(first))[0])
    convo = first + [("assistant", answer), ("user", "tell me a story")]
    run_one(warm, chat(convo))
    edited = chat(convo[:-1] + [("user", "once upon a time")])
    got, metrics = run_one(warm, edited)
    exact = Exactness(lm)
    exact.check(edited, got, run_one(cold, edited)[0])
    exact.done()
    prompt, previous = render_prompt(lm.tokenizer, edited), render_prompt(lm.tokenizer, chat(convo))
    shared = first_divergence(prompt, previous)
    if warm.reuse.trimmable:  # attention: the longer snapshot, cut back to all the prompts share
        assert metrics.reused_tokens == shared
    else:  # hybrid: exactly the boundary after the assistant's message
        assert metrics.reused_tokens == boundary(lm, convo[:-1]) < shared


@pytest.mark.parametrize("arch", ARCHS)
def test_conversations_sharing_a_system_prompt_are_isolated(pairs, service, arch):
    lm = pairs[arch].target
    warm, cold = reuse_engine(lm, service), Engine(lm, EngineConfig())
    exact = Exactness(lm)
    a, b = [("system", SYSTEM), ("user", "hello world")], [("system", SYSTEM), ("user", "once upon a time")]
    out_a = run_one(warm, chat(a))[0]
    held = {i: [np.array(x) for x in arrays_of(s.target)] for i, s in warm.reuse.store.snapshots.items()}
    got, metrics = run_one(warm, chat(b))  # restores A's snapshot, cut back or at the system boundary
    exact.check(chat(b), got, run_one(cold, chat(b))[0])
    shared = first_divergence(render_prompt(lm.tokenizer, chat(a)), render_prompt(lm.tokenizer, chat(b)))
    assert 0 < metrics.reused_tokens <= shared
    # B's branch moved on from A's state: every snapshot A left is bitwise what it was
    for i, arrays in held.items():
        if i in warm.reuse.store.snapshots:
            now = [np.array(x) for x in arrays_of(warm.reuse.store.snapshots[i].target)]
            assert all(np.array_equal(x, y) for x, y in zip(arrays, now)), "a restore changed a stored snapshot"
    # each conversation's next turn sees its own history only
    for convo, out in ((a, out_a), (b, got)):
        nxt = chat(convo + [("assistant", lm.tokenizer.decode(out)), ("user", "and then?")])
        got2, m2 = run_one(warm, nxt)
        exact.check(nxt, got2, run_one(cold, nxt)[0])
        assert m2.reused_tokens >= boundary(lm, convo), "the next turn reuses its own conversation"
    exact.done()


def test_identity_changes_reuse_nothing(pairs, service):
    pair = pairs["llama"]
    lm, req = pair.target, chat([("system", SYSTEM), ("user", "hello world")])
    # the tiny llama template ignores thinking, so these prompts have the same tokens: only the
    # identity keeps them apart
    base = reuse_engine(lm, service)
    assert run_one(base, req)[1].reused_tokens == 0
    assert run_one(base, req)[1].reused_tokens > 0
    thinking = chat([("system", SYSTEM), ("user", "hello world")], thinking=False)
    assert render_prompt(lm.tokenizer, thinking) == render_prompt(lm.tokenizer, req)
    assert run_one(base, thinking)[1].reused_tokens == 0
    other_template = reuse_engine(lm, service, chat_template=lm.chat_template + "{# v2 #}")
    with_draft = reuse_engine(lm, service, draft=pair.drafts["perturbed"])
    for engine in (other_template, with_draft):
        assert run_one(engine, req)[1].reused_tokens == 0
        assert run_one(engine, req)[1].reused_tokens > 0  # its own snapshots serve it


@pytest.mark.parametrize("arch", ARCHS)
def test_budget_is_never_exceeded(pairs, arch):
    """A seeded random mix of conversations (new, next turn, changed last message, concurrent)
    on a budget of a few snapshots: after every engine step the worker holds no more than the
    budget, and exactly what the service accounts for."""
    lm = pairs[arch].target
    probe = CacheServiceProcess(64 << 20).start()
    one = reuse_engine(lm, probe)
    run_one(one, chat([("system", SYSTEM), ("user", "hello world")], 4))
    budget = 3 * max(s.meta.nbytes for s in one.reuse.store.snapshots.values())
    probe.stop()
    svc = CacheServiceProcess(budget).start()
    try:
        engine = reuse_engine(lm, svc, max_active=2)
        rng, convos = random.Random(0), []
        for n in range(40 if FULL else 16):
            if not convos or rng.random() < 0.3:
                convos.append([("system", rng.choice([SYSTEM, "Be brief."])), ("user", rng.choice(TURNS))])
            convo = rng.choice(convos)
            if rng.random() < 0.3:
                convo[-1] = ("user", rng.choice(TURNS) + " again")
            engine.submit(f"r{n}", chat(convo, rng.randint(2, 6)))
            if rng.random() < 0.5:
                continue  # leave it waiting: the next one runs beside it
            while engine.has_work():
                out = engine.step()
                store, stats = engine.reuse.store, engine.reuse.client.stats
                assert store.nbytes <= budget and store.high_water <= budget
                assert (stats.bytes, stats.entries) == (store.nbytes, len(store.snapshots))
                for ev in out:
                    if ev.request_id == f"r{n}" and hasattr(ev, "metrics"):
                        convo += [("assistant", "ok"), ("user", rng.choice(TURNS))]
        stats = engine.reuse.client.stats
        assert stats.evictions > 0 and stats.hits > 0, stats
    finally:
        svc.stop()


def test_worker_resyncs_with_a_restarted_service(pairs):
    lm = pairs["qwen3_5"].target
    svc = CacheServiceProcess(64 << 20).start()
    try:
        engine = reuse_engine(lm, svc)
        convo = [("system", SYSTEM), ("user", "hello world")]
        run_one(engine, chat(convo))
        held = len(engine.reuse.store.snapshots)
        svc.kill()
        follow = chat(convo + [("assistant", "ok"), ("user", "tell me a story")])
        tokens, metrics = run_one(engine, follow)  # no service: served without reuse
        assert metrics.reused_tokens == 0 and len(tokens) == 10
        assert engine.reuse.client.stats is None and len(engine.reuse.store.snapshots) == held
        svc.start()  # restarted, empty: the idle worker's heartbeat finds it and resyncs
        wait_until(lambda: engine.reuse.heartbeat() or engine.reuse.client.stats is not None, 10, "a resync")
        tokens2, metrics = run_one(engine, follow)
        assert metrics.reused_tokens > 0 and tokens2 == tokens  # what the worker held was re-registered
        assert engine.reuse.client.stats.entries == len(engine.reuse.store.snapshots) > held
    finally:
        svc.stop()


def test_spill_files_are_private_and_survive_a_worker_restart(pairs, service, tmp_path):
    lm = pairs["qwen3_5"].target
    spill = tmp_path / "snapshots"
    convo = [("system", SYSTEM), ("user", "hello world")]
    first = reuse_engine(lm, service, spill_dir=spill)
    out = run_one(first, chat(convo))[0]
    first.reuse.store.flush()  # files are written by a thread of their own
    files = sorted(spill.iterdir())
    assert stat.S_IMODE(spill.stat().st_mode) == 0o700
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert {f.stem for f in files} == set(first.reuse.store.snapshots)
    # a new worker (nothing in memory) registers the files and reuses them
    nxt = chat(convo + [("assistant", lm.tokenizer.decode(out)), ("user", "tell me a story")])
    second = reuse_engine(lm, service, spill_dir=spill)
    assert not any(s.loaded for s in second.reuse.store.snapshots.values())
    got, metrics = run_one(second, nxt)
    assert metrics.reused_tokens >= boundary(lm, convo)
    exact = Exactness(lm)
    exact.check(nxt, got, run_one(Engine(lm, EngineConfig()), nxt)[0])
    exact.done()


def test_corrupt_spill_files_are_dropped_with_a_warning(pairs, service, tmp_path, caplog):
    lm = pairs["llama"].target
    spill = tmp_path / "snapshots"
    req = chat([("system", SYSTEM), ("user", "hello world")])
    first = reuse_engine(lm, service, spill_dir=spill)
    run_one(first, req)
    first.reuse.store.flush()
    (victim,) = spill.iterdir()  # attention: one snapshot, its boundaries folded in
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit of state
    victim.write_bytes(bytes(data))
    (spill / ("f" * 32 + ".safetensors")).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with caplog.at_level(logging.WARNING, logger="verity.worker"):
        engine = reuse_engine(lm, service, spill_dir=spill)
        got, metrics = run_one(engine, req)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropped spill file " + "f" * 32 in w for w in warnings), warnings
    assert any(f"dropped spilled snapshot {victim.stem}" in w and "checksum" in w for w in warnings), warnings
    assert metrics.reused_tokens == 0 and got == run_one(Engine(lm, EngineConfig()), req)[0]
    assert not (spill / ("f" * 32 + ".safetensors")).exists()
    engine.reuse.store.flush()
    assert SnapshotStore(str(spill)).get(victim.stem) is not None  # rewritten whole by the fresh run
