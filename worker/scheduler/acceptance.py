"""Acceptance per draft position: decayed counts with a Beta prior, at three levels (each
request's, the server's, the long run's); docs/scheduler.md, "Acceptance estimates"."""

from __future__ import annotations

import math
from typing import Sequence

PRIOR_WEIGHT = 2.0  # pseudo-observations of each position's prior
FIRST_PRIOR = 0.5  # position 1 starts as a coin flip: Beta(1, 1)
DECAY = 0.95  # per observation (the server-wide estimate: per round): acceptance follows the text as it changes
LONG_DECAY = 0.998  # per observation: what the draft shows over the long run (~500 cycles)
RECENT_DECAY = 0.7  # a short memory kept beside each estimate's, to see that the text changed
CHANGE_NATS = 1.5  # log-likelihood ratio (recent observations, short memory's rate against the
                   # estimate's) past which the estimate forgets what came before them
MIN_RECENT = 1.5  # decayed observations the short memory needs before it is tested
FADE_WEIGHT = 8.0  # observations of the long-run estimate a server-wide one's position 1 fades to over plain rounds
SHARED_WEIGHT = 24.0  # pseudo-observations of the server-wide estimate in each request's own


class Acceptance:
    """Conditional acceptance per draft position from decayed counts with a Beta prior
    (docs/scheduler.md, "Acceptance estimates").

    Three levels, each the prior of the next: the long-run estimate (LONG_DECAY; prior mean: the
    previous position's estimate, worth PRIOR_WEIGHT), the server-wide one (DECAY a round) and
    each request's own (the server-wide one worth SHARED_WEIGHT). Counts fade where nothing was
    tried: a position a cycle did not try (at DECAY, at every level) and every position in a round
    that drafted nothing (`fade`). Each level but the long-run one keeps a short memory
    (RECENT_DECAY); when its recent observations are CHANGE_NATS likelier under its rate than
    under the estimate's, the estimate forgets the older ones (a change of text).
    """

    def __init__(self, max_positions: int, decay: float = DECAY, detect_change: bool = True,
                 forget_deeper: bool = False, per_round: bool = False):
        self.accepted = [0.0] * max_positions
        self.tried = [0.0] * max_positions
        self.recent_accepted = [0.0] * max_positions
        self.recent_tried = [0.0] * max_positions
        self.decay = decay
        self.detect_change, self.forget_deeper = detect_change, forget_deeper
        self.per_round = per_round  # counts decay once a round (`fade`), however many cycles it observes

    def observe(self, k: int, n: int) -> None:
        """A cycle drafted k and accepted the first n: positions 1..min(n+1, k) were tried."""
        tried = min(n + 1, k)
        for j in range(len(self.tried)):
            decay = 1.0 if self.per_round else self.decay if j < tried else min(self.decay, DECAY)  # untried: fades as fast at every level
            self.accepted[j] = self.accepted[j] * decay + (j < n)
            self.tried[j] = self.tried[j] * decay + (j < tried)
            self.recent_accepted[j] = self.recent_accepted[j] * RECENT_DECAY + (j < n)
            self.recent_tried[j] = self.recent_tried[j] * RECENT_DECAY + (j < tried)
        if self.detect_change:
            self._forget_before_a_change()

    def _forget_before_a_change(self) -> None:
        """A change at position j forgets the older observations there; with `forget_deeper`, a fall
        forgets them at every deeper position too (seldom tried after it, they would keep the old
        text's rates); a rise does not."""
        for j, (ra, rt) in enumerate(zip(self.recent_accepted, self.recent_tried)):
            if rt < MIN_RECENT or self.tried[j] <= rt:
                continue
            p_old = min(0.97, max(0.03, self.accepted[j] / self.tried[j]))
            p_new = min(0.97, max(0.03, ra / rt))
            nats = ra * math.log(p_new / p_old) + (rt - ra) * math.log((1 - p_new) / (1 - p_old))
            if nats > CHANGE_NATS:
                deeper = self.forget_deeper and p_new < p_old
                end = len(self.tried) if deeper else j + 1
                self.accepted[j:end] = self.recent_accepted[j:end]
                self.tried[j:end] = self.recent_tried[j:end]
                if deeper:
                    return

    def fade(self, recent: bool = True, toward: Sequence[float] | None = None) -> None:
        """A round without drafts (or, `per_round`, any round): what was seen weighs less; `recent`:
        the short memory too; `toward`: what position 1 fades to, worth FADE_WEIGHT observations once
        faded (the deeper positions fade to nothing, their prior)."""
        d = self.decay
        self.accepted = [a * d for a in self.accepted]
        self.tried = [t * d for t in self.tried]
        if toward is not None:
            self.accepted[0] += (1 - d) * FADE_WEIGHT * toward[0]
            self.tried[0] += (1 - d) * FADE_WEIGHT
        if recent:
            self.recent_accepted = [a * RECENT_DECAY for a in self.recent_accepted]
            self.recent_tried = [t * RECENT_DECAY for t in self.recent_tried]

    def rates(self, prior: Sequence[float] | None = None, weight: float = SHARED_WEIGHT) -> list[float]:
        """Estimates per position; `prior`: the level above's, worth `weight` observations (none:
        the previous position's estimate, worth PRIOR_WEIGHT)."""
        out, mean = [], FIRST_PRIOR
        for j, (a, t) in enumerate(zip(self.accepted, self.tried)):
            if prior is None:
                mean = (a + PRIOR_WEIGHT * mean) / (t + PRIOR_WEIGHT)
            else:
                mean = (a + weight * prior[j]) / (t + weight)
            out.append(mean)
        return out
