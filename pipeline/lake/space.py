"""Free space before a large write: the bytes a dump, healed dump, reference or assembly stage will
write, estimated from the shapes, against what the lake's file system has free.

A dump of a real model is hundreds of gigabytes; one that fills the disk half way fails after hours.
So before such a stage builds (`dag.Executor`'s `before_build`, set by `HealRun`), its output is
sized from what it will hold: tokens x widths x bytes per value for the dumps, the scored positions
x vocabulary for the reference's logits, the source's tensors with the calibrate units' formats for
an assembly. The figures are the uncompressed bytes: what the dumps store (each Zarr chunk also
carries a 4-byte checksum, which the 1 MiB margin covers), an upper bound where the stage
compresses (Parquet). A stage that does not fit stops with one line naming it, the bytes it needs
and the bytes free, before it writes anything (exit 2); a partial, resumable output already under
tmp/ counts as written.

`disk_free` is the one place the free figure is read, so a test can set it.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import ARRAYS, ATTENTION_ARRAYS, array_widths
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.stages.assemble import layer_replacements
from moeheal.pipeline.stages.healed_dump import sequence_bounds

if TYPE_CHECKING:
    from moeheal.pipeline.lake.dag import Node

ROUTING_ROW_BYTES = 24  # a dump's routing row per (token, k): layer, k, expert int32, weight float32, pos int64
TOPK_ROW_BYTES = 12  # reference-topk per token beside its k (id, logp) pairs: seq, pos int32, log_rest float32
NPY_HEADER = 128  # bytes before the values of each `.npy` file the reference's logits are
SLACK = 1 << 20  # beside the values: metadata, headers, the provenance record


def disk_free(path: Path) -> int:
    """Bytes free to this user on the file system holding `path`."""
    return shutil.disk_usage(path).free


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (or of the file), 0 where there is nothing."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def value_bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def dump_row_bytes(hp: Any, names: tuple[str, ...], dtype: str) -> int:
    """Bytes one token takes in one layer of a dump holding `names` (routing rows included)."""
    widths = array_widths(hp, hp.n_expert_used, dtype)
    return (sum(widths[n][0] * value_bytes(widths[n][1]) for n in names)
            + hp.n_expert_used * ROUTING_ROW_BYTES)


def dump_arrays(params: Any) -> tuple[str, ...]:
    return ARRAYS + (ATTENTION_ARRAYS if params.attention_inputs else ())


def dump_bytes(params: Any, paths: Mapping[str, Any]) -> int:
    """The reference's dump of one trace: every token, every MoE layer."""
    model = open_model(paths["reference"])
    tokens, _ = trace_tokens(paths["traces"], params.trace)
    return len(tokens) * len(model.moe_layers) * dump_row_bytes(model.hp, dump_arrays(params),
                                                                params.dump_dtype or "float32")


def healed_dump_bytes(params: Any, paths: Mapping[str, Any]) -> int:
    """One layer's healed inputs over the rows quantization reads, with the residual stream it hands on."""
    hp = open_model(paths["source"]).hp
    _, seq = trace_tokens(paths["traces"], "calibration")
    rows = sequence_bounds(seq, params.cal_tokens)[-1][1]
    return rows * (dump_row_bytes(hp, dump_arrays(params), params.dump_dtype or "float32") + hp.d_model * 4)


def reference_logits_bytes(params: Any, paths: Mapping[str, Any]) -> int:
    """float32 logits over the vocabulary at every window's scored positions."""
    windows = read_part(Path(paths["windows"]) / "windows.parquet", ("ctx_start", "score_start", "score_end"))
    ctx, start, end = (windows[c].to_numpy().astype(np.int64) for c in ("ctx_start", "score_start", "score_end"))
    scored = np.sum(end - ctx - 1 - np.maximum(start - ctx - 1, 0))  # `scored_positions` of every window
    return int(scored) * open_model(paths["reference"]).hp.vocab_size * 4 + len(windows) * NPY_HEADER


def reference_topk_bytes(params: Any, paths: Mapping[str, Any]) -> int:
    """The reference's top-k (id, log p) pairs at every token of its traces."""
    tokens = sum(len(trace_tokens(paths["traces"], trace)[0]) for trace in params.traces)
    return tokens * (params.k * 8 + TOPK_ROW_BYTES)


def assembly_bytes(params: Any, paths: Mapping[str, Any]) -> int:
    """The source GGUF with each tensor a calibrate unit replaces in the format the unit holds it."""
    source = open_model(paths["source"])
    sizes = source.tensor_sizes()
    total = Path(paths["source"]).stat().st_size
    for layer, unit in paths["calibrated"].items():
        for name, tensor in layer_replacements(Path(unit), layer).items():
            n_bytes = 1
            for n in tensor.byte_shape:
                n_bytes *= n
            total += n_bytes - sizes[name][2]
    return total


def e2e_bytes(params: Any, paths: Mapping[str, Any]) -> int:
    """The tuned GGUF: the assembled one's tensors in the same formats."""
    return Path(paths["model"]).stat().st_size


# The stages whose output is sized before they build: bytes from the node's parameters and resolved inputs.
ESTIMATES: dict[str, Callable[[Any, Mapping[str, Any]], int]] = {
    "dump": dump_bytes, "healed-dump": healed_dump_bytes, "reference-logits": reference_logits_bytes,
    "reference-topk": reference_topk_bytes, "assemble": assembly_bytes, "e2e": e2e_bytes,
}


def check_room(lake_root: Path, node: Node, out: Path, paths: Mapping[str, Any]) -> None:
    """InputError (one line, exit 2; the executor prefixes the node's label) when the node's output
    will not fit beside the lake; nothing is written. `out` is where it builds: a resumable stage's
    partial output there is already on disk."""
    estimate = ESTIMATES.get(node.stage.name)
    if estimate is None:
        return
    need = estimate(node.params, paths) + SLACK - tree_bytes(out)
    free = disk_free(lake_root)
    if need > free:
        raise InputError(f"needs {need:,} bytes in {lake_root} (estimated from the shapes), {free:,} free: "
                         "free some (`moeheal lake gc`) or move the lake ([lake] root)")
