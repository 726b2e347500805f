"""The `assemble` stage: one variant's healed GGUF, the source with every layer's calibrated tensors in place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from moeheal.kernels import decode
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.writer import Deferred, copy_gguf
from moeheal.pipeline.lake.stage import Log, Stage


def layer_replacements(calibrated: Path, layer: int) -> dict[str, Deferred]:
    """The tensors one calibrate unit replaces, keyed by GGUF name, each read only when written.

    Only the small `.shape` and `.format` members are read here (an npz reads members one at a
    time): the byte shape follows from the format's block geometry.
    """
    file = calibrated / f"layer_{layer}.npz"
    with np.load(file) as data:
        names = [key.removesuffix(".format") for key in data.files if key.endswith(".format")]
        shapes = {name: tuple(int(n) for n in data[f"{name}.shape"]) for name in names}  # numpy order, weights
        formats = {name: decode.format_of(str(data[f"{name}.format"])) for name in names}
    replace = {}
    for name in names:
        fmt, shape = formats[name], shapes[name]
        byte_shape = (*shape[:-1], shape[-1] // fmt.block_size * fmt.type_size)  # (..., row bytes)
        replace[f"blk.{layer}.{name}.weight"] = Deferred(byte_shape, fmt.ggml_type, _npz_member(file, name))
    return replace


def _npz_member(file: Path, name: str) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        with np.load(file) as data:
            return data[name]
    return read


def assemble_gguf(out: Path, source: GGUFModel, calibrated: list[Path], variant: str, params: dict[str, Any]) -> None:
    """The healed model: the source GGUF with every tensor the variant quantized replaced, each in
    the format recorded beside it (routed experts, the shared down projection, any other role a
    recipe chose); `moeheal.*` keys record the variant and its knobs. `calibrated[i]` is the i-th MoE
    layer's calibrate unit (`GGUFModel.moe_layers`; dense layers are copied as they are). Tensors are
    streamed: one replaced tensor is in memory at a time."""
    replace: dict[str, Deferred] = {}
    if len(calibrated) != len(source.moe_layers):
        raise ValueError(f"{len(calibrated)} calibrate units for {len(source.moe_layers)} MoE layers")
    for layer, unit in zip(source.moe_layers, calibrated):
        replace |= layer_replacements(unit, layer)
    copy_gguf(source, out, replace, extra_kv=[
        ("moeheal.variant", variant, None),
        ("moeheal.params", json.dumps(params, sort_keys=True), None),
        ("moeheal.source_sha256", source.digest(), None),
    ])


@dataclass(frozen=True)
class AssembleParams:
    """The variant's name and knobs, written into the GGUF's `moeheal.*` keys."""

    variant: str
    knobs: dict[str, Any]



def build_assembly(out: Path, params: AssembleParams, *, source: Path, calibrated: Mapping[int, Path],
                   log: Log) -> None:
    """The assemble stage: the healed GGUF from the `source` and every MoE layer's calibrate unit
    (`calibrated`, by layer)."""
    assemble_gguf(out, open_model(source), [calibrated[layer] for layer in sorted(calibrated)], params.variant,
                  {"variant": params.variant, "knobs": params.knobs})


STAGE = Stage("assemble", "models", build_assembly, suffix=".gguf")
