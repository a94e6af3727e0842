"""The draft distilled from the embedded model: the recipe runs and resumes exactly; the shipped
draft is small, shares the target's embedding, is accepted on held-out prompts and keeps greedy
output identical to baseline."""

from __future__ import annotations

import json
from dataclasses import asdict

import mlx.core as mx
import numpy as np
import pytest

from conftest import FULL
from joint_fixtures import Schedule, baseline_greedy, first_divergence, run_engine, top2_gap
from bench.distill import train as d
from worker.draft.model import ASSET_DIR, DRAFT_ID, load_embedded_draft
from worker.loader import load_draft, load_model
from protocol import messages as m
from worker.engine import Engine, EngineConfig

pytestmark = pytest.mark.slow
N_PROMPTS, N_TOKENS = (20, 128) if FULL else (3, 40)
NEAR_TIE = 1e-3
MAX_OWN_BYTES = 40 * 1024 * 1024


@pytest.fixture(scope="module")
def pair():
    target = load_model("embedded")
    return target, load_draft("embedded", target)


@pytest.fixture(scope="module")
def heldout(pair):
    target, _ = pair
    return [d.encode_prompt(target.tokenizer, p) for p in d.read_prompts(d.HELDOUT_PROMPTS)]


def test_shipped_draft_is_small_and_shares_the_target_embedding(pair):
    target, draft = pair
    assert (ASSET_DIR / "model.safetensors").stat().st_size <= MAX_OWN_BYTES
    own = mx.load(str(ASSET_DIR / "model.safetensors"))
    assert all(v.dtype == mx.float16 for v in own.values()) and not any("embed" in k for k in own)
    assert draft.model.model.embed_tokens is target.model.model.embed_tokens
    assert draft.model_id == DRAFT_ID and draft.tokenizer is target.tokenizer
    meta = json.loads((ASSET_DIR / "config.json").read_text())
    assert meta["teacher_revision"] == target.revision and len(meta["head_vocab"]) <= meta["recipe"]["head_size"]
    assert meta["recipe"] == json.loads(json.dumps(asdict(d.Recipe())))  # `verity distill` rebuilds this draft
    assert set(target.tokenizer.eos_token_ids) <= set(meta["head_vocab"])  # the draft can propose the end
    train = set(d.read_prompts(d.TRAIN_PROMPTS))
    assert not train & set(d.read_prompts(d.HELDOUT_PROMPTS))  # held-out means never trained on


HELDOUT_TEMPLATES = ("Tell me about ", "Write a paragraph describing ", "What do most people not know about ",
                     "Write a children's story featuring ", "Explain the science behind ",
                     "Give me a fun fact and a question about ")


def test_training_prompts_are_the_committed_generator_output_and_avoid_heldout():
    """train_prompts.txt is what bench/distill/prompts.py draws; no held-out template or topic is in it."""
    from bench.distill import prompts

    assert d.read_prompts(d.TRAIN_PROMPTS) == prompts.build() and len(set(prompts.build())) == prompts.COUNT
    held = d.read_prompts(d.HELDOUT_PROMPTS)
    topics = [next(p[len(t):].rstrip(".?") for t in HELDOUT_TEMPLATES if p.startswith(t)) for p in held]
    for template in prompts.TEMPLATES:
        assert not any(template.startswith(t) for t in HELDOUT_TEMPLATES), template
    words = {w for topic in prompts.TOPICS for w in topic.lower().split()}
    for topic in topics:  # a held-out topic is never a training topic, nor inside one
        core = topic.lower().removeprefix("the ").removeprefix("a ")
        assert not any(core == t.lower().removeprefix("the ").removeprefix("a ") or f" {core}" in f" {t.lower()}"
                       for t in prompts.TOPICS), topic
        assert core not in words, topic


# the goal, on all 24 held-out prompts over 128 tokens (the shipped draft: 0.504); the quick
# subset (6 prompts, 48 tokens) reads 0.483
MIN_HELDOUT_FIRST = 0.5 if FULL else 0.45
MIN_JOINT_FIRST = 0.4  # first-position acceptance in joint cycles: a real draft, far above chance


def test_heldout_acceptance_of_the_shipped_draft(pair, heldout):
    target, draft = pair
    n = None if FULL else 6
    prompts = heldout[:n]
    cont = d.greedy_continuations(target.model, prompts, 128 if FULL else 48, set(target.tokenizer.eos_token_ids))
    report = d.acceptance_per_position(draft.model, prompts, cont)
    print("held-out greedy acceptance per position:", [round(a, 3) for a in report["per_position"]], report["positions"])
    assert report["first"] >= MIN_HELDOUT_FIRST, report


