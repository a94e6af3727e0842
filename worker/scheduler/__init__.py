"""The adaptive draft budget (docs/scheduler.md; the allocation rule: docs/design.md, "Budget
selection and allocation"), a module for each part of it.

allocation: the survival rule the web UI mirrors; acceptance: the estimates; cost and table: the
measured round costs and how a cell is read from them; decide: the decision; probe: probes and
how often they come; state: the Scheduler the engine runs; log: the decision log and its replay.
Pure Python, no MLX.
"""

from worker.round import CATCH_UP_LAG, FREE_SIT_OUT, PIPELINE_WARM_ROUNDS, Cell
from worker.scheduler.acceptance import (CHANGE_NATS, DECAY, FADE_WEIGHT, FIRST_PRIOR, LONG_DECAY, MIN_RECENT,
                                         PRIOR_WEIGHT, RECENT_DECAY, SHARED_WEIGHT, Acceptance)
from worker.scheduler.allocation import POSITIONS, allocate, rank, survivals
from worker.scheduler.cost import (CATCH_UP_REASONS, DISCARD_REASONS, FEW_ROUNDS, MAX_AGE, MIN_SAMPLES, PACE_BOUND,
                                   PACE_WINDOW, PIPELINE_REASONS, SET_APART_KEPT, STALE_GAP, STALL_FACTOR, TAKEN_REASONS,
                                   WINDOW, CostModel, feed_pieces, fit_feed)
from worker.scheduler.decide import (DRAFT_LEAD, EXPLORE_MARGIN, FEW_PLAIN_GAP, PLAIN_GAP, SWITCH_HORIZON, Candidate, Decision,
                                     decide, plain_probe_interval)
from worker.scheduler.probe import (FEW_OBSERVED, HOPELESS_EVERY, MAX_FOLLOW_HIT, PLAUSIBLE_Z, PROBE_DEPTH, PROBE_EVERY,
                                    PROBE_ROWS, PROBE_SHARE, UNCERTAIN_LEAD, UNCERTAIN_SHARE, Probe,
                                    plausible_acceptance, probe_count, probe_interval, probe_lengths)
from worker.scheduler.log import LOG_BATCH, replay
from worker.scheduler.state import DECISION_SHARE, DEFAULT_B_MAX, MAX_HOLD, Scheduler
from worker.scheduler.table import estimate

__all__ = [
    "CATCH_UP_LAG", "FREE_SIT_OUT", "PIPELINE_WARM_ROUNDS", "Cell",
    "CHANGE_NATS", "DECAY", "FADE_WEIGHT", "FIRST_PRIOR", "LONG_DECAY", "MIN_RECENT", "PRIOR_WEIGHT", "RECENT_DECAY",
    "SHARED_WEIGHT", "Acceptance",
    "POSITIONS", "allocate", "rank", "survivals",
    "CATCH_UP_REASONS", "DISCARD_REASONS", "FEW_ROUNDS", "MAX_AGE", "MIN_SAMPLES", "PACE_BOUND", "PACE_WINDOW",
    "PIPELINE_REASONS", "SET_APART_KEPT", "STALE_GAP", "STALL_FACTOR", "TAKEN_REASONS", "WINDOW", "CostModel",
    "feed_pieces", "fit_feed",
    "DRAFT_LEAD", "EXPLORE_MARGIN", "FEW_PLAIN_GAP", "PLAIN_GAP", "SWITCH_HORIZON", "Candidate", "Decision", "decide",
    "plain_probe_interval",
    "FEW_OBSERVED", "HOPELESS_EVERY", "MAX_FOLLOW_HIT", "PLAUSIBLE_Z", "PROBE_DEPTH", "PROBE_EVERY", "PROBE_ROWS",
    "PROBE_SHARE", "UNCERTAIN_LEAD", "UNCERTAIN_SHARE", "Probe", "plausible_acceptance", "probe_count",
    "probe_interval", "probe_lengths",
    "LOG_BATCH", "replay",
    "DECISION_SHARE", "DEFAULT_B_MAX", "MAX_HOLD", "Scheduler",
    "estimate",
]
