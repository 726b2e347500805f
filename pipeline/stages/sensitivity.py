"""What each tensor's format costs, and the recipe a size budget buys.

Sensitivity (stage `sensitivity`): for every layer, measured tensor role
(`pipeline.model.roles`: the routed experts', and with budget_roles = "all" also the
shared expert's and attention's) and candidate format, that one tensor is
quantized with the variant's own importance knobs and rounding (or its
`sensitivity_round`, "ls" to keep the measurement cheap under GPTQ), with the
quantize stage's code, while the rest of the layer stays at the source's
precision. What it changes in the layer's output is measured on the dumped
inputs, on the unseen dump (and in-sample on the calibration rows):

    rel_err = ||delta||^2 / ||y_ref||^2,  pooled over the trace's tokens,

y_ref the layer's routed output (`yr`), one denominator per layer so the
errors of all roles of a layer add up on one scale; delta is, for a routed
role, the routed block's output error after the variant's alpha (fitted on
the calibration rows, as calibration fits it: y_ref - alpha y_q, with the
dumped routing), for a shared-expert role the change of the gated shared
output, for an attention role the change of the attention output (a
sequence at a time). Ridge healing acts on the whole layer's residual through
the shared expert and is not part of the per-tensor measurement. Bytes are the
format's: weights / block size * block bytes. A non-routed tensor may also
stay as the source stores it, when that is a registered format: a row in the
source's format with its stored bytes and rel_err 0.

Allocation (stage `allocate`): one format per (layer, role) minimising the
summed rel_err with the summed bytes within budget_bpw bits per covered weight
(`kernels.allocate`, an exact multiple-choice knapsack); the chosen recipe is
`recipe.parquet`, which the quantize stage of the variant reads.
"""

from __future__ import annotations


import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
import pyarrow as pa

from moeheal.kernels import decode, encode
from moeheal.kernels.allocate import allocate
from moeheal.kernels.alpha import fit_alpha, relative_residual
from moeheal.pipeline.model import roles
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import read_part, write_parquet
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.progress import progress
from moeheal.pipeline.model.roles import ROLE_TENSOR, ROUTED_TENSOR
from moeheal.pipeline.stages.dump import open_dump, read_layer
from moeheal.pipeline.stages.quantize import (EXPERT_TENSORS, QuantizeParams, expert_weights, importance_plan,
                                              layer_matrices, matrix_plan)
from moeheal.pipeline.stages.routed import routed_output

OUTPUTS = ("sensitivity.parquet", "recipe.parquet", "allocation.parquet")

SENSITIVITY_SCHEMA = pa.schema([
    ("layer", pa.int32()), ("role", pa.string()), ("tensor", pa.string()), ("format", pa.string()),
    ("n_weights", pa.int64()), ("bytes", pa.int64()), ("bpw", pa.float64()),
    ("rel_err", pa.float64()), ("rel_err_in_sample", pa.float64()), ("alpha", pa.float64())])  # alpha: routed only
RECIPE_SCHEMA = pa.schema([
    ("layer", pa.int32()), ("role", pa.string()), ("tensor", pa.string()), ("format", pa.string()),
    ("n_weights", pa.int64()), ("bytes", pa.int64()), ("pred_err", pa.float64())])


@dataclass(frozen=True)
class SensitivityParams:
    """What a sensitivity table depends on: the candidate formats, the measured roles, the variant's
    quantization knobs (with no formats of its own: `quantize.quant` is None) and whether alpha
    heals. Budget variants that share these share one table, whatever their budgets."""

    formats: tuple[str, ...]
    roles: tuple[str, ...]
    alpha: bool
    quantize: QuantizeParams

    @classmethod
    def of(cls, variant, arch) -> "SensitivityParams":
        measured = replace(variant, round=variant.measured_round)
        return cls(formats=tuple(variant.candidates), roles=roles.chosen_roles(variant.budget_roles, arch),
                   alpha=variant.alpha, quantize=QuantizeParams.knobs_of(measured, None))


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


def tensor_bytes(fmt: str, n_weights: int) -> int:
    """Bytes of `n_weights` weights in `fmt` (whole blocks; the registry's geometry)."""
    cls = decode.format_of(fmt)
    return n_weights // cls.block_size * cls.type_size


def _row(layer: int, role: str, fmt: str, n_weights: int, n_bytes: int, errors: dict[str, float],
         alpha: float | None) -> dict[str, Any]:
    return {"layer": layer, "role": role, "tensor": f"blk.{layer}.{role}.weight", "format": fmt,
            "n_weights": n_weights, "bytes": n_bytes, "bpw": 8 * n_bytes / n_weights,
            "rel_err": errors["unseen"], "rel_err_in_sample": errors["in_sample"], "alpha": alpha}


