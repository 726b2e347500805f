"""Heal quantized experts: per-layer alpha, shared-expert ridge, the healed GGUF.

Per layer, on the calibration dump (in_sample) and on the unseen dump:
- y_ref = the reference's routed output (`yr`), y_q = the quantized experts run
  on the same MoE inputs with the same routing (`moe_forward`).
- alpha = <y_ref, y_q> / ||y_q||^2 on the calibration dump, always from the
  unscaled quantization (idempotent), applied by scaling the fp16 block scales
  of the down projection, so the format is unchanged.
- ridge: R = y_ref - alpha y_q (what the routed experts still miss), Z = the
  shared expert's hidden activation times its sigmoid gate; dW minimises
  ||R - Z dW^T||^2 + lam ||dW||^2, lam = rho mean(diag(Z^T Z)); W' = W + eta dW,
  requantized to `shexp_down`. A layer whose ridge does not help on held-out
  blocks (lobo4) keeps W (still requantized), and `ridge_cv.applied` says so.
  Where a budget's recipe chose the shared expert's formats, Z comes from its
  quantized gate/up, the target is y_ref minus what they already change, and
  W' is requantized to the recipe's format for ffn_down_shexp (kept as the
  quantize stage wrote it when the ridge is not applied). Quantized attention
  is not seen here: the dumped MoE inputs are the reference's.
  The cross-validation refits alpha inside each fold, and `ridge_cv.chosen`
  marks the rho of the grid that does best on held-out blocks.
- Every residual is ||y_ref - y||^2 / ||y_ref||^2 with y the layer's total
  change in MoE output (routed + shared), so the ridge's "realized" gain
  includes what requantizing the shared expert costs.

Each layer is its own unit (`build_calibrate`): it reads the quantize unit of
the same layer and that layer's dump rows, and writes that layer's tensors and
metric rows, so a calibrate-only knob (ridge_rho, say) recomputes these units
and the assembly, never quantization. The assembly (`assemble_gguf`) reads
every unit and streams the GGUF a tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pyarrow as pa

from moeheal.kernels import decode, encode
from moeheal.kernels.alpha import fit_alpha, oracle_from_gram, output_gram, residual_from_gram
from moeheal.kernels.ridge import alpha_ridge_cv_sweep, effective_dof, matrix_rank, ridge_stats, solve_ridge
from moeheal.kernels.threads import one_blas_thread
from moeheal.pipeline.data.dumps import open_dump, read_layer
from moeheal.pipeline.data.units import EXPERT_TENSORS, load_quantized
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.layers import swiglu
from moeheal.pipeline.model.routed import routed_inputs_on_device, routed_output
from moeheal.pipeline.progress import Phases

OUTPUTS = ("layer_<i>.npz", "layer_metrics.parquet", "ridge_cv.parquet")  # a unit's: its layer and its rows


@dataclass(frozen=True)
class CalibrateParams:
    """The knobs that reach healing. Without a shared expert there is no ridge and no requantized
    shared down projection, so `ridge_rho`, `ridge_eta` and `shexp_down` are None (not fingerprinted);
    `shexp_down` is None too where a budget's recipe chooses the shared down projection's format.
    No variant name: two variants with the same knobs (one tuned end to end after assembly) share
    their units, and the published rows are named when the units are read (`UNIT_COLUMNS`)."""

    alpha: bool
    cal_tokens: int
    ridge_rho: float | None = None
    ridge_eta: float | None = None
    shexp_down: str | None = None
    layer: int | None = None  # the unit's layer
    inputs: str | None = None  # "healed": `dump` is the layer's healed-inputs dump (stages/healed_dump.py)

    @classmethod
    def of(cls, variant, shared_expert: bool) -> "CalibrateParams":
        inputs = variant.inputs if variant.healed_inputs else None
        base = cls(alpha=variant.alpha, cal_tokens=variant.cal_tokens, inputs=inputs)
        if not shared_expert:
            return base
        recipe_chooses = variant.budgeted and variant.budget_roles == "all"  # roles.chosen_roles: SHARED too
        return cls(alpha=variant.alpha, cal_tokens=variant.cal_tokens,
                   ridge_rho=variant.ridge_rho, ridge_eta=variant.ridge_eta,
                   shexp_down=None if recipe_chooses else variant.shexp_down, inputs=inputs)


# Each layer's unit writes its own rows; declared, so every unit's part concatenates with the others.
METRICS_SCHEMA = pa.schema([("variant", pa.string()), ("layer", pa.int64()), ("split", pa.string()),
                            ("resid_alpha1", pa.float64()), ("alpha", pa.float64()), ("resid_alpha", pa.float64()),
                            ("alpha_oracle", pa.float64()), ("resid_oracle", pa.float64()),
                            ("resid_ridge", pa.float64())])


RIDGE_CV_SCHEMA = pa.schema([("variant", pa.string()), ("layer", pa.int32()), ("rho", pa.float64()),
                             ("split", pa.string()), ("rel_gain", pa.float64()), ("rank_z", pa.int32()),
                             ("dof", pa.float64()), ("chosen", pa.bool_()), ("configured", pa.bool_()),
                             ("applied", pa.bool_())])


# A unit writes its rows without the variant column (the first of both schemas), added when read.
UNIT_COLUMNS = 1


RHO_GRID = (0.25, 1.0, 6.0, 24.0)


CV_SPLITS = ("in_sample", "lobo4", "even_odd")


def tensor_format(arrays: dict[str, np.ndarray], name: str) -> str:
    """The format a quantized expert tensor was written in (recorded beside its bytes)."""
    return str(arrays[f"{name}.format"])


def scale_expert_scales(arrays: dict[str, np.ndarray], name: str, factor: float, where: str) -> np.ndarray:
    """`name`'s bytes with every super-block scale (and min) times `factor`: alpha, in the format itself.

    The format class knows where its scales sit; a product that leaves fp16's
    range is refused (an input error naming the layer), never written as inf or 0.
    """
    try:
        return decode.format_of(tensor_format(arrays, name)).scale_scales(arrays[name], factor)
    except ValueError as exc:
        raise InputError(f"{where}: alpha {factor:.6g} on {name}: {exc}") from None


def dequantized_experts(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """The layer's quantized routed experts in float32 on the default device, where the routed
    forward runs (a real layer's are GBs: they never cross to the host)."""
    return {name: dequantized_matrix(arrays, name, keep_on_device=True) for name in EXPERT_TENSORS}


def _gated_hidden(source: GGUFModel, layer: int, data: dict[str, np.ndarray],
                  arrays: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Z = gate(x) * hh: what the shared down projection multiplies, gate the family's
    (`Architecture.shared_expert_gate`: a sigmoid gate, or 1 for an ungated shared expert); with
    `arrays` holding quantized ffn_gate_shexp / ffn_up_shexp (a recipe chose them), hh from those."""
    gate_params = {name: source.tensor(f"blk.{layer}.{name}") for name in source.arch.shared_gate_tensors}
    gate = source.arch.shared_expert_gate(gate_params, data["mixed"])  # (T,)
    hh = data["hh"]  # (T, f) from the source's gate/up
    if arrays is not None and ("ffn_gate_shexp" in arrays or "ffn_up_shexp" in arrays):
        w_gate, w_up = (dequantized_matrix(arrays, name) if name in arrays
                        else source.tensor(f"blk.{layer}.{name}.weight") for name in ("ffn_gate_shexp", "ffn_up_shexp"))
        hh = np.asarray(swiglu(data["mixed"], w_gate, w_up))  # (T, f)
    return hh * gate[:, None]  # (T, f)


def dequantized_matrix(arrays: dict[str, np.ndarray], name: str, keep_on_device: bool = False
                       ) -> np.ndarray | jax.Array:
    """A quantized tensor of the layer's arrays back to float32, in the shape recorded beside it."""
    return decode.dequantize(arrays[name], tensor_format(arrays, name), tuple(arrays[f"{name}.shape"]),
                              keep_on_device=keep_on_device)


def calibrate_layer(out: Path, source: GGUFModel, quant_dir: Path, cal, unseen, params: CalibrateParams,
                    layer: int, log: Log = print) -> None:
    """Write one layer's healed tensors (`layer_<layer>.npz`) and its rows of `layer_metrics.parquet`
    and `ridge_cv.parquet`, from the quantize unit of the same layer (`quant_dir`) and that layer's
    rows of the dumps."""
    out.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    splits = {"in_sample": cal, **({"unseen": unseen} if unseen is not None else {})}
    shared = source.arch.has_shared_expert  # the ridge runs through the shared down projection
    metrics, cv_rows = [], []
    arrays = load_quantized(quant_dir, layer)
    phases.done("load")
    in_sample_rows = slice(0, params.cal_tokens or None)  # the rows quantization saw
    groups = {s: read_layer(d[str(layer)], in_sample_rows if s == "in_sample" else slice(None))
              for s, d in splits.items()}
    phases.done("read")
    # copied to the device once: both routed outputs read them, and every sum below runs where they are
    on_device = {s: routed_inputs_on_device(g) for s, g in groups.items()}
    y_ref = {s: d["yr"] for s, d in on_device.items()}  # (T, d) each
    experts_f32 = dequantized_experts(arrays)  # once: a real layer is hundreds of millions of weights
    y_q = {s: routed_output(experts_f32, d) for s, d in on_device.items()}  # (T, d) each, on the device
    phases.done("routed output", y_q)
    alpha = fit_alpha(y_ref["in_sample"], y_q["in_sample"]) if params.alpha else 1.0
    phases.done("alpha")
    arrays["ffn_down_exps"] = scale_expert_scales(arrays, "ffn_down_exps", alpha, f"layer {layer}")
    experts_f32["ffn_down_exps"] = dequantized_matrix(arrays, "ffn_down_exps", keep_on_device=True)  # alpha in its scales
    y_healed = {s: routed_output(experts_f32, d) for s, d in on_device.items()}  # (T, d) each, on the device
    del experts_f32
    phases.done("routed output", y_healed)

    if shared:  # the ridge's statistics in float64 on the host, from host copies of the outputs
        y_ref = {s: g["yr"] for s, g in groups.items()}
        y_q, y_healed = ({s: np.asarray(y[s]) for s in groups} for y in (y_q, y_healed))
        w_down = source.tensor(f"blk.{layer}.ffn_down_shexp.weight")  # (d, f)
        z = {s: _gated_hidden(source, layer, g) for s, g in groups.items()}  # (T, f) the source's
        z_q = {s: _gated_hidden(source, layer, g, arrays) for s, g in groups.items()}  # (T, f) as written
        moved = {s: (z_q[s] - z[s]) @ w_down.T for s in groups}  # (T, d) what quantized gate/up change
        target = y_ref["in_sample"] - moved["in_sample"]  # (T, d) what routed + ridge should give
        residual = target - y_healed["in_sample"]  # (T, d)
        rho, eta = params.ridge_rho, params.ridge_eta
        gram, cross, _, _ = ridge_stats(z_q["in_sample"], residual)
        rank = matrix_rank(gram)
        grid_rows, best_rho, applied = ridge_cv_rows(z_q["in_sample"], target, y_q["in_sample"],
                                                     gram, rank, rho, eta, refit_alpha=params.alpha)
        cv_rows += [{"layer": layer, **r} for r in grid_rows]
        corrected = w_down + eta * solve_ridge(gram, cross, rho) if applied else w_down  # (d, f)
        chosen = "ffn_down_shexp.format" in arrays  # a recipe chose its format (and quantized it)
        if applied or not chosen:  # requantized by least squares (with its importance, if any)
            fmt = tensor_format(arrays, "ffn_down_shexp") if chosen else params.shexp_down
            arrays["ffn_down_shexp"] = encode.quantize(corrected, fmt, arrays.get("ffn_down_shexp.importance"))
            arrays["ffn_down_shexp.format"], arrays["ffn_down_shexp.shape"] = np.asarray(fmt), np.asarray(w_down.shape)
        w_requant = dequantized_matrix(arrays, "ffn_down_shexp")  # (d, f)
        shexp_delta = {s: z_q[s] @ w_requant.T - z[s] @ w_down.T for s in groups}  # (T, d)
        phases.done("ridge")
    # every residual below from one pass over each split's outputs: y_ref, y_q, y_healed (and the shared
    # expert's change), the oracle alpha fitted on the split itself among them
    ref, quant, healed, moved_shared = range(4)
    grams = {s: output_gram(y_ref[s], y_q[s], y_healed[s], *([shexp_delta[s]] if shared else []))
             for s in groups}  # (k, k) each
    with_ridge = {healed: 1.0, **({moved_shared: 1.0} if shared else {})}
    if shared and rho > 0:  # realized gain of the configured rho after requantization, per split
        # ||R - S||^2 / ||R||^2 - 1 with R = y_ref - y_healed and S the shared expert's change
        cv_rows += [{"layer": layer, "rho": rho, "split": f"{s}_realized",
                     "rel_gain": residual_from_gram(g, ref, with_ridge) / residual_from_gram(g, ref, {healed: 1.0})
                     - 1.0,
                     "rank_z": int(rank), "dof": float(effective_dof(gram, rho)),
                     "chosen": rho == best_rho, "configured": True, "applied": bool(applied)}
                    for s, g in grams.items()]
    for s, g in grams.items():
        oracle, resid_oracle = oracle_from_gram(g, ref, quant)
        metrics.append({
            "layer": layer, "split": s,
            "resid_alpha1": residual_from_gram(g, ref, {quant: 1.0}),
            "alpha": float(alpha),
            "resid_alpha": residual_from_gram(g, ref, {healed: 1.0}),
            "alpha_oracle": float(oracle),
            "resid_oracle": resid_oracle,
            "resid_ridge": residual_from_gram(g, ref, with_ridge),
        })
    phases.done("residuals")
    np.savez(out / f"layer_{layer}.npz", **arrays, alpha=np.float32(alpha))
    for name, rows, schema in (("layer_metrics", metrics, METRICS_SCHEMA), ("ridge_cv", cv_rows, RIDGE_CV_SCHEMA)):
        unit_schema = pa.schema(list(schema)[UNIT_COLUMNS:])
        write_parquet(out / f"{name}.parquet", pa.Table.from_pylist(rows, schema=unit_schema))
    phases.done("write")
    log(f"calibrate layer {layer}: {phases}")


def ridge_cv_rows(z: np.ndarray, y_ref: np.ndarray, y_q: np.ndarray, gram: np.ndarray, rank: int, rho: float,
                  eta: float, refit_alpha: bool) -> tuple[list[dict[str, Any]], float, bool]:
    """One layer's cross-validation over the rho grid (and the configured rho, if not 0).

    Z (T, f), y_ref and the unscaled quantized output y_q (T, d) on the
    calibration rows; gram = Z^T Z and rank its rank (the fit's statistics).
    Alpha is refitted inside every fold (`alpha_ridge_cv_sweep`), so held-out
    rows shape neither alpha nor the ridge; the residual is y_ref - alpha y_q,
    alpha before its fp16 rounding into the block scales (the realized rows
    measure the rounded, requantized result). Returns the rows (rho, split,
    rel_gain, rank_z, dof, chosen, configured, applied), the rho of the grid
    with the best held-out (lobo4) gain, and whether the configured rho is
    applied: it helps on held-out blocks. The configured rho stays the one
    applied; `chosen` shows where the grid would have pointed.
    """
    grid = sorted({*RHO_GRID, rho} - {0.0})
    gains = {split: alpha_ridge_cv_sweep(z, y_ref, y_q, grid, eta, split, refit_alpha) for split in CV_SPLITS}
    best = grid[int(np.argmin(gains["lobo4"]))]
    applied = rho > 0 and bool(gains["lobo4"][grid.index(rho)] < 0)
    dof = {grid_rho: float(effective_dof(gram, grid_rho)) for grid_rho in grid}  # one eigvalsh per rho, not per split
    rows = [{"rho": grid_rho, "split": split, "rel_gain": float(gains[split][i]), "rank_z": int(rank),
             "dof": dof[grid_rho], "chosen": grid_rho == best,
             "configured": grid_rho == rho, "applied": grid_rho == rho and applied}
            for i, grid_rho in enumerate(grid) for split in CV_SPLITS]
    return rows, best, applied


def build_calibrate(out: Path, params: CalibrateParams, *, source: Path, quantized: Path, dump: Path,
                    unseen: Path | None = None, log: Log) -> None:
    """One unit of the calibrate stage: alpha and ridge for layer `params.layer` of one variant's
    quantized experts (`quantized`, the quantize unit of that layer), on the dumps (`dump`: with
    healed inputs, the layer's healed-inputs dump; and
    `unseen` if there is one), from the `source`.

    The unit runs on one host BLAS thread (`kernels.threads`), whatever the caller's environment:
    the ridge's solve and eigendecompositions and the float64 products of its statistics give other
    last bits with other thread counts (the ridge_cv table's dof and gains, and the requantized
    shared down projection), and a unit's bytes must be those of its key however it ran."""
    assert params.layer is not None, "a calibrate unit is one layer"
    model = open_model(source)
    cal_layers = (params.layer,) if params.inputs is not None else model.moe_layers  # a healed-inputs dump: one layer
    with one_blas_thread():
        calibrate_layer(out, model, quantized, open_dump(dump, model.hp, cal_layers),
                        open_dump(unseen, model.hp, model.moe_layers) if unseen is not None else None,
                        params, params.layer, log)


STAGE = Stage("calibrate", "quant", build_calibrate, outputs=("layer_{layer}.npz", "layer_metrics.parquet"))
