"""The `healed-dump` stage: one MoE layer's inputs as the model with its earlier layers healed makes them.

A variant with `inputs = "healed"` quantizes and heals layer L on these rows instead of the
reference's (AutoRound's quantized inputs, GPTQ's sequential mode): what layer L will see in the
written GGUF is the output of layers that are already quantized, so its rounding, alpha and ridge
are fitted where it will run. The target stays the reference's: `yr`, the reference's routed output
on its own inputs, is copied from the calibration dump, so each healed layer also pulls back part of
the drift the layers before it left.

One unit per (variant, layer), a chain: the unit of layer L reads the unit of the variant's
previous MoE layer p (`previous`: its `resid`, the residual stream entering layer p) and p's
calibrate unit (`calibrated`: p as the healed GGUF will hold it, `unit_overrides`). It runs layer p
with those tensors, any dense layers between as the source has them, and layer L's attention,
router and blocks as the source has them, capturing layer L's MoE input (`mixed`), routing
(`experts`, `weights`, the source's router on the healed stream), the shared expert's hidden
activation (`hh`) and, where a recipe chose attention formats, `attn_in`; `resid` holds the stream
entering L for the next unit. The first MoE layer's unit starts from the embeddings. So a unit costs
one or two layers' forward pass over the rows, not L of them, and holds one layer's rows; the DAG
orders the chain (quantize:v:L reads healed-dump:v:L, which reads calibrate:v:p).

The rows are those of the calibration trace that quantization reads (`cal_tokens`: the sequences
that start below it; all without), each sequence run from its position 0, as the dump runs them.
The output is a dump of that one layer in the calibration dump's layout (`open_dump(out, hp,
(L,))`), so quantize and calibrate read it as they read the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels import decode
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import (
    ARRAYS,
    ATTENTION_ARRAYS,
    append_rows,
    array_widths,
    create_layer_dump,
    chunk_sequences,
    finish_dump,
    forward_batches,
    open_dump,
    rows_of,
)
from moeheal.pipeline.data.units import load_quantized
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.stage import Log, Stage
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.progress import progress

RESIDUAL = "resid"  # (T, d) the residual stream entering the layer, float32: where the next unit starts


@dataclass(frozen=True)
class HealedDumpParams:
    """Which layer, over which rows of the calibration trace (the first `cal_tokens`' sequences; 0:
    all) in sequences of `seq_tokens`, and the dump's arrays as the calibration dump's
    (`attention_inputs`, `dump_dtype`: None for no and float32). `chunk_tokens` only sets how many
    tokens a step holds: the output is the same."""

    layer: int
    seq_tokens: int
    cal_tokens: int
    chunk_tokens: int = field(metadata={"fingerprint": False})
    attention_inputs: bool | None = None  # True or None
    dump_dtype: str | None = None  # None: float32


def unit_overrides(calibrated: Path, layer: int) -> dict[str, jax.Array]:
    """A calibrate unit's tensors as `Runner` overrides: every quantized tensor of its `layer_<i>.npz`
    (the routed experts with alpha in their scales, the requantized shared down projection, whatever
    a recipe chose) decoded to float32 on the default device, under its GGUF name. What the unit
    does not hold stays the source's: the layer as the healed GGUF holds it."""
    arrays = load_quantized(calibrated, layer)
    return {f"blk.{layer}.{name}.weight": decode.dequantize(arrays[name], str(arrays[f"{name}.format"]),
                                                            tuple(int(n) for n in arrays[f"{name}.shape"]),
                                                            keep_on_device=True)
            for name in arrays if f"{name}.format" in arrays}


def sequence_bounds(seq: np.ndarray, cal_tokens: int) -> list[tuple[int, int]]:
    """(first row, end row) of every sequence of the trace that starts below `cal_tokens` (0: all)."""
    starts = np.flatnonzero(np.diff(seq, prepend=-1))  # first row of each sequence
    ends = [*starts[1:], len(seq)]
    return [(int(s), int(e)) for s, e in zip(starts, ends) if not cal_tokens or s < cal_tokens]


