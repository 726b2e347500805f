"""The `allocate` stage: a budget variant's recipe, one format per (layer, role) under its budget, chosen from
the sensitivity measurement."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from moeheal.kernels.allocate import allocate
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.lake.stage import Log, Stage

RECIPE_SCHEMA = pa.schema([
    ("layer", pa.int32()), ("role", pa.string()), ("tensor", pa.string()), ("format", pa.string()),
    ("n_weights", pa.int64()), ("bytes", pa.int64()), ("pred_err", pa.float64())])


@dataclass(frozen=True)
class AllocateParams:
    """The budget: bits per covered weight, the formats to choose from (their order breaks ties), the
    roles it covers, and (budget_roles = "all") the weights and bytes of the tensors it covers whose
    formats are fixed, as the written GGUF will hold them. `where` names the variant in an error
    and in the log: budget variants with the same budget share one allocation."""

    budget_bpw: float
    formats: tuple[str, ...]
    roles: str
    fixed_weights: int = 0
    fixed_bytes: int = 0
    where: str = field(default="", metadata={"fingerprint": False})

    @classmethod
    def of(cls, variant, fixed: tuple[int, int] = (0, 0), where: str = "") -> "AllocateParams":
        return cls(budget_bpw=variant.budget_bpw, formats=tuple(variant.candidates), roles=variant.budget_roles,
                   fixed_weights=fixed[0], fixed_bytes=fixed[1], where=where)


def budget_bytes(budget_bpw: float, n_weights: int) -> int:
    """The byte budget of `n_weights` weights at `budget_bpw` bits each (rounded down; a budget equal
    to a format's bits per weight admits that format exactly)."""
    return int(np.floor(budget_bpw * n_weights / 8 + 1e-9))


def choose_recipe(sensitivity: pa.Table, params: AllocateParams, where: str) -> tuple[pa.Table, dict[str, Any]]:
    """The recipe (one row per (layer, role)) and a summary row of the allocation."""
    rows = sensitivity.to_pylist()
    items = sorted({(r["layer"], r["role"]) for r in rows})
    cell = {(r["layer"], r["role"], r["format"]): r for r in rows}
    # the candidates, then any stored format a tensor may keep (`measure_sensitivity`); order breaks ties
    formats = [*params.formats, *sorted({r["format"] for r in rows} - set(params.formats))]
    costs = np.full((len(items), len(formats)), -1, np.int64)  # (items, formats); -1: not measured
    errors = np.zeros(costs.shape)
    for i, (layer, role) in enumerate(items):
        for j, fmt in enumerate(formats):
            if (layer, role, fmt) in cell:
                costs[i, j], errors[i, j] = cell[(layer, role, fmt)]["bytes"], cell[(layer, role, fmt)]["kl_est"]
    n_weights = sum(cell[(layer, role, params.formats[0])]["n_weights"] for layer, role in items)
    n_weights += params.fixed_weights  # the covered weights: the routed ones, and the rest with "all"
    budget = budget_bytes(params.budget_bpw, n_weights) - params.fixed_bytes
    start = time.perf_counter()
    try:
        result = allocate(costs, errors, budget)
    except ValueError as exc:
        raise InputError(f"{where}: budget_bpw {params.budget_bpw:g}: {exc}") from None
    seconds = time.perf_counter() - start
    recipe = []
    for (layer, role), j in zip(items, result.choice):
        r = cell[(layer, role, formats[int(j)])]
        recipe.append({"layer": layer, "role": role, "tensor": r["tensor"], "format": r["format"],
                       "n_weights": r["n_weights"], "bytes": r["bytes"], "pred_err": r["kl_est"]})
    summary = {"budget_bpw": params.budget_bpw, "budget_roles": params.roles, "n_weights": n_weights,
               "budget_bytes": budget + params.fixed_bytes, "bytes": result.cost + params.fixed_bytes,
               "bpw": 8 * (result.cost + params.fixed_bytes) / n_weights, "pred_err": result.error,
               "exact": result.exact, "unit_bytes": result.unit, "n_items": len(items),
               "n_formats": len(formats), "seconds": seconds}
    return pa.Table.from_pylist(recipe, schema=RECIPE_SCHEMA), summary


def build_allocation(out: Path, params: AllocateParams, *, sensitivity: Mapping[int, Path], log: Log) -> None:
    """The allocate stage: `recipe.parquet` and a one-row `allocation.parquet` from every layer's
    sensitivity unit (`sensitivity`, by layer)."""
    table = pa.concat_tables([read_part(sensitivity[layer] / "sensitivity.parquet",
                                        ("layer", "role", "format", "n_weights", "bytes", "kl_est"))
                              for layer in sorted(sensitivity)])
    recipe, summary = choose_recipe(table, params, params.where)
    log(f"[allocate] {params.where}: {summary['bpw']:.4f} bits per weight of {params.budget_bpw:g} "
        f"({summary['n_items']} tensors x {summary['n_formats']} formats, {summary['seconds']:.2f} s)")
    write_parquet(out / "recipe.parquet", recipe)
    write_parquet(out / "allocation.parquet", pa.Table.from_pylist([summary]))


STAGE = Stage("allocate", "parts", build_allocation, outputs=("recipe.parquet", "allocation.parquet"))
