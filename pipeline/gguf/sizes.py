"""Bytes of a GGUF's tensors by format and role: what a recipe costs, and what a written file holds."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from moeheal.kernels import decode
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model import roles
from moeheal.pipeline.model.roles import ROLE_TENSOR, ROUTED_TENSOR


def tensor_bytes(fmt: str, n_weights: int) -> int:
    """Bytes of `n_weights` weights in `fmt` (whole blocks; the registry's geometry)."""
    cls = decode.format_of(fmt)
    return n_weights // cls.block_size * cls.type_size


def fixed_size(source: GGUFModel, chosen: tuple[str, ...], shexp_down: str | None) -> tuple[int, int]:
    """Weights and bytes of every tensor whose format a recipe does not choose, as the assembled
    GGUF holds it: the source's, with the shared down projection in `shexp_down` where it is not
    chosen (None: no shared expert)."""
    weights = n_bytes = 0
    for name, (_, n, b) in source.tensor_sizes().items():
        match = ROLE_TENSOR.match(name)
        if match and match.group(2) in chosen:
            continue
        if shexp_down is not None and name.endswith(".ffn_down_shexp.weight"):
            b = tensor_bytes(shexp_down, n)
        weights, n_bytes = weights + n, n_bytes + b
    return weights, n_bytes


def least_bpw(source: GGUFModel, formats: tuple[str, ...], chosen: tuple[str, ...], fixed: tuple[int, int]) -> float:
    """The fewest bits per covered weight any recipe of `formats` takes: every chosen tensor in its
    cheapest format, plus the `fixed` (weights, bytes) the budget also covers."""
    sizes = [n for name, (_, n, _) in source.tensor_sizes().items()
             if (m := ROLE_TENSOR.match(name)) and m.group(2) in chosen]
    cheapest = sum(min(tensor_bytes(f, n) for f in formats) for n in sizes)
    return 8 * (cheapest + fixed[1]) / (sum(sizes) + fixed[0])


# ---- what a written GGUF holds: its recipe and its size (read from the file, never estimated) --------
SIZES_SCHEMA = pa.schema([
    ("variant", pa.string()), ("kind", pa.string()), ("budget_bpw", pa.float64()), ("budget_roles", pa.string()),
    ("routed_weights", pa.int64()), ("routed_bytes", pa.int64()), ("routed_bpw", pa.float64()),
    ("total_weights", pa.int64()), ("total_bytes", pa.int64()), ("total_bpw", pa.float64()),
    ("file_bytes", pa.int64())])


GGUF_RECIPE_SCHEMA = pa.schema([
    ("variant", pa.string()), ("layer", pa.int32()), ("role", pa.string()), ("tensor", pa.string()),
    ("format", pa.string()), ("n_weights", pa.int64()), ("bytes", pa.int64()), ("pred_err", pa.float64()),
    ("chosen_by", pa.string()), ("sensitivity", pa.string())])


ROLE_ORDER = roles.ROUTED + roles.SHARED + roles.ATTENTION


def gguf_recipe(model: GGUFModel) -> list[dict[str, Any]]:
    """One row per tensor of a GGUF in a role a recipe may choose (`pipeline.model.roles`): layer, role,
    tensor, format (the ggml type's name, lower case), weights and bytes as stored."""
    rows = []
    for name, (ggml_type, n_weights, n_bytes) in model.tensor_sizes().items():
        match = ROLE_TENSOR.match(name)
        if match:
            rows.append({"layer": int(match.group(1)), "role": match.group(2), "tensor": name,
                         "format": ggml_type.name.lower(), "n_weights": n_weights, "bytes": n_bytes})
    return sorted(rows, key=lambda r: (r["layer"], ROLE_ORDER.index(r["role"])))


def gguf_size(model: GGUFModel) -> dict[str, Any]:
    """Weights and bytes of the routed experts and of every tensor, summed from the file's tensor table."""
    sizes = model.tensor_sizes()
    routed = [(n, b) for name, (_, n, b) in sizes.items() if ROUTED_TENSOR.match(name)]
    routed_w, routed_b = sum(n for n, _ in routed), sum(b for _, b in routed)
    total_w, total_b = sum(n for _, n, _ in sizes.values()), sum(b for _, _, b in sizes.values())
    return {"routed_weights": routed_w, "routed_bytes": routed_b, "routed_bpw": 8 * routed_b / routed_w,
            "total_weights": total_w, "total_bytes": total_b, "total_bpw": 8 * total_b / total_w,
            "file_bytes": model.path.stat().st_size}
