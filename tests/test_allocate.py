"""The budget allocation (multiple-choice knapsack) against brute force in float64."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moeheal.kernels.allocate import allocate


def brute_force(costs: np.ndarray, errors: np.ndarray, budget: int) -> float:
    best = np.inf
    for combo in itertools.product(*(range(costs.shape[1]) for _ in range(costs.shape[0]))):
        picked = np.arange(costs.shape[0]), np.asarray(combo)
        if (costs[picked] >= 0).all() and costs[picked].sum() <= budget:
            best = min(best, float(np.float64(errors[picked]).sum()))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_optimal_on_small_instances(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    block = int(rng.choice([2, 6, 66]))
    costs = rng.integers(1, 12, (n, m)) * block  # whole blocks, as tensor bytes are
    if seed % 3 == 0 and m > 1:
        costs[0, -1] = -1  # a format not available for one tensor
    errors = rng.random((n, m))
    lo = np.where(costs >= 0, costs, 10**9).min(axis=1).sum()
    hi = costs.max(axis=1).sum()
    budget = int(rng.integers(lo, hi + 1))
    result = allocate(costs, errors, budget)
    picked = np.arange(n), result.choice
    assert result.exact
    assert (costs[picked] >= 0).all() and result.cost == costs[picked].sum() <= budget
    assert result.error == pytest.approx(brute_force(costs, errors, budget), abs=1e-12)


def test_coarse_units_stay_within_the_budget_and_near_the_optimum():
    rng = np.random.default_rng(5)
    costs = rng.integers(1000, 5000, (5, 4)) * 7 + 1  # gcd 1: a fine grid
    errors = rng.random((5, 4))
    budget = int(costs.mean(axis=1).sum())
    coarse = allocate(costs, errors, budget, max_units=500)
    assert not coarse.exact and coarse.cost <= budget
    assert coarse.error <= brute_force(costs, errors, budget - 5 * coarse.unit) + 1e-12  # optimum at a tighter budget


def test_infeasible_budget_and_missing_choices_are_errors():
    costs = np.array([[4, 8], [4, 8]])
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate(costs, np.ones((2, 2)), 7)
    with pytest.raises(ValueError, match="no available choice"):
        allocate(np.array([[-1, -1]]), np.ones((1, 2)), 100)


def test_a_generous_budget_takes_the_least_error_everywhere():
    costs = np.array([[2, 3, 6], [2, 3, 6]])
    errors = np.array([[0.9, 0.5, 0.1], [0.8, 0.4, 0.2]])
    result = allocate(costs, errors, 100)
    assert result.choice.tolist() == [2, 2] and result.cost == 12
