"""Write calibration statistics as a llama.cpp importance-matrix GGUF.

The layout is what llama.cpp's ``llama-imatrix`` writes (tools/imatrix,
``IMatrixCollector::save_imatrix``) and ``llama-quantize --imatrix`` reads:

- ``general.type = "imatrix"``; ``imatrix.datasets`` (array of strings),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (uint32).
- per weight tensor ``<name>``, sorted by name: ``<name>.in_sum2``, F32 with
  ggml shape (cols, n_mat) = numpy (n_mat, cols), the sum over tokens of the
  squared input of each column; and ``<name>.counts``, F32 with ggml shape
  (1, n_mat) = numpy (n_mat, 1), the number of tokens summed. n_mat is the
  number of experts for merged ``*_exps`` tensors (each expert counts only the
  tokens routed to it) and 1 otherwise.

So a user can hand our calibration statistics to llama.cpp's own quantizers
(IQ2_XXS and friends) and compare like with like.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from moeheal.pipeline.errors import InputError


def imatrix_arrays(path: str | os.PathLike, name: str, in_sum2: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate one tensor's statistics; return (in_sum2 (n_mat, cols), counts (n_mat, 1)) float32."""
    sums = np.asarray(in_sum2, np.float64)
    cnt = np.asarray(counts, np.float64).reshape(-1)  # (n_mat,)
    if sums.ndim == 1:
        sums = sums[None, :]  # (1, cols)
    if sums.ndim != 2:
        raise InputError(f"{path}: {name}: in_sum2 must be [cols] or [n_expert, cols], got shape {sums.shape}")
    if name.endswith("_exps.weight") and np.asarray(in_sum2).ndim != 2:
        raise InputError(f"{path}: {name}: merged expert tensor needs per-expert in_sum2 [n_expert, cols]")
    if cnt.shape != (sums.shape[0],):
        raise InputError(f"{path}: {name}: {cnt.size} counts for {sums.shape[0]} matrices")
    if not (np.isfinite(sums).all() and np.isfinite(cnt).all()):
        raise InputError(f"{path}: {name}: non-finite statistics")
    if (sums < 0).any() or (cnt < 0).any():
        raise InputError(f"{path}: {name}: negative sum of squares or count")
    return sums.astype(np.float32), cnt.astype(np.float32)[:, None]


def write_imatrix(
    path: str | os.PathLike,
    stats: dict[str, tuple[np.ndarray, np.ndarray]],
    chunk_count: int,
    datasets: list[str],
    chunk_size: int = 512,
) -> None:
    """Write ``stats`` {weight name: (in_sum2, counts)} as an imatrix GGUF at ``path``.

    in_sum2 is [cols] (dense) or [n_expert, cols] (``*_exps``), counts [] / [1]
    or [n_expert]; chunk_count chunks of chunk_size tokens were run; datasets
    names the text they came from. Written to a temporary file in the same
    folder and renamed into place, so a reader never sees a partial file.
    """
    path = Path(path)
    arrays = {name: imatrix_arrays(path, name, *stats[name]) for name in sorted(stats)}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp_name, arch="imatrix")  # general.architecture is ignored by llama.cpp
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
        for name, (sums, cnt) in arrays.items():
            writer.add_tensor(f"{name}.in_sum2", sums)  # (n_mat, cols)
            writer.add_tensor(f"{name}.counts", cnt)  # (n_mat, 1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
