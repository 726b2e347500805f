"""End-to-end tuning: the float parameters an assembled GGUF stores, against the reference's output.

After assembly every integer code of the file is frozen (weight codes, sub-block scale and min
codes, grid points, signs; with `e2e_code_lr` the k-quants' sub-block scale and min codes move too,
straight through their rounding, measured not to pay on the demo: docs/e2e-tuning.md). What is
still a free float is tuned by gradient descent on KL(reference || variant) over the calibration
trace (the sequences of its first `cal_tokens` rows where the variant sets it, as quantization
reads), the reference kept as its top-k tokens plus one bucket for the rest of its mass (the
reference-topk stage; the full vocabulary when k is):

- the fp16 scales of every tensor the variant quantized (the format's ``fp16_parts``: a k-quant's
  d and dmin, an i-quant's or a grid format's d), alpha already folded into them;
- the RMSNorm weights (attn_norm, ffn_norm, output_norm, and the q/k norms where the family has
  them) and the routers `ffn_gate_inp`, all F32 in the file.

The forward is the runner's (the family's own attention, routing and MoE blocks), streamed in the
runner's layer-major order (`pipeline.model.tuner.Tuner`): one layer on the device at a time, for
the forward and again, recomputed, for its backward, the codes kept as the file's own bytes. A quantized weight is
``dequantize_parts(frozen codes, tuned scales)``, the float32 products gguf-py decodes the
written bytes to, so the loss sees exactly the file that will be written (`kernels.e2e`: the
scales pass through a straight-through fp16 rounding). Steps are Adam on the relative change of
each parameter, `e2e_batch_seqs` calibration sequences at a time (1 by default), at two learning rates: the variant's
``e2e_scale_lr`` for the fp16 scales (most of the tuned values, and the ones that fit the
calibration text first) and ``e2e_lr`` for the norms and routers (`learning_rates`). Every `EVAL_EVERY` steps the KL
over the whole unseen trace and over a fixed probe of the calibration trace (its first
`CAL_PROBE_SEQS` sequences, in-sample) is recorded (`e2e_curve.parquet`), and the
written parameters are those of the step with the lowest unseen KL, step 0 (the assembled file
as it is) included, so tuning never makes the held-out trace worse; the evaluation windows are
never read.

The output is a folder: `model.gguf`, the assembled file with those tensors' bytes replaced
(scales packed back with the format's ``pack``, every other byte identical), and the curve.
Device memory holds one layer and one batch's activations beyond what the tuner's cache keeps of
the model (all of it where it fits: `pipeline.model.tuner.device_cache_bytes`); `theta` and Adam's
moments, a few percent of the packed model, stay on the device and each layer's slice is updated
there in turn, so a step moves no parameter across PCIe (docs/e2e-tuning.md, Real sizes). The
curve's measurements run `MEASURE_SEQS` sequences per forward pass: the same per-token losses as
one at a time, fewer passes over the layers. Before the first pass every distinct layer's programs
(a recipe's mixes of formats) are compiled side by side in threads (`Tuner.compile_ahead`), not one
after the other where a pass first meets them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa

from moeheal.kernels.adam import adam_init, adam_step
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.writer import copy_gguf
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.tuner import GLOBAL_GROUP, THETA_KINDS, Trace, Tuner, layer_of, short_name

EVAL_EVERY = 5  # steps between two measurements of the curve
CAL_PROBE_SEQS = 4  # the curve's calibration KL: over the calibration trace's first sequences, a fixed probe
MEASURE_SEQS = 8  # sequences per forward pass of the curve's measurements (one program, fewer passes)
SEED = 0  # the order the calibration sequences are drawn in
MODEL_FILE, CURVE_FILE = "model.gguf", "e2e_curve.parquet"
CURVE_SCHEMA = pa.schema([("variant", pa.string()), ("step", pa.int64()), ("split", pa.string()),
                          ("kl", pa.float64()), ("tokens", pa.int64()), ("seconds", pa.float64())])


@dataclass(frozen=True)
class E2EParams:
    """The knobs that reach the tuning."""

    variant: str  # names the curve's rows
    steps: int
    lr: float  # the norms' and routers' Adam step (relative)
    scale_lr: float  # the fp16 block scales'
    seq_tokens: int
    cal_tokens: int | None = None  # the variant's `cal_tokens`: steps draw only the sequences starting below it
    code_lr: float | None = None  # the sub-block scale codes' Adam step (code units); None: frozen, not in the key
    decay: bool | None = None  # True: every step decays linearly to 0 over `steps`; None: constant, not in the key
    batch_seqs: int | None = None  # calibration sequences per step; None: one, not in the key

    @classmethod
    def of(cls, variant, seq_tokens: int) -> "E2EParams":
        return cls(variant=variant.name, steps=variant.e2e_steps, lr=variant.e2e_lr,
                   scale_lr=variant.e2e_scale_lr, seq_tokens=seq_tokens, cal_tokens=variant.cal_tokens or None,
                   code_lr=variant.e2e_code_lr or None, decay=variant.e2e_decay or None,
                   batch_seqs=variant.e2e_batch_seqs if variant.e2e_batch_seqs != 1 else None)


def learning_rates(theta: dict, params: E2EParams) -> dict:
    """A pytree like `theta` of each leaf's Adam step: `scale_lr` for the fp16 block scales, `lr` for
    the norms and routers, `code_lr` for the sub-block scale codes (in code units)."""
    return {"scales": jax.tree_util.tree_map(lambda _: jnp.float32(params.scale_lr), theta["scales"]),
            "floats": jax.tree_util.tree_map(lambda _: jnp.float32(params.lr), theta["floats"]),
            "codes": jax.tree_util.tree_map(lambda _: jnp.float32(params.code_lr or 0.0), theta["codes"])}


def step_rates(lr: dict, step: int, params: E2EParams) -> dict:
    """The learning rates of step `step` (0-based): `lr` itself, or with `params.decay` scaled by
    1 - step / steps, a linear decay like learned rounding's, so the last steps settle instead of
    jittering around the minimum at the full step."""
    if not params.decay:
        return lr
    return jax.tree_util.tree_map(lambda r: r * jnp.float32(1.0 - step / params.steps), lr)


def by_layer(tree: dict) -> dict[int, dict]:
    """A pytree like theta split per layer (`layer_of`), each keyed by short name: layers alike have
    the same structure, so one compiled update serves them all."""
    groups: dict[int, dict] = {}
    for kind in THETA_KINDS:
        for name, leaf in tree[kind].items():
            groups.setdefault(layer_of(name), {k: {} for k in THETA_KINDS})[kind][short_name(name)] = leaf
    return groups


def adam_by_layer(theta: dict, grad: dict, states: dict[int, Any], lr: dict) -> dict:
    """One Adam step of every leaf, a layer at a time (Adam is elementwise, so this is the whole-tree
    step; layers alike share one compiled update); theta, grad and the moments in `states` (updated in
    place) stay where they are, on the device."""
    out: dict = {k: {} for k in THETA_KINDS}
    grads, rates = by_layer(grad), by_layer(lr)
    for layer, group in by_layer(theta).items():
        state = states.get(layer) or adam_init(group)
        group, states[layer] = adam_step(group, grads[layer], state, rates[layer])
        prefix = f"blk.{layer}." if layer != GLOBAL_GROUP else ""
        for kind in THETA_KINDS:
            out[kind] |= {prefix + short: leaf for short, leaf in group[kind].items()}
    return out


def tune(tuner: Tuner, calibration: Trace, unseen: Trace, params: E2EParams,
         log: Callable[[str], None] = print, train_seqs: int | None = None) -> tuple[dict, list[dict[str, Any]]]:
    """Adam on the calibration trace's first `train_seqs` sequences (all by default) for
    `params.steps` steps; returns the theta of the measured step with the lowest unseen KL (step 0
    included) and the curve's rows."""
    rng = np.random.default_rng(SEED)
    batch_seqs = params.batch_seqs or 1
    theta, states = jax.tree_util.tree_map(jnp.asarray, tuner.theta0), {}  # on the device for the whole run
    lr = learning_rates(theta, params)
    rows: list[dict[str, Any]] = []
    started = time.process_time()  # CPU seconds: a shared machine's wall clock says little
    best: tuple[float, int, dict] | None = None
    order: list[int] = []
    for step in range(params.steps + 1):
        if step % EVAL_EVERY == 0 or step == params.steps:
            measured = {"calibration": tuner.trace_kl(theta, calibration, CAL_PROBE_SEQS),
                        "unseen": tuner.trace_kl(theta, unseen)}
            kls = {split: kl for split, (kl, _) in measured.items()}
            for split, (kl, tokens) in measured.items():
                rows.append({"variant": params.variant, "step": step, "split": split, "kl": kl, "tokens": tokens,
                             "seconds": time.process_time() - started})
            log(f"[e2e:{params.variant}] step {step}: KL calibration {kls['calibration']:.5f}, "
                f"unseen {kls['unseen']:.5f}")
            if best is None or kls["unseen"] < best[0]:
                best = (kls["unseen"], step, theta)
        if step == params.steps:
            break
        if len(order) < batch_seqs:  # a new pass over the calibration sequences, in a new order
            order += list(rng.permutation(train_seqs or calibration.n_seqs))
        picked, order = np.array(order[:batch_seqs]), order[batch_seqs:]
        _, grad = tuner.step(theta, calibration.batch(0, picked))
        theta = adam_by_layer(theta, grad, states, step_rates(lr, step, params))
    assert best is not None
    log(f"[e2e:{params.variant}] keeping step {best[1]} (unseen KL {best[0]:.5f})")
    return best[2], rows