def test_greedy_joint_with_the_distilled_draft_equals_baseline(pair, heldout):
    """The held-out prompts as joint rows of one batch, drafting by a schedule: each output is
    the target's own greedy one, and the draft's first position is accepted often."""
    target, draft = pair
    prompts = heldout[:N_PROMPTS]
    eng = Engine(target, EngineConfig(max_active=len(prompts)), draft)
    eng.scheduler = Schedule((4, 1, 3, 2, 6, 8))
    reqs = {f"h{i}": m.GenerateRequest(prompt=p, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, mode="joint")
            for i, p in enumerate(prompts)}
    got = run_engine(eng, reqs)
    near_ties = []
    for i, prompt in enumerate(prompts):
        ref = baseline_greedy(target, prompt, N_TOKENS)
        at = first_divergence(got[f"h{i}"], ref)
        if at is not None:
            gap = top2_gap(target, prompt + ref[:at])
            assert gap < NEAR_TIE, f"joint output differs at token {at} where the target is not near a tie ({gap:.2e})"
            near_ties.append(at)
    assert len(near_ties) <= max(1, N_PROMPTS // 20)
    first = eng.totals.joint.accepted_at[0]
    assert first[0] / first[1] >= MIN_JOINT_FIRST, first


def test_distill_recipe_resumes_to_the_same_draft(tmp_path):
    """Interrupted in training and run again, the recipe continues from its checkpoint and ends
    with exactly the weights of an uninterrupted run; generated shards are not redone."""
    target = load_model("embedded")
    args = asdict(target.model.args)
    r = d.Recipe(prompts=2, gen_tokens=6, temperatures=[0.0, 0.8], gen_batch=2, batch=1, epochs=2,
                 checkpoint_every=1, head_size=256, layer_ids=[0, 29], eval_prompts=2, eval_tokens=6)

    def interrupt_in_training(description, total):
        calls = []

        def advance(n=1):
            calls.append(n)
            if description.startswith("train") and len(calls) == 3:  # the 1st call reports resumed steps
                raise KeyboardInterrupt
        return advance

    with pytest.raises(KeyboardInterrupt):
        d.run(target, args, tmp_path / "a", tmp_path / "a-out", r, interrupt_in_training)
    shards = sorted((tmp_path / "a" / "generate").iterdir())
    stamps = [p.stat().st_mtime_ns for p in shards]
    resumed = d.run(target, args, tmp_path / "a", tmp_path / "a-out", r)
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "a" / "generate").iterdir())] == stamps
    log = [json.loads(x) for x in (tmp_path / "a" / "train" / "log.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in log]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == 2 * 2  # 2 sequences, 2 epochs
    assert [x["epoch"] for x in log if "heldout_first" in x] == [1, 2]  # held-out acceptance at each epoch's end
    straight = d.run(target, args, tmp_path / "b", tmp_path / "b-out", r)
    a = mx.load(str(tmp_path / "a-out" / "model.safetensors"))
    b = mx.load(str(tmp_path / "b-out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    assert resumed["heldout"]["prompts"] == straight["heldout"]["prompts"] == 2
    loaded = load_embedded_draft(target.model, args, tmp_path / "a-out")  # what was written loads
    assert loaded(mx.array([[1, 2, 3]])).shape == (1, 3, args["vocab_size"])


async def test_launch_stack_serves_the_embedded_pair():
    """`launch-stack --draft embedded`: joint requests over HTTP use the distilled draft, name it in
    their metrics, and answer what baseline answers."""
    import aiohttp

    from stack import Stack

    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell me about owls."}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Stack("embedded", "--draft", "embedded", "--draft-budget", "1") as s:
        async with aiohttp.ClientSession() as http:
            async def complete(extra):
                async with http.post(f"{s.url}/v1/chat/completions", json={**body, **extra}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()
            base, joint = await complete({}), await complete({"mode": "joint"})
    assert joint["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]
    jm = joint["metrics"]
    assert jm["mode"] == "joint" and jm["draft"].startswith(f"{DRAFT_ID}@")
    assert jm["cycles"] - 1 <= jm["budget_mean"] * jm["cycles"] <= jm["cycles"]  # k = 1; the last cycle may have no room
    assert jm["drafted"] >= 10 and jm["accepted"] > 0
    assert s.exit_code == 0