def _routed_rows(layer: int, role: str, weights: dict[str, jax.Array], plan, data, params: "SensitivityParams"
                 ) -> list[dict[str, Any]]:
    """One routed role of one layer in every candidate format: the routed output error after alpha."""
    w = weights[role]  # (E, rows, cols)
    importance, hessians = plan[role]
    rows = []
    for fmt in params.formats:
        raw = encode.quantize_experts(w, fmt, importance, hessians)  # (E, rows, bytes)
        assert raw.nbytes == tensor_bytes(fmt, w.size), (fmt, raw.shape)
        w_q = decode.dequantize(raw, fmt, w.shape, keep_on_device=True)  # (E, rows, cols)
        y = {s: routed_output({**weights, role: w_q}, d) for s, d in data.items()}
        alpha = fit_alpha(data["in_sample"]["yr"], y["in_sample"]) if params.alpha else 1.0
        errors = {s: relative_residual(d["yr"], alpha * y[s]) for s, d in data.items()}
        rows.append(_row(layer, role, fmt, int(w.size), raw.nbytes, errors, float(alpha)))
    return rows


def _matrix_rows(source: GGUFModel, layer: int, role: str, matrices: dict[str, np.ndarray], data, seqs,
                 params: "SensitivityParams") -> list[dict[str, Any]]:
    """One shared-expert or attention role of one layer in every candidate format (and as the source
    stores it, where that is a registered format): the change of its block's output over ||yr||^2."""
    qp, hp = params.quantize, source.hp
    w = matrices[f"{role}.weight"]  # (rows, cols)
    importance, hessian = matrix_plan(role, matrices, data["in_sample"] if qp.importance else None,
                                      seqs["in_sample"], hp, source.arch, qp)
    scale = {s: float(np.sum(np.square(d["yr"], dtype=np.float64))) for s, d in data.items()}
    stored, _, stored_bytes = source.tensor_sizes()[f"blk.{layer}.{role}.weight"]
    rows = []
    for fmt in params.formats:
        raw = encode.quantize(w, fmt, importance, hessian)  # (rows, bytes)
        w_q = decode.dequantize(raw, fmt, w.shape)  # (rows, cols)
        errors = {s: float(np.sum(np.square(roles.output_change(role, w_q, matrices, d, seqs[s], hp, source.arch),
                                            dtype=np.float64)) / scale[s]) for s, d in data.items()}
        rows.append(_row(layer, role, fmt, int(w.size), raw.nbytes, errors, None))
    kept = stored.name.lower()
    if kept in decode.FORMATS and kept not in params.formats:
        rows.append(_row(layer, role, kept, int(w.size), stored_bytes, {s: 0.0 for s in data}, None))
    return rows


def measure_sensitivity(source: GGUFModel, cal, unseen, params: SensitivityParams) -> pa.Table:
    """One row per (layer, role, format): bytes and the relative output error (unseen and in-sample)
    with only that tensor quantized (after the variant's alpha, for a routed role)."""
    qp = params.quantize
    extra = roles.dump_arrays(params.roles)
    in_rows = slice(0, qp.cal_tokens or None)
    seqs = {"in_sample": roles.clip_sequences(cal.sequences("sensitivity"), in_rows),
            "unseen": unseen.sequences("sensitivity")} if extra else {"in_sample": [], "unseen": []}
    rows = []
    for layer in progress(source.moe_layers, desc="sensitivity", unit="layer"):
        weights = expert_weights(source, layer)
        plan = importance_plan(weights, cal if qp.importance else None, layer, qp)
        data = {"in_sample": read_layer(cal[str(layer)], in_rows, extra),
                "unseen": read_layer(unseen[str(layer)], slice(None), extra)}
        matrices = layer_matrices(source, layer) if set(params.roles) - set(EXPERT_TENSORS) else {}
        for role in params.roles:
            if role in EXPERT_TENSORS:
                rows += _routed_rows(layer, role, weights, plan, data, params)
            else:
                rows += _matrix_rows(source, layer, role, matrices, data, seqs, params)
    return pa.Table.from_pylist(rows, schema=SENSITIVITY_SCHEMA)


def fixed_size(source: GGUFModel, chosen: tuple[str, ...], shexp_down: str | None) -> tuple[int, int]:
    """Weights and bytes of every tensor whose format a recipe does not choose, as the assembled
    GGUF holds it: the source's, with the shared down projection in `shexp_down` where it is not
    chosen (None: no shared expert)."""
    weights = n_bytes = 0
    for name, (_, n, b) in source.tensor_sizes().items():
        match = ROLE_TENSOR.match(name)
        if match and match.group(2) in chosen:
            continue
        if shexp_down is not None and name.endswith(".ffn_down_shexp.weight"):
            b = tensor_bytes(shexp_down, n)
        weights, n_bytes = weights + n, n_bytes + b
    return weights, n_bytes


