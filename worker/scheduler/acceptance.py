"""Acceptance per draft position: decayed counts with a Beta prior, at three levels (each
request's, the server's, the long run's); docs/scheduler.md, "Acceptance estimates"."""

from __future__ import annotations

import math
from typing import Sequence

PRIOR_WEIGHT = 2.0  # pseudo-observations of each position's prior
FIRST_PRIOR = 0.5  # position 1 starts as a coin flip: Beta(1, 1)
DECAY = 0.95  # per observation: acceptance follows the text as it changes
LONG_DECAY = 0.998  # per observation: what the draft shows over the long run
RECENT_DECAY = 0.7  # a short memory kept beside each estimate's, to see that the text changed
CHANGE_NATS = 1.5  # log-likelihood ratio (recent observations, short memory's rate against the
                   # estimate's) past which the estimate forgets what came before them
MIN_RECENT = 1.5  # decayed observations the short memory needs before it is tested
FADE_WEIGHT = 8.0  # observations of the long-run estimate a server-wide one's position 1 fades to over plain rounds
SHARED_WEIGHT = 24.0  # pseudo-observations of the server-wide estimate in each request's own: noise
                      # in each request's estimates makes survivals uneven, and uneven survivals draft
                      # deeper for the same budget (8: acceptance 0.9 ×4 chose depth 2 where 4 paid, 0.93 of k = 4)


class Acceptance:
    """Conditional acceptance per draft position from decayed counts with a Beta prior.

    Three levels. The long-run estimate (every cycle the server ran, decaying at LONG_DECAY)
    takes as prior mean the previous position's estimate (position 1: 0.5): an untried deeper
    position is taken to be like the one before it, so a draft that is good at shallow positions
    gets tried deeper, and a bad one does not. The server-wide estimate (DECAY a round, however
    many requests' cycles the round observed: it follows the text as it changes) takes the long-run
    one as prior, and a request's own estimate takes the
    server-wide one as prior (SHARED_WEIGHT observations): it starts from what the server has seen
    and goes its own way as its text shows, but a few unlucky cycles do not make it look worse
    than the draft is. For the same reason counts fade without being added to where nothing was
    tried: a position a cycle did not try (at DECAY, even in the long-run estimate), and every
    position in a round that drafted nothing (`fade`), so an estimate that an unlucky spell pushed below the point where drafting pays
    drifts back to what the draft has shown over the long run, and drafting is tried again,
    instead of stopping for good (no drafts, no observations).

    A change of text (code after prose) moves acceptance at once, and an estimate with ~20
    observations of memory takes 3-6 cycles to follow it. So each level but the long-run one keeps
    a short memory (RECENT_DECAY) beside its own; when the recent observations are more likely
    under the short memory's rate than under the estimate's by CHANGE_NATS, the estimate forgets
    the older ones (with 4 requests, acceptance switching 0.9/0.2 every 10 cycles, the error of position
    1 fell from 0.26 to 0.20 in simulation, and at a steady acceptance 0.9 rose from 0.034 to 0.036).
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
        forgets them at every deeper position too: once position j fails, the deeper ones are seldom
        tried and would keep the old text's rates (after acceptance 0.9 the engine drafted 6-8 deep into
        acceptance 0.2 text). After a rise they are tried often again and follow on their own."""
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
        faded (the deeper positions fade to nothing, their prior: held at the long-run rates, which
        carried the acceptance 0.9 thirds' rates into the acceptance 0.9 → 0.2 → 0.9 rows, they kept drafts 2-8
        deep through failures, 0.91 of k = 1 in a whole run; 0.99 in a targeted run without)."""
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
