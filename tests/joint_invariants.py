"""After every round, each decoding row's target and draft caches equal caches built by
sequential one-token decoding of the same tokens (allclose, rtol = atol = 1e-5): KV, conv window,
recurrent state. Rows of one batch draft different lengths each round (worker/batch/).

Run by tests/test_joint.py in a subprocess on the reference BLAS; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from joint_fixtures import (DRAFTS, PAIRS, baseline_greedy, draft_of, greedy, joint_engine, load_pair,  # noqa: E402
                            prompt_ids, run_engine)
from worker.batch.rows import Phase  # noqa: E402
from worker.state import checkpoint as st  # noqa: E402

PROMPTS, TOKENS = ["the quick brown fox", "once upon a time", "hi"], 24


class SequentialReference:
    """A cache advanced one token at a time; consumed sequences only grow between checks."""

    def __init__(self, model):
        self.model, self.cache, self.tokens = model, st.make_cache(model), []

    def matches(self, cache, tokens: list[int]) -> bool:
        if tokens[: len(self.tokens)] != self.tokens:  # recovered below an earlier check: start anew
            self.cache, self.tokens = st.make_cache(self.model), []
        for t in tokens[len(self.tokens):]:
            self.model(mx.array([[t]]), cache=self.cache)
        self.tokens = list(tokens)
        a, b = st.cache_arrays(cache), st.cache_arrays(self.cache)
        return len(a) == len(b) and all(x.shape == y.shape and mx.allclose(x, y, rtol=1e-5, atol=1e-5).item()
                                        for x, y in zip(a, b))


def check_rows(pair, kind: str, recovery: str) -> dict:
    """Three joint rows of one batch, each drafting its own length a round."""
    res = {"cycles": 0, "rollbacks": 0, "target_mismatches": 0, "draft_mismatches": 0, "checks": 0}
    prompts = [prompt_ids(pair.target, t) for t in PROMPTS]
    refs = {tuple(p): baseline_greedy(pair.target, p, TOKENS) for p in prompts}
    eng = joint_engine(pair, kind, recovery, refs, max_active=len(PROMPTS))
    seq = {f"r{i}": (SequentialReference(pair.target.model), SequentialReference(draft_of(pair, kind).model))
           for i in range(len(PROMPTS))}

    def check(e):
        runner = e.runner
        for rid, row in runner.rows.items():
            if row.phase != Phase.DECODE:
                continue
            t_ref, d_ref = seq[rid]
            tokens, cache, dcache, dn = runner.held(rid)
            res["target_mismatches"] += not t_ref.matches(cache, tokens)
            res["draft_mismatches"] += not d_ref.matches(dcache, row.seq[:dn])
            res["checks"] += 1

    run_engine(eng, {f"r{i}": greedy(t, TOKENS) for i, t in enumerate(PROMPTS)}, on_step=check)
    res["cycles"], res["rollbacks"] = eng.totals.joint.cycles, eng.totals.joint.rollbacks
    return res


def main(root: Path) -> None:
    results = {}
    for name in PAIRS:
        pair = load_pair(root, name)
        for kind in DRAFTS:
            for recovery in ("fast", "replay"):
                results[f"{name}/{kind}/{recovery}"] = check_rows(pair, kind, recovery)
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
