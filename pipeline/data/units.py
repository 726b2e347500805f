"""The files the per-layer units and a budget's allocation write, read back: a unit's tensors
(`layer_<i>.npz`) and an allocation's recipe."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.model import roles

EXPERT_TENSORS = roles.ROUTED


def read_recipe(allocation: Path) -> dict[tuple[int, str], str]:
    """An allocation stage's `recipe.parquet` as {(layer, tensor role): format}, every chosen role."""
    rows = read_part(allocation / "recipe.parquet", ("layer", "role", "format")).to_pylist()
    return {(r["layer"], r["role"]): r["format"] for r in rows}


def load_quantized(path: Path, layer: int) -> dict[str, np.ndarray]:
    with np.load(path / f"layer_{layer}.npz") as data:
        return {key: data[key] for key in data.files}
