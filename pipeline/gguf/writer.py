"""Writing GGUF files atomically, and copying one with some tensors replaced; the types a writer
stores a model's matrices in, and float weights encoded as one of them.

A half-written model in the lake would later be read as a (corrupt) healed
model, so every file is written to a temporary name in the destination folder
and renamed into place only once complete (`os.replace` is atomic on one file
system).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from moeheal.pipeline.gguf.metadata import FILE_TYPE_KEY, FILE_TYPE_OF, KV, U32, experts_file_type
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.roles import ROUTED_TENSOR

TensorItem = tuple[str, np.ndarray, GGMLQuantizationType]

# Fields the writer produces itself (header counts, architecture, alignment).
WRITER_OWNED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.alignment")

_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}

# A model's weight matrices by the name a user gives their type (`synth --type`, `convert_checkpoint`'s
# outtype): the ggml type they are stored in and the `general.file_type` a file of them declares.
MATRIX_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    name: (ggml_type, FILE_TYPE_OF[ggml_type]) for name, ggml_type in (
        ("q8_0", GGMLQuantizationType.Q8_0), ("f16", GGMLQuantizationType.F16),
        ("bf16", GGMLQuantizationType.BF16), ("f32", GGMLQuantizationType.F32))
}


def encode(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Float weights (..., cols) as stored: float32 for F32, float16 for F16, otherwise gguf-py's
    block bytes (..., row_bytes) uint8 (Q8_0 and BF16 as llama.cpp's converter rounds them)."""
    if ggml_type == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    contiguous = np.ascontiguousarray(data, dtype=np.float32)  # (..., cols), no copy when it already is
    return contiguous if ggml_type == GGMLQuantizationType.F32 else quantize(contiguous, ggml_type)


def _scalar_type(value: Any) -> GGUFValueType:
    """The GGUF type llama.cpp's converter uses for a Python value."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        return GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def add_kv(writer: GGUFWriter, key: str, value: Any, vtype: GGUFValueType | None,
           sub_type: GGUFValueType | None = None) -> None:
    """One key on the writer: a list, tuple or array as an array of `sub_type`, else of `vtype` (the
    item type, as `gguf_metadata.metadata_kv` gives it), else of its first item's inferred type."""
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if sub_type is None and vtype not in (None, GGUFValueType.ARRAY):
            sub_type = vtype  # the element type, as the caller named it (llama.cpp insists on some)
        if sub_type is None:
            sub_type = _scalar_type(items[0]) if items else GGUFValueType.INT32
            if sub_type == GGUFValueType.UINT32 and any(int(v) < 0 for v in items):
                sub_type = GGUFValueType.INT32
        writer.add_key_value(key, items, GGUFValueType.ARRAY, sub_type=sub_type)
        return
    writer.add_key_value(key, value, vtype if vtype is not None else _scalar_type(value))


def _stored(data: np.ndarray, ggml_type: GGMLQuantizationType, name: str) -> np.ndarray:
    """The array as the file stores it: uint8 block bytes as given, F32/F16 data in its float type."""
    if data.dtype == np.uint8:
        return data
    float_dtype = _FLOAT_TYPES.get(ggml_type)
    if float_dtype is None:
        raise ValueError(f"tensor {name}: {ggml_type.name} data must be given as uint8 block bytes")
    return np.ascontiguousarray(data, dtype=float_dtype)


def _add_tensor(writer: GGUFWriter, name: str, data: np.ndarray, ggml_type: GGMLQuantizationType) -> None:
    """Float arrays for F32/F16 tensors; uint8 block bytes `[..., row_bytes]` for any type."""
    writer.add_tensor(name, _stored(data, ggml_type, name), raw_dtype=ggml_type)


@contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """A temporary sibling of `path`, renamed onto it when the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write(path: Path, arch: str, fill) -> None:
    with _atomic_path(path) as tmp:
        writer = GGUFWriter(tmp, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def write_gguf(path: str | os.PathLike[str], arch: str, kv: Sequence[KV], tensors: Iterable[TensorItem]) -> None:
    """Write a GGUF file with the given metadata and tensors, atomically.

    `kv` is a list of `(key, value, type)`; a `None` type is inferred (ints as
    UINT32, floats as FLOAT32, lists as arrays of their first item's type).
    Tensor data is float32/float16 for F32/F16, or uint8 block bytes of shape
    `[..., row_bytes]` for a quantized type.
    """

    def fill(writer: GGUFWriter) -> None:
        for key, value, vtype in kv:
            add_kv(writer, key, value, vtype)
        for name, data, ggml_type in tensors:
            _add_tensor(writer, name, data, ggml_type)

    _write(Path(path), arch, fill)


@dataclass(frozen=True)
class Deferred:
    """A replacement tensor known by its byte shape and type, its uint8 block bytes read only when
    the writer reaches it: a copy then holds one replaced tensor in memory, not all of them."""

    byte_shape: tuple[int, ...]  # (..., row bytes)
    ggml_type: GGMLQuantizationType
    read: Callable[[], np.ndarray]  # -> uint8 block bytes of `byte_shape`


Replacement = tuple[np.ndarray, GGMLQuantizationType] | Deferred


def _add_info(writer: GGUFWriter, name: str, tensor: np.ndarray | Deferred, ggml_type: GGMLQuantizationType) -> None:
    """The tensor table entry add_tensor would write for the same data, without holding the data."""
    if isinstance(tensor, Deferred):
        writer.add_tensor_info(name, tensor.byte_shape, np.dtype(np.uint8), int(np.prod(tensor.byte_shape)),
                               raw_dtype=ggml_type)
    else:
        writer.add_tensor_info(name, tensor.shape, tensor.dtype, tensor.nbytes, raw_dtype=ggml_type)


def file_type_kv(src: GGUFModel, written: Mapping[str, GGMLQuantizationType]) -> list[KV]:
    """`general.file_type` for a copy of `src` whose tensors are stored in the types `written`
    names (every tensor of `src`): the file type of its routed experts' types
    (`metadata.experts_file_type`, each tensor counting its weights), or none when those are the
    source's own (its key, copied, still says what they are) or no file type names them."""
    routed = [name for name in src.tensor_names if ROUTED_TENSOR.match(name)]
    if all(written[name] == src.raw(name).ggml_type for name in routed):
        return []
    weights: dict[GGMLQuantizationType, int] = {}
    for name in routed:
        weights[written[name]] = weights.get(written[name], 0) + math.prod(src.shape(name))
    file_type = experts_file_type(weights)
    return [] if file_type is None else [(FILE_TYPE_KEY, int(file_type), U32)]


def copy_gguf(src: GGUFModel, path: str | os.PathLike[str],
              replace: Mapping[str, Replacement] | None = None,
              extra_kv: Sequence[KV] = ()) -> None:
    """Copy every KV and tensor of `src` to `path`, replacing the tensors named in `replace`.

    Streams from disk to disk: the tensor table is written from shapes alone,
    then each tensor's data in file order, unreplaced ones as views on the
    source's memory map and `Deferred` ones read just before they are written.
    The bytes are those `GGUFWriter.add_tensor` + `write_tensors_to_file` give.
    `extra_kv` entries are added, or overwrite same-named keys of the source. Where the routed
    experts change type, `general.file_type` says what they are now (`file_type_kv`), unless
    `extra_kv` sets it.
    """
    replace = replace or {}
    unknown = sorted(set(replace) - set(src.tensor_names))
    if unknown:
        raise KeyError(f"{src.name}: no tensor named {unknown[0]}")
    given = {name: _stored(value[0], value[1], name) for name, value in replace.items()
             if not isinstance(value, Deferred)}

    def tensor_of(name: str) -> tuple[np.ndarray | Deferred, GGMLQuantizationType]:
        """What is written under `name`: the given array, a Deferred, or the source's own bytes."""
        value = replace.get(name)
        if isinstance(value, Deferred):
            return value, value.ggml_type
        if value is not None:
            return given[name], value[1]
        raw = src.raw(name)
        return raw.data, raw.ggml_type

    if FILE_TYPE_KEY not in {key for key, _, _ in extra_kv}:
        extra_kv = [*extra_kv, *file_type_kv(src, {name: tensor_of(name)[1] for name in src.tensor_names})]
    extra_keys = {key for key, _, _ in extra_kv}

    with _atomic_path(Path(path)) as tmp:
        writer = GGUFWriter(tmp, src.arch.name)
        for key, field in src.metadata_fields().items():
            if key in WRITER_OWNED_KEYS or key in extra_keys:
                continue
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            add_kv(writer, key, src.metadata(key), field.types[0], sub_type)
        for key, value, vtype in extra_kv:
            add_kv(writer, key, value, vtype)
        for name in src.tensor_names:
            _add_info(writer, name, *tensor_of(name))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name in src.tensor_names:
            tensor, _ = tensor_of(name)
            writer.write_tensor_data(tensor.read() if isinstance(tensor, Deferred) else tensor)
        writer.close()
