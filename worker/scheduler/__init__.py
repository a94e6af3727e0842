"""The adaptive draft budget (docs/scheduler.md): each module one part of it.

allocation: the survival rule; acceptance: the estimates; cost and table: the measured round
costs and how a cell is read from them; decide: the decision; state: the Scheduler the engine
runs; log: the decision log and its replay. Pure Python, no MLX.
"""

from worker.round import FREE_SIT_OUT, PIPELINE_WARM_ROUNDS, Cell  # noqa: F401
from worker.scheduler.acceptance import DECAY, FADE_WEIGHT, PRIOR_WEIGHT, SHARED_WEIGHT, Acceptance  # noqa: F401
from worker.scheduler.allocation import allocate, rank, survivals  # noqa: F401
from worker.scheduler.cost import (  # noqa: F401
    CATCH_UP_REASONS, DISCARD_REASONS, EXPLORE_MARGIN, FEW_OBSERVED, FEW_PLAIN_GAP, FEW_ROUNDS, HOPELESS_EVERY, MAX_AGE, MIN_SAMPLES,
    PACE_BOUND, PACE_WINDOW, PIPELINE_REASONS, PLAIN_GAP, PROBE_EVERY, PROBE_SHARE, STALE_GAP, TAKEN_REASONS,
    UNCERTAIN_SHARE, WINDOW, CostModel, feed_pieces, fit_feed)
from worker.scheduler.decide import (  # noqa: F401
    POSITIONS, Candidate, Decision, _best, _best_drafting, decide, plain_probe_interval, probe_interval)
from worker.scheduler.log import replay  # noqa: F401
from worker.scheduler import state  # noqa: F401
from worker.scheduler.state import MAX_HOLD, Scheduler  # noqa: F401
from worker.scheduler.table import estimate  # noqa: F401