def least_bpw(source: GGUFModel, formats: tuple[str, ...], chosen: tuple[str, ...], fixed: tuple[int, int]) -> float:
    """The fewest bits per covered weight any recipe of `formats` takes: every chosen tensor in its
    cheapest format, plus the `fixed` (weights, bytes) the budget also covers."""
    sizes = [n for name, (_, n, _) in source.tensor_sizes().items()
             if (m := ROLE_TENSOR.match(name)) and m.group(2) in chosen]
    cheapest = sum(min(tensor_bytes(f, n) for f in formats) for n in sizes)
    return 8 * (cheapest + fixed[1]) / (sum(sizes) + fixed[0])


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
                costs[i, j], errors[i, j] = cell[(layer, role, fmt)]["bytes"], cell[(layer, role, fmt)]["rel_err"]
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
                       "n_weights": r["n_weights"], "bytes": r["bytes"], "pred_err": r["rel_err"]})
    summary = {"budget_bpw": params.budget_bpw, "budget_roles": params.roles, "n_weights": n_weights,
               "budget_bytes": budget + params.fixed_bytes, "bytes": result.cost + params.fixed_bytes,
               "bpw": 8 * (result.cost + params.fixed_bytes) / n_weights, "pred_err": result.error,
               "exact": result.exact, "unit_bytes": result.unit, "n_items": len(items),
               "n_formats": len(formats), "seconds": seconds}
    return pa.Table.from_pylist(recipe, schema=RECIPE_SCHEMA), summary


def build_sensitivity(out: Path, params: SensitivityParams, inputs: Mapping[str, Path],
                      log: Callable[[str], None]) -> None:
    """The sensitivity stage: `sensitivity.parquet`, the `source`'s tensors measured on the
    calibration (`dump`) and unseen (`unseen`) dumps."""
    model = open_model(inputs["source"])
    table = measure_sensitivity(model, open_dump(inputs["dump"], model.hp, model.moe_layers),
                                open_dump(inputs["unseen"], model.hp, model.moe_layers), params)
    write_parquet(out / "sensitivity.parquet", table)


def build_allocation(out: Path, params: AllocateParams, inputs: Mapping[str, Path],
                     log: Callable[[str], None]) -> None:
    """The allocate stage: `recipe.parquet` and a one-row `allocation.parquet` from the sensitivity
    stage's output (`sensitivity`)."""
    table = read_part(inputs["sensitivity"] / "sensitivity.parquet",
                      ("layer", "role", "format", "n_weights", "bytes", "rel_err"))
    recipe, summary = choose_recipe(table, params, params.where)
    log(f"[allocate] {params.where}: {summary['bpw']:.4f} bits per weight of {params.budget_bpw:g} "
        f"({summary['n_items']} tensors x {summary['n_formats']} formats, {summary['seconds']:.2f} s)")
    write_parquet(out / "recipe.parquet", recipe)
    write_parquet(out / "allocation.parquet", pa.Table.from_pylist([summary]))


# ---- what a written GGUF holds: its recipe and its size (read from the file, never estimated) --------
SIZES_SCHEMA = pa.schema([
    ("variant", pa.string()), ("kind", pa.string()), ("budget_bpw", pa.float64()), ("budget_roles", pa.string()),
    ("routed_weights", pa.int64()), ("routed_bytes", pa.int64()), ("routed_bpw", pa.float64()),
    ("total_weights", pa.int64()), ("total_bytes", pa.int64()), ("total_bpw", pa.float64()),
    ("file_bytes", pa.int64())])
GGUF_RECIPE_SCHEMA = pa.schema([
    ("variant", pa.string()), ("layer", pa.int32()), ("role", pa.string()), ("tensor", pa.string()),
    ("format", pa.string()), ("n_weights", pa.int64()), ("bytes", pa.int64()), ("pred_err", pa.float64()),
    ("chosen_by", pa.string()), ("sensitivity", pa.string())])


ROLE_ORDER = roles.ROUTED + roles.SHARED + roles.ATTENTION


def gguf_recipe(model: GGUFModel) -> list[dict[str, Any]]:
    """One row per tensor of a GGUF in a role a recipe may choose (`pipeline.model.roles`): layer, role,
    tensor, format (the ggml type's name, lower case), weights and bytes as stored."""
    rows = []
    for name, (ggml_type, n_weights, n_bytes) in model.tensor_sizes().items():
        match = ROLE_TENSOR.match(name)
        if match:
            rows.append({"layer": int(match.group(1)), "role": match.group(2), "tensor": name,
                         "format": ggml_type.name.lower(), "n_weights": n_weights, "bytes": n_bytes})
    return sorted(rows, key=lambda r: (r["layer"], ROLE_ORDER.index(r["role"])))


def gguf_size(model: GGUFModel) -> dict[str, Any]:
    """Weights and bytes of the routed experts and of every tensor, summed from the file's tensor table."""
    sizes = model.tensor_sizes()
    routed = [(n, b) for name, (_, n, b) in sizes.items() if ROUTED_TENSOR.match(name)]
    routed_w, routed_b = sum(n for n, _ in routed), sum(b for _, b in routed)
    total_w, total_b = sum(n for _, n, _ in sizes.values()), sum(b for _, _, b in sizes.values())
    return {"routed_weights": routed_w, "routed_bytes": routed_b, "routed_bpw": 8 * routed_b / routed_w,
            "total_weights": total_w, "total_bytes": total_b, "total_bpw": 8 * total_b / total_w,
            "file_bytes": model.path.stat().st_size}
