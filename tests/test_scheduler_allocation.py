"""The allocation rule (worker/scheduler/allocation.py): survivals ranked across requests, the top
B taken, prefix-closed; the web UI's allocation view mirrors it (tests/test_browser.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from worker.scheduler import allocate, rank, survivals


EXAMPLE = {"A": [0.95, 0.90, 0.85], "B": [0.80, 0.60, 0.40], "C": [0.60, 0.50, 0.30]}


def test_design_example():
    surv = [survivals(a) for a in EXAMPLE.values()]
    assert [[round(s, 3) for s in row] for row in surv] == [[0.95, 0.855, 0.727], [0.8, 0.48, 0.192], [0.6, 0.3, 0.09]]
    assert " ".join("ABC"[r] + str(j) for r, j in rank(surv)) == "A1 A2 B1 A3 C1 B2 C2 B3 C3"
    assert allocate(surv, 4) == [3, 1, 0]
    assert allocate(surv, 0) == [0, 0, 0] and allocate(surv, 9) == [3, 3, 3]


def test_ties_go_by_request_then_position():
    assert rank([[0.5, 0.5], [0.5]]) == [(0, 1), (0, 2), (1, 1)]
    assert allocate([[0.5, 0.5], [0.5]], 2) == [2, 0]


def test_ties_are_decided_on_rounded_scores_not_float_noise():
    # 0.7 * 0.7 is 0.48999999999999994 in doubles: equal to B1's 0.49 at the stated precision
    surv = [survivals([0.7, 0.7]), survivals([0.49])]
    assert surv[0][1] < surv[1][0]
    assert rank(surv) == [(0, 1), (0, 2), (1, 1)]
    assert allocate(surv, 2) == [2, 0]
    # noise below the precision is a tie; a difference above it still ranks
    assert rank([[0.3], survivals([0.5, 0.6])]) == [(1, 1), (0, 1), (1, 2)]
    assert rank([[0.3], [0.3 + 1e-15]]) == [(0, 1), (1, 1)]
    assert rank([[0.3], [0.3 + 2e-9]]) == [(1, 1), (0, 1)]


def _oracle(surv, budget):
    """Every prefix-closed allocation of exactly `budget` positions; the best total survival."""
    best, winners = -1.0, []
    for lengths in itertools.product(*(range(len(row) + 1) for row in surv)):
        if sum(lengths) != budget:
            continue
        total = sum(sum(row[:n]) for row, n in zip(surv, lengths))
        if total > best + 1e-12:
            best, winners = total, [list(lengths)]
        elif abs(total - best) <= 1e-12:
            winners.append(list(lengths))
    return best, winners


@pytest.mark.parametrize("seed", range(40))
def test_allocation_matches_brute_force(seed):
    rng = random.Random(seed)
    levels = [0.2, 0.5, 0.5, 0.8, 1.0]  # repeated values make ties
    surv = [survivals([rng.choice(levels) if seed % 2 else rng.random() for _ in range(rng.randint(1, 4))])
            for _ in range(rng.randint(1, 4))]
    for budget in range(sum(len(r) for r in surv) + 1):
        lengths = allocate(surv, budget)
        best, winners = _oracle(surv, budget)
        assert sum(lengths) == budget
        assert lengths in winners, (surv, budget, lengths, best)
