"""The guidance stage's Fisher weights on disk, apart from the stage so that what reads them (the
quantize and sensitivity stages) does not carry the stage's code (the e2e stage's streamed model) in
its fingerprint.

The guidance stage's Zarr store (`dumps/<fingerprint>.zarr`) holds per MoE layer an array
`"<layer>"` (rows, d): one trace's rows in its dump's order, stored as bfloat16 bits as a bfloat16
dump stores its activations, with the layer's mean over rows and channels in its `mean` attribute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

from moeheal.pipeline.data.dumps import BFLOAT16_BITS, CHUNK_CODECS, from_stored, to_stored
from moeheal.pipeline.errors import InputError


def create_fisher(path: Path, layers: tuple[int, ...], rows: int, width: int, chunk_rows: int) -> dict[int, zarr.Array]:
    """Empty arrays (rows, width) for `layers` in a new `path`, chunked `chunk_rows` rows."""
    root = zarr.open_group(str(path), mode="w")
    arrays = {}
    for layer in layers:
        arrays[layer] = root.create_array(str(layer), shape=(rows, width), chunks=(chunk_rows, width),
                                          dtype=BFLOAT16_BITS, compressors=CHUNK_CODECS)
        arrays[layer].attrs["stored_as"] = "bfloat16"
    return arrays


def write_rows(array: zarr.Array, start: int, values: np.ndarray) -> None:
    """Rows `start`.. of a layer's array from float32 values (n, width)."""
    array[start:start + len(values)] = to_stored(values, "bfloat16")


def _layer_array(path: Path, layer: int) -> tuple[zarr.Array, float]:
    try:
        array = zarr.open_group(str(path), mode="r")[str(layer)]
        return array, float(array.attrs["mean"])
    except (KeyError, FileNotFoundError) as exc:
        raise InputError(f"{path}: no guidance for layer {layer} ({exc})") from None


def read_fisher(path: Path, layer: int, rows: slice) -> np.ndarray:
    """Layer `layer`'s weights over `rows`, divided by the layer's mean: (n, d) float32, mean about 1
    (a loss weight: learned rounding's loss keeps its scale)."""
    array, mean = _layer_array(path, layer)
    return from_stored(array[rows], "bfloat16") / np.float32(mean)


def read_fisher_values(path: Path, layer: int) -> np.ndarray:
    """Layer `layer`'s weights over every row as estimated, in the log-likelihood's units: (rows, d)
    float32, comparable across layers (what an error there costs the model's prediction)."""
    array, _ = _layer_array(path, layer)
    return from_stored(array[:], "bfloat16")
