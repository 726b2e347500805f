"""The dump as it was written before its writer thread: every chunk checked, copied, joined and written
on the caller's thread between forward passes, a Python list of strings for the routing's `trace`
column. Kept as the reference that `dumps.dump_trace` must match byte for byte (tests/test_dump.py)
and the old host path that bench/speed/bench_dump_host.py times it against. A fresh dump only: no
resume (what that adds is the same in both)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa

from moeheal.pipeline.data.dumps import (
    ARRAYS,
    ATTENTION_ARRAYS,
    _open_or_create,
    array_widths,
    chunk_sequences,
    forward_batches,
    rows_of,
)
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import write_parquet


def _stored_copy(values: np.ndarray, dtype: str) -> np.ndarray:
    """What the dump stored, made as it was: a new array even where the dtype already matched."""
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return values.astype(dtype)


def sequential_dump(out: Path, runner, tokens: np.ndarray, seq: np.ndarray, trace: str, chunk_tokens: int,
                    seq_tokens: int, attention_inputs: bool = False, dump_dtype: str = "float32") -> None:
    """`dump_trace`'s arguments and bytes, every step of a chunk on this thread, in turn."""
    hp = runner.hp
    k = hp.n_expert_used
    names = ARRAYS + (ATTENTION_ARRAYS if attention_inputs else ())
    widths = {name: width for name, width in array_widths(hp, k, dump_dtype).items() if name in names}
    total = int(len(tokens))
    layers = runner.model.moe_layers
    root = _open_or_create(out, trace, layers, widths, seq_tokens, total, dump_dtype)
    routing_dir = out / "routing"
    routing_dir.mkdir(exist_ok=True)
    starts = np.flatnonzero(np.diff(seq, prepend=-1))
    root.attrs["seq_starts"] = [int(s) for s in starts]
    bounds = list(zip(starts, list(starts[1:]) + [total]))
    per_chunk = chunk_sequences(chunk_tokens, seq_tokens)
    arrays = {(layer, name): root[str(layer)][name] for layer in layers for name in names}
    for chunk in [bounds[i:i + per_chunk] for i in range(0, len(bounds), per_chunk)]:
        lo, hi = int(chunk[0][0]), int(chunk[-1][1])
        buffers: dict[tuple[int, str], list[np.ndarray]] = {key: [] for key in arrays}
        for run in forward_batches([(int(s), int(e)) for s, e in chunk]):
            def on_layer(layer: int, cap, s=run[0][0]) -> None:
                for name in names:
                    values = rows_of(getattr(cap, name))  # (B T_seq, width)
                    bad = ~np.isfinite(values) if values.dtype.kind == "f" else np.zeros(1, bool)
                    if bad.any():
                        row = int(np.argwhere(bad)[0][0])
                        raise InputError(f"dump: layer {layer}: NaN or Inf in {name} at token position {s + row}")
                    buffers[(layer, name)].append(_stored_copy(values, widths[name][1]))
            runner.forward(np.stack([tokens[s:e] for s, e in run]), capture=True, on_layer=on_layer, logits=False)
        routing_rows = []
        for (layer, name), arr in arrays.items():
            arr.resize((hi, arr.shape[1]))
            arr[lo:hi] = np.concatenate(buffers[(layer, name)], axis=0)  # (hi - lo, width)
        for layer in layers:
            experts = np.concatenate(buffers[(layer, "experts")])  # (n, k)
            weights = np.concatenate(buffers[(layer, "weights")])  # (n, k)
            n = experts.shape[0]
            routing_rows.append(pa.table({
                "trace": pa.array([trace] * n * k, pa.string()),
                "layer": pa.array(np.full(n * k, layer, np.int32)),
                "pos": pa.array(np.repeat(np.arange(lo, hi, dtype=np.int64), k)),
                "k": pa.array(np.tile(np.arange(k, dtype=np.int32), n)),
                "expert": pa.array(experts.reshape(-1).astype(np.int32)),
                "weight": pa.array(weights.reshape(-1).astype(np.float32)),
            }))
        write_parquet(routing_dir / f"{lo:012d}.parquet", pa.concat_tables(routing_rows))
        root.attrs["rows_done"] = hi
    root.attrs["complete"] = True
