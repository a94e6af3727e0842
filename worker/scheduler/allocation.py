"""The allocation rule: survivals ranked across requests, the top B taken, prefix-closed
(docs/design.md, "Budget selection and allocation"). The web UI's allocation view mirrors it."""

from __future__ import annotations

import math
from typing import Sequence

POSITIONS = 8  # deepest draft of one request
# Scores equal to this many decimal places are ties: 0.7 * 0.7 (0.48999999999999994) ties 0.49.
TIE_DECIMALS = 9


def survivals(acceptance: Sequence[float]) -> list[float]:
    """s[j] = a[1]·…·a[j]: the chance that draft position j is reached and accepted."""
    out, s = [], 1.0
    for a in acceptance:
        s *= a
        out.append(s)
    return out


def tie_key(s: float) -> int:
    """The score as ranked: s rounded half up to TIE_DECIMALS places, as an integer (the web UI
    computes the same double operations)."""
    return math.floor(s * 10**TIE_DECIMALS + 0.5)


def rank(survival: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """All (request, position) candidates, positions 1-based, by survival descending; scores
    equal to TIE_DECIMALS places go by request order, then position."""
    cands = [(-tie_key(s), r, j + 1) for r, row in enumerate(survival) for j, s in enumerate(row)]
    return [(r, j) for _, r, j in sorted(cands)]


def allocate(survival: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Draft length per request for a total budget: the top `budget` candidates, prefix-closed."""
    lengths = [0] * len(survival)
    for r, j in rank(survival)[:budget]:
        lengths[r] = max(lengths[r], j)
    return lengths