def healed_layer_rows(model: GGUFModel, tokens: np.ndarray, bounds: list[tuple[int, int]], layer: int,
                      start: int, overrides: dict[str, jax.Array], resid, names: tuple[str, ...],
                      chunk_tokens: int, write) -> None:
    """Run layers `start`..`layer` over each sequence and hand `write(lo, hi, arrays)` each chunk's
    rows of layer `layer`'s `names` and `resid`. The stream entering `start` is `resid[rows]` (the
    previous unit's), or the embeddings when `resid` is None (then `start` is 0)."""
    runner = Runner(model, overrides)
    hp = model.hp
    per_chunk = chunk_sequences(chunk_tokens, bounds[0][1] - bounds[0][0])
    chunks = [bounds[i:i + per_chunk] for i in range(0, len(bounds), per_chunk)]
    for chunk in progress(chunks, desc=f"healed inputs of layer {layer}", unit="chunk"):
        rows: dict[str, list[np.ndarray]] = {name: [] for name in (*names, RESIDUAL)}
        for run in forward_batches(chunk):  # one (B, T) pass per batch of equal-length sequences
            (s, e), n_seq = (run[0][0], run[-1][1]), len(run)
            cos, sin = model.arch.rope_tables((e - s) // n_seq, hp)  # (T, rotated dims / 2) each
            h = (runner.embed(np.stack([tokens[a:b] for a, b in run])) if resid is None
                 else jnp.asarray(np.asarray(resid[s:e]).reshape(n_seq, (e - s) // n_seq, -1)))  # (B, T, d)
            for i in range(start, layer):
                h, _ = runner.layer(i, h, cos, sin)  # (B, T, d)
            rows[RESIDUAL].append(rows_of(h))  # (B T, d)
            _, cap = runner.layer(layer, h, cos, sin, capture=True)
            for name in names:
                rows[name].append(rows_of(getattr(cap, name)))  # (B T, width)
        write(chunk[0][0], chunk[-1][1], {name: np.concatenate(parts) for name, parts in rows.items()})


def build_healed_dump(out: Path, params: HealedDumpParams, *, source: Path, traces: Path, dump: Path,
                      previous: Path | None = None, calibrated: Path | None = None, log: Log) -> None:
    """Layer `params.layer`'s rows of the calibration trace through the `source` with the earlier
    layers healed: from the previous MoE layer's unit (`previous`, with that layer's calibrate unit
    `calibrated`), or from the embeddings for the first MoE layer; `yr` copied from the reference's
    calibration `dump`."""
    model = open_model(source)
    layer = params.layer
    tokens, seq = trace_tokens(traces, "calibration")
    bounds = sequence_bounds(seq, params.cal_tokens)
    total = bounds[-1][1]
    reference = open_dump(dump, model.hp, model.moe_layers)[str(layer)]
    dtype = params.dump_dtype or "float32"
    names = ARRAYS + (ATTENTION_ARRAYS if params.attention_inputs else ())
    widths = {name: w for name, w in array_widths(model.hp, model.hp.n_expert_used, dtype).items() if name in names}
    widths[RESIDUAL] = (model.hp.d_model, "float32")
    root = create_layer_dump(out, "calibration", layer, widths, params.seq_tokens, total, dtype)
    group = root[str(layer)]
    if previous is None:
        start, overrides, resid = 0, {}, None
    else:
        start = model.moe_layers[model.moe_layers.index(layer) - 1]  # the previous MoE layer
        assert calibrated is not None, "a unit after the first reads the previous layer's calibrate unit"
        overrides = unit_overrides(calibrated, start)
        resid = open_dump(previous, model.hp, (start,))[str(start)][RESIDUAL]
    log(f"[healed-dump] layer {layer}: {total} rows, layers {start}..{layer}"
        + (f" (layer {start} healed)" if overrides else ""))

    def write(lo: int, hi: int, arrays: dict[str, np.ndarray]) -> None:
        arrays["yr"] = reference["yr"][lo:hi]  # the target: the reference's routed output
        append_rows(group, lo, hi, arrays)

    captured = tuple(name for name in names if name != "yr")
    healed_layer_rows(model, tokens, bounds, layer, start, overrides, resid, captured, params.chunk_tokens, write)
    finish_dump(root, [s for s, _ in bounds])


STAGE = Stage("healed-dump", "dumps", build_healed_dump, suffix=".zarr")