def e2e_model(out: Path, assembled: GGUFModel, source: GGUFModel, traces_dir: Path, topk_dir: Path,
              params: E2EParams, log: Callable[[str], None] = print) -> None:
    """Tune `assembled` (`tune`) and write `out/model.gguf` and `out/e2e_curve.parquet`."""
    out.mkdir(parents=True, exist_ok=True)
    calibration, unseen = (Trace(*trace_tokens(traces_dir, name), params.seq_tokens, topk_dir, name, MEASURE_SEQS)
                           for name in ("calibration", "unseen"))
    _, seq = trace_tokens(traces_dir, "calibration")
    starts = np.flatnonzero(np.diff(seq, prepend=-1))  # each calibration sequence's first row
    train_seqs = int(np.sum(starts < params.cal_tokens)) if params.cal_tokens else None
    tuner = Tuner(assembled, source, tune_codes=bool(params.code_lr))
    try:
        ahead = time.perf_counter()
        n_programs = tuner.compile_ahead(params.seq_tokens, MEASURE_SEQS, (params.batch_seqs or 1) if params.steps else None)
        log(f"[e2e:{params.variant}] {n_programs} layer programs compiled ahead ({time.perf_counter() - ahead:.1f} s)")
        theta, rows = tune(tuner, calibration, unseen, params, log, train_seqs)
        copy_gguf(assembled, out / MODEL_FILE, tuner.replacements(theta))
    finally:
        tuner.release()
    write_parquet(out / CURVE_FILE, pa.Table.from_pylist(rows, schema=CURVE_SCHEMA))


def build_e2e(out: Path, params: E2EParams, *, source: Path, model: Path, traces: Path, topk: Path, log: Log) -> None:
    """The e2e stage: `e2e_model` on one variant's assembled GGUF (`model`), against the reference's
    top-k distribution (`topk`, the reference-topk stage's) over the traces stage's output (`traces`)."""
    e2e_model(out, open_model(model), open_model(source), traces, topk,
              params, log)


STAGE = Stage("e2e", "models", build_e2e, outputs=(MODEL_FILE, CURVE_FILE))
