"""The `guidance` stage: what an error in each MoE layer's output costs the reference's prediction, per
token and channel: over the calibration trace for learned rounding's weighted loss (`learned_loss =
"fisher"`), over the unseen trace for the sensitivity stage's estimate of what a format costs the
model's KL, the exchange rate between layers of a budget recipe.

Learned rounding minimises a layer's output error sum_t ||dz_t||^2, every token and channel alike.
What the evaluation measures is KL(reference || quantized model), which to second order in a layer's
output error is (1/2) sum_t dz_t^T F_t dz_t, F_t the Fisher information of the reference's
predictive distribution with respect to that layer's output at token t (the KL's Hessian at the
reference). Its diagonal, F_tc = E_{y ~ p_ref}[(d log p(y) / d z_tc)^2], weighs each token and
channel by what an error there costs, as GuidedQuant (Kim et al., 2025) weighs a layer's output
error by the end loss's gradients.

Each calibration sequence runs through the reference forward and back (`pipeline.model.tuner.Tuner`, as the e2e stage does,
streamed one layer at a time, so device memory holds one layer whatever the depth). The loss is the
log-likelihood summed over positions of one token drawn at each position from the reference's own
distribution (its top-k tokens renormalised: the reference-topk stage's; seeded), so the squared
gradient with respect to a layer's output is a one-draw unbiased estimate of F_tc (the sensitivity
stage sums it over every token and channel of a trace, where one draw ranks tensors as four do:
bench/experiments/kl_sensitivity.py). The layer's
output enters the residual stream as it is, so that gradient is the one with respect to the
residual stream after the layer, which the backward sweep computes anyway.

Output (`pipeline.data.fisher`): per MoE layer an array (rows, d) in the trace's order (its dump's
rows: its real tokens, sequence by sequence), in bfloat16, its mean over rows and channels beside it;
the quantize stage divides by that mean, so the weighted loss keeps the plain loss's scale; the
sensitivity stage reads the values as they are, in the log-likelihood's units.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeheal.kernels.e2e import LOG_ZERO
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.fisher import create_fisher, write_rows
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.progress import progress
from moeheal.pipeline.model.tuner import Trace, Tuner

@dataclass(frozen=True)
class GuidanceParams:
    """The trace, the sequence length it is cut into and the seed of the drawn tokens."""

    seq_tokens: int
    seed: int = 0
    trace: str = "calibration"


def draw_tokens(ids: np.ndarray, logp: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per position drawn from the reference's top-k distribution renormalised over its k
    tokens: ids, logp (B, T, k), mask (B, T) -> (B, T, 1) int32 (a masked position draws its first id)."""
    p = np.exp(logp.astype(np.float64))  # (B, T, k)
    cum = np.cumsum(p, axis=-1)  # (B, T, k)
    u = rng.random(mask.shape)[..., None] * cum[..., -1:]  # (B, T, 1)
    pick = np.minimum(np.sum(cum < u, axis=-1), ids.shape[-1] - 1)  # (B, T)
    pick = np.where(mask > 0, pick, 0)  # (B, T)
    return np.take_along_axis(ids, pick[..., None], axis=-1).astype(np.int32)  # (B, T, 1)


def one_hot_batch(tokens: np.ndarray, drawn: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
    """A batch whose `kl_sum_topk` loss is the mean over positions of -log q(drawn token): the drawn
    token as a one-token distribution of probability 1 (log 0) and an empty bucket."""
    logp = np.zeros(drawn.shape, np.float32)  # (B, T, 1)
    log_rest = np.full(mask.shape, LOG_ZERO, np.float32)  # (B, T)
    return tokens, drawn, logp, log_rest, mask


def fisher_rows(tuner: Tuner, batch: tuple[np.ndarray, ...], layers: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Per layer in `layers`: the squared gradient of the batch's summed log-likelihood of the drawn
    tokens with respect to the layer's output, at the batch's real tokens in row-major order (n, d)."""
    mask = batch[-1]
    grads: dict[int, np.ndarray] = {}
    tuner.step(tuner.theta0, batch, outputs=grads)
    n = float(mask.sum())  # the step's loss is a mean over the real tokens; the sum's gradient is n times it
    real = mask > 0  # (B, T)
    return {layer: np.square(grads[layer][real] * n, dtype=np.float32) for layer in layers}  # (n, d) each


def build_guidance(out: Path, params: GuidanceParams, *, reference: Path, traces: Path, topk: Path, log: Log) -> None:
    """The stage's Zarr store `out` (`pipeline.data.fisher`): the diagonal Fisher estimate of every MoE
    layer's output over one trace of the `traces` stage (`params.trace`), from the `reference` GGUF and
    its top-k distribution (`topk`)."""
    model = open_model(reference)
    trace = Trace(*trace_tokens(traces, params.trace), params.seq_tokens, topk, params.trace)
    tuner = Tuner(model, model)  # nothing quantized differs from itself: the reference, no scales tuned
    layers, d = model.moe_layers, model.hp.d_model
    rng = np.random.default_rng(params.seed)
    arrays = create_fisher(out, layers, trace.n_tokens, d, params.seq_tokens)
    sums = dict.fromkeys(layers, 0.0)
    row = 0
    for b in progress(trace.batches(), desc="guidance", unit="seq"):
        tokens, ids, logp, _, mask = trace.batch(b)
        if not mask.any():
            continue
        batch = one_hot_batch(tokens, draw_tokens(ids, logp, mask, rng), mask)
        rows = fisher_rows(tuner, batch, layers)
        n = int(mask.sum())
        for layer, values in rows.items():
            write_rows(arrays[layer], row, values)
            sums[layer] += float(np.sum(values, dtype=np.float64))
        row += n
    tuner.release()  # the device cache, before the next stage's programs need the memory
    for layer in layers:
        mean = sums[layer] / max(1, trace.n_tokens * d)
        if not np.isfinite(mean) or mean <= 0:
            raise InputError(f"{reference}: layer {layer}: the reference's output gradient is {mean} on the "
                             f"{params.trace} trace (a broken model?)")
        arrays[layer].attrs["mean"] = mean
    log(f"[guidance] {params.trace}: {row} tokens, layers {layers[0]}..{layers[-1]}")


STAGE = Stage("guidance", "dumps", build_guidance, suffix=".zarr")
