"""After every joint cycle, target and draft caches equal caches built by sequential one-token
decoding of the same tokens (allclose, rtol = atol = 1e-5): KV, conv window, recurrent state.

Run by tests/test_joint.py in a subprocess on the reference BLAS; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from joint_fixtures import DRAFTS, PAIRS, baseline_greedy, joint_greedy, load_pair, make_drafter, prompt_ids  # noqa: E402
from worker.state import checkpoint as st  # noqa: E402
from worker.joint.batch import joint_round  # noqa: E402
from worker.joint.decoder import JointDecoder  # noqa: E402
from worker.joint.sampling import SamplingParams  # noqa: E402

PROMPTS, TOKENS = ["the quick brown fox", "once upon a time"], 24


class SequentialReference:
    """A cache advanced one token at a time; consumed sequences only grow between checks."""

    def __init__(self, model):
        self.model, self.cache, self.tokens = model, st.make_cache(model), []

    def matches(self, cache, tokens: list[int]) -> bool:
        assert tokens[: len(self.tokens)] == self.tokens, "a recovered cache went below an earlier check"
        for t in tokens[len(self.tokens):]:
            self.model(mx.array([[t]]), cache=self.cache)
        self.tokens = list(tokens)
        a, b = st.cache_arrays(cache), st.cache_arrays(self.cache)
        return len(a) == len(b) and all(x.shape == y.shape and mx.allclose(x, y, rtol=1e-5, atol=1e-5).item()
                                        for x, y in zip(a, b))


def main(root: Path) -> None:
    results = {}
    for name in PAIRS:
        pair = load_pair(root, name)
        for kind in DRAFTS:
            for recovery in ("fast", "replay"):
                res = {"cycles": 0, "rollbacks": 0, "target_mismatches": 0, "draft_mismatches": 0}
                for text in PROMPTS:
                    prompt = prompt_ids(pair.target, text)
                    ref = baseline_greedy(pair.target, prompt, TOKENS)
                    drafter = make_drafter(pair, kind, recovery, ref)
                    t_ref, d_ref = SequentialReference(pair.target.model), SequentialReference(drafter.model)

                    def check(jd):
                        res["target_mismatches"] += not t_ref.matches(jd.cache, jd.consumed)
                        res["draft_mismatches"] += not d_ref.matches(jd.drafter.cache, jd.drafter.consumed)

                    _, jd = joint_greedy(pair, drafter, prompt, TOKENS, recovery, on_cycle=check)
                    res["cycles"] += jd.stats.cycles
                    res["rollbacks"] += jd.stats.rollbacks
                results[f"{name}/{kind}/{recovery}"] = res
        for recovery in ("fast", "replay"):
            results[f"{name}/batched/{recovery}"] = batched(pair, recovery)
    print(json.dumps(results))


def batched(pair, recovery: str) -> dict:
    """Three requests per round in batched forwards, with budgets that differ between them."""
    res = {"cycles": 0, "rollbacks": 0, "target_mismatches": 0, "draft_mismatches": 0}
    texts = ["the quick brown fox", "once upon a time", "hi"]
    decs, refs = [], []
    for i, text in enumerate(texts):
        prompt = prompt_ids(pair.target, text)
        drafter = make_drafter(pair, "perturbed", recovery, baseline_greedy(pair.target, prompt, TOKENS))
        decs.append(JointDecoder(pair.target.model, drafter, prompt, SamplingParams(), recovery=recovery))
        refs.append((SequentialReference(pair.target.model), SequentialReference(drafter.model)))
    for d in decs:
        d.start()
    for rnd in range(TOKENS // 2):
        budgets = [(rnd + i) % 4 for i in range(len(decs))]  # 0..3, a request with 0 sits out drafting
        for d, emitted in zip(decs, joint_round(decs, budgets)):
            d.commit(len(emitted))
        for d, (t_ref, d_ref) in zip(decs, refs):
            res["target_mismatches"] += not t_ref.matches(d.cache, d.tokens[:-1])
            res["draft_mismatches"] += not d_ref.matches(d.drafter.cache, d.drafter.consumed)
    for d in decs:
        res["cycles"] += d.stats.cycles
        res["rollbacks"] += d.stats.rollbacks
    return res


if __name__ == "__main__":
    main(Path(sys.argv[1]))
