"""What each tensor's format costs, and the recipe a size budget buys.

Sensitivity (stage `sensitivity`, one unit per MoE layer, so that the layers are measured in
parallel wherever the quantize units are: `heal --workers`, `--shard`, Ray): for the unit's layer, every
measured tensor role (`pipeline.model.roles`: the routed experts', and with budget_roles = "all" also the
shared expert's and attention's) and candidate format, that one tensor is
quantized with the variant's own importance knobs and rounding (or its
`sensitivity_round`, "ls" to keep the measurement cheap under GPTQ), with the
quantize stage's code, while the rest of the layer stays at the source's
precision. What it changes in the layer's output is measured on the dumped
inputs, on the unseen dump (and in-sample on `FIT_ROWS` of the calibration rows):

    rel_err = ||delta||^2 / ||y_ref||^2,  pooled over the trace's tokens,
    kl_est  = (1/2) sum_tc F_tc delta_tc^2 / T,

y_ref the layer's routed output (`yr`), one denominator per layer so the
errors of all roles of a layer add up on one scale; kl_est is what the error
is estimated to cost the model's mean KL per token to the reference, to second
order, F_tc the reference's Fisher information with respect to the layer's
output at token t and channel c (its diagonal, estimated over the unseen trace
by the guidance stage; `kernels.fisher`), so that errors of different layers add up on one scale,
the model's: a layer whose output is small beside its error, or whose error
the rest of the model forgives, is cheap by rel_err, not by kl_est
(bench/experiments/kl_sensitivity.py measures both against the model's KL with
each tensor quantized alone). delta is, for a routed
role, the routed block's output error after the variant's alpha (fitted on
at most `FIT_ROWS` of the calibration rows, evenly strided, as calibration fits it on
all of them: y_ref - alpha y_q, with the dumped routing), for a shared-expert role
the change of the gated shared output, for an attention role the change of the attention output (a
sequence at a time; it enters the residual stream before the MoE block, and
kl_est weighs it by the layer output's Fisher, leaving out the MoE block's
Jacobian between the two). Ridge healing acts on the whole layer's residual through
the shared expert and is not part of the per-tensor measurement. Bytes are the
format's: weights / block size * block bytes. A non-routed tensor may also
stay as the source stores it, when that is a registered format: a row in the
source's format with its stored bytes and rel_err 0.

Allocation (stage `allocate`, over every layer's unit): one format per (layer, role) minimising the
summed kl_est with the summed bytes within budget_bpw bits per covered weight
(`kernels.allocate`, an exact multiple-choice knapsack); the chosen recipe is
`recipe.parquet`, which the quantize stage of the variant reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pyarrow as pa

from moeheal.kernels import decode, encode
from moeheal.kernels.alpha import fit_alpha, relative_residual
from moeheal.kernels.fisher import kl_estimate
from moeheal.kernels.threads import one_blas_thread
from moeheal.pipeline.data.dumps import open_dump, read_layer
from moeheal.pipeline.data.fisher import read_fisher_values
from moeheal.pipeline.data.units import EXPERT_TENSORS
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.sizes import tensor_bytes
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model import roles
from moeheal.pipeline.model.routed import routed_inputs_on_device, routed_output
from moeheal.pipeline.progress import Phases
from moeheal.pipeline.stages.quantize import (
    QuantizeParams,
    expert_weights,
    importance_plan,
    layer_matrices,
    matrix_plan,
)

# Calibration rows a routed role's alpha and in-sample error are measured on, evenly strided over the dump's:
# alpha is one scalar per (role, format), which 8,192 rows of 2,048 channels fix far below the differences
# between formats, while each candidate (15 a layer in `init`'s recipe) ran its routed block over every row
# (65,536 at the default data, 8 times the unseen trace's 8,192): 4.3-4.5 s of a 30B layer's 10.7 s on an
# H100 (bench/RESULTS.md). The importance statistics still read every row.
FIT_ROWS = 8192


SENSITIVITY_SCHEMA = pa.schema([
    ("layer", pa.int32()), ("role", pa.string()), ("tensor", pa.string()), ("format", pa.string()),
    ("n_weights", pa.int64()), ("bytes", pa.int64()), ("bpw", pa.float64()),
    ("rel_err", pa.float64()), ("rel_err_in_sample", pa.float64()), ("kl_est", pa.float64()),
    ("alpha", pa.float64())])  # alpha: routed only


@dataclass(frozen=True)
class SensitivityParams:
    """What a layer's sensitivity unit depends on: the candidate formats, the measured roles, the variant's
    quantization knobs (with no formats of its own: `quantize.quant` is None), whether alpha heals, and
    the layer. Budget variants that share the rest share one unit per layer, whatever their budgets."""

    formats: tuple[str, ...]
    roles: tuple[str, ...]
    alpha: bool
    quantize: QuantizeParams
    layer: int | None = None  # the unit's layer (None: the knobs alone, before `HealRun.sensitivity` names it)

    @classmethod
    def of(cls, variant, arch) -> "SensitivityParams":
        measured = replace(variant, round=variant.measured_round)
        return cls(formats=tuple(variant.candidates), roles=roles.chosen_roles(variant.budget_roles, arch),
                   alpha=variant.alpha, quantize=QuantizeParams.knobs_of(measured, None))


def _row(layer: int, role: str, fmt: str, n_weights: int, n_bytes: int, errors: dict[str, float],
         kl_est: float, alpha: float | None) -> dict[str, Any]:
    return {"layer": layer, "role": role, "tensor": f"blk.{layer}.{role}.weight", "format": fmt,
            "n_weights": n_weights, "bytes": n_bytes, "bpw": 8 * n_bytes / n_weights,
            "rel_err": errors["unseen"], "rel_err_in_sample": errors["in_sample"], "kl_est": kl_est, "alpha": alpha}


def _routed_rows(layer: int, role: str, weights: dict[str, jax.Array], plan, data: dict[str, dict[str, jax.Array]],
                 fisher: np.ndarray, params: "SensitivityParams", phases: Phases) -> list[dict[str, Any]]:
    """One routed role of one layer in every candidate format: the routed output error after alpha;
    `data` each split's routed inputs on the device (`routed_inputs_on_device`); the seconds of the
    rounding and of the routed outputs and their errors added to `phases`."""
    w = weights[role]  # (E, rows, cols)
    importance, hessians = plan[role]
    rows = []
    for fmt in params.formats:
        raw = encode.quantize_experts(w, fmt, importance, hessians)  # (E, rows, bytes)
        assert raw.nbytes == tensor_bytes(fmt, w.size), (fmt, raw.shape)
        phases.done("rounding", raw)
        w_q = decode.dequantize(raw, fmt, w.shape, keep_on_device=True)  # (E, rows, cols)
        y = {s: routed_output({**weights, role: w_q}, d) for s, d in data.items()}  # (T, d) each
        alpha = fit_alpha(data["in_sample"]["yr"], y["in_sample"]) if params.alpha else 1.0
        errors = {s: relative_residual(d["yr"], y[s], alpha) for s, d in data.items()}
        delta = np.asarray(alpha * y["unseen"] - data["unseen"]["yr"])  # (T, d)
        rows.append(_row(layer, role, fmt, int(w.size), raw.nbytes, errors, kl_estimate(fisher, delta), float(alpha)))
        phases.done("outputs")
    return rows


def _matrix_rows(source: GGUFModel, layer: int, role: str, matrices: dict[str, np.ndarray], data, seqs,
                 fisher: np.ndarray, params: "SensitivityParams") -> list[dict[str, Any]]:
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
        change = {s: np.asarray(roles.output_change(role, w_q, matrices, d, seqs[s], hp, source.arch))
                  for s, d in data.items()}  # (T, d) each
        errors = {s: float(np.sum(np.square(c, dtype=np.float64)) / scale[s]) for s, c in change.items()}
        rows.append(_row(layer, role, fmt, int(w.size), raw.nbytes, errors, kl_estimate(fisher, change["unseen"]),
                         None))
    kept = stored.name.lower()
    if kept in decode.FORMATS and kept not in params.formats:
        rows.append(_row(layer, role, kept, int(w.size), stored_bytes, {s: 0.0 for s in data}, 0.0, None))
    return rows


def measure_sensitivity(source: GGUFModel, cal, unseen, guidance: Path, params: SensitivityParams,
                        log: Log = print) -> pa.Table:
    """One row per (role, format) of layer `params.layer`: bytes, the relative output error (unseen, and
    in-sample on the rows alpha is fitted on, `FIT_ROWS`) with only that tensor quantized (after the
    variant's alpha, for a routed role), and its estimated cost in KL by the unseen trace's Fisher
    (`guidance`, the guidance stage's store of that trace). The unit logs where its time went
    (`sensitivity layer 3: read ..., rounding ..., outputs ...`)."""
    qp, layer = params.quantize, params.layer
    assert layer is not None, "a sensitivity unit is one layer"
    extra = roles.dump_arrays(params.roles)
    in_rows = slice(0, qp.cal_tokens or None)
    seqs = {"in_sample": roles.clip_sequences(cal.sequences("sensitivity"), in_rows),
            "unseen": unseen.sequences("sensitivity")} if extra else {"in_sample": [], "unseen": []}
    rows = []
    phases = Phases()
    weights = expert_weights(source, layer)
    data = {"in_sample": read_layer(cal[str(layer)], in_rows, extra),
            "unseen": read_layer(unseen[str(layer)], slice(None), extra)}
    phases.done("read", weights)
    plan = importance_plan(weights, cal if qp.importance else None, layer, qp, data["in_sample"])
    phases.done("statistics", plan)
    fisher = read_fisher_values(guidance, layer)  # (T, d): the unseen dump's rows are the trace's tokens
    if len(fisher) != len(data["unseen"]["yr"]):
        raise InputError(f"{guidance}: layer {layer}: {len(fisher)} rows of guidance for an unseen dump of "
                         f"{len(data['unseen']['yr'])}")
    matrices = layer_matrices(source, layer) if set(params.roles) - set(EXPERT_TENSORS) else {}
    stride = -(-len(data["in_sample"]["yr"]) // FIT_ROWS)  # 1 up to FIT_ROWS rows: every row
    fit = {name: a[::stride] for name, a in data["in_sample"].items()}  # (<= FIT_ROWS, ...) each
    routed = {"in_sample": routed_inputs_on_device(fit), "unseen": routed_inputs_on_device(data["unseen"])}
    phases.done("read", routed)
    encode.prepare_experts((fmt, weights[role].shape, plan[role][0] is not None, plan[role][1] is not None)
                           for role in params.roles if role in EXPERT_TENSORS for fmt in params.formats)
    phases.done("compiling ahead")
    for role in params.roles:
        if role in EXPERT_TENSORS:
            rows += _routed_rows(layer, role, weights, plan, routed, fisher, params, phases)
        else:
            rows += _matrix_rows(source, layer, role, matrices, data, seqs, fisher, params)
            phases.done("other roles")
    log(f"sensitivity layer {layer}: {phases}")
    return pa.Table.from_pylist(rows, schema=SENSITIVITY_SCHEMA)


def build_sensitivity(out: Path, params: SensitivityParams, *, source: Path, dump: Path, unseen: Path,
                      guidance: Path, log: Log) -> None:
    """One unit of the sensitivity stage: `sensitivity.parquet`, layer `params.layer` of the `source`
    measured on the calibration (`dump`) and unseen (`unseen`) dumps, priced by the unseen trace's Fisher
    (`guidance`). On one host BLAS thread, as the quantize unit whose code it runs (`kernels.threads`)."""
    model = open_model(source)
    with one_blas_thread():
        table = measure_sensitivity(model, open_dump(dump, model.hp, model.moe_layers),
                                    open_dump(unseen, model.hp, model.moe_layers), guidance, params, log)
    write_parquet(out / "sensitivity.parquet", table)


STAGE = Stage("sensitivity", "parts", build_sensitivity, outputs=("sensitivity.parquet",))
