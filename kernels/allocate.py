"""Choose one format per tensor under a size budget: a multiple-choice knapsack.

Items are tensors (one per (layer, role)), choices their candidate formats;
each choice costs a whole number of bytes and adds a predicted error. The
allocation minimises the summed error subject to the summed bytes being at
most the budget, exactly, by dynamic programming over the budget in units of
the greatest common divisor of every cost (block granularity: every cost is a
whole number of blocks times a block's bytes, so the grid is coarse and small).

Should that grid still be too fine (`max_units`), costs are rounded *up* to a
coarser unit and the budget down, so the answer always fits the true budget;
it is then optimal for the rounded costs and `exact` is False.

A pure function of arrays: no files, no config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

MAX_UNITS = 1 << 20  # DP columns; items x MAX_UNITS bytes of back-pointers at most


@dataclass(frozen=True)
class Allocation:
    """The chosen choice of each item, and what they add up to."""

    choice: np.ndarray  # (n_items,) int: column of `costs` / `errors` chosen per item
    error: float  # summed error of the choices
    cost: int  # summed cost of the choices (bytes)
    exact: bool  # True: optimal for the exact costs; False: optimal for costs rounded up to `unit`
    unit: int  # the DP's cost unit in bytes


def allocate(costs: np.ndarray, errors: np.ndarray, budget: int, max_units: int = MAX_UNITS) -> Allocation:
    """Minimise sum_i errors[i, c_i] subject to sum_i costs[i, c_i] <= budget.

    costs (n_items, n_choices) int64 bytes, with a negative cost marking a
    choice that is not available for that item; errors (n_items, n_choices)
    float. ValueError when no choice fits (the budget is below the cheapest
    recipe) or an item has no available choice. Ties go to the lower column.
    """
    costs = np.asarray(costs, np.int64)
    errors = np.asarray(errors, np.float64)
    if costs.ndim != 2 or costs.shape != errors.shape:
        raise ValueError(f"costs {costs.shape} and errors {errors.shape} must be the same (items, choices) shape")
    n_items, n_choices = costs.shape
    if n_choices > 255:
        raise ValueError(f"{n_choices} choices per item; at most 255")
    available = costs >= 0  # (n, m)
    if not available.any(axis=1).all():
        raise ValueError(f"item {int(np.argmin(available.any(axis=1)))} has no available choice")
    if not np.isfinite(errors[available]).all():
        raise ValueError("errors of available choices must be finite")
    cheapest = int(np.where(available, costs, np.iinfo(np.int64).max).min(axis=1).sum())
    if cheapest > budget:
        raise ValueError(f"budget {budget} bytes is below the cheapest choice of every item ({cheapest} bytes)")

    unit = reduce(math.gcd, (int(c) for c in costs[available] if c > 0), 0) or 1
    exact = budget // unit <= max_units
    if not exact:
        unit = -(-budget // max_units)  # ceil: budget // unit <= max_units
    units = np.where(available, -(-costs // unit), -1)  # (n, m) costs in units, rounded up
    width = budget // unit + 1
    if int(np.where(available, units, np.iinfo(np.int64).max).min(axis=1).sum()) >= width:
        raise ValueError(f"budget {budget} bytes leaves no room once costs are rounded to {unit}-byte units")

    best = np.zeros(width)  # (W,) least error with total cost <= w, over the items so far
    back = np.zeros((n_items, width), np.uint8)  # (n, W) choice taken at (item, w)
    for i in range(n_items):
        new = np.full(width, np.inf)  # (W,)
        for j in range(n_choices):
            c = int(units[i, j])
            if c < 0 or c >= width:
                continue
            cand = np.full(width, np.inf)
            cand[c:] = best[:width - c] + errors[i, j]
            better = cand < new  # strict: ties keep the lower column
            new[better] = cand[better]
            back[i, better] = j
        best = new
    choice = np.zeros(n_items, np.int64)
    w = width - 1
    for i in range(n_items - 1, -1, -1):
        choice[i] = back[i, w]
        w -= int(units[i, choice[i]])
    picked = np.arange(n_items), choice
    return Allocation(choice=choice, error=float(errors[picked].sum()), cost=int(costs[picked].sum()),
                      exact=bool(exact), unit=int(unit))
