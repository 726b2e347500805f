"""Read-only access to a GGUF MoE model (llama.cpp's file format).

`GGUFModel` wraps `gguf.GGUFReader`, which memory-maps the file: opening a
100B-parameter model costs only its header, and a tensor is read (and
dequantized to float32) when asked for. Everything a later stage relies on is
validated at open time, so a bad file fails with one `InputError` line that
names the file and the tensor, instead of a NumPy error deep in a stage.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from moeheal.pipeline.errors import InputError

SUPPORTED_ARCHS = ("qwen2moe", "qwen3moe")

# Router weights are renormalised over the chosen experts in llama.cpp's
# qwen3moe graph and not in its qwen2moe graph; a file may say otherwise.
DEFAULT_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}

GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight")
LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
)
ARCH_LAYER_TENSORS = {
    "qwen2moe": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3moe": ("attn_q_norm.weight", "attn_k_norm.weight"),
}
SHEXP_TENSORS = (
    "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
)


@dataclass(frozen=True)
class HParams:
    """The shape and numerics of a model, as the runner needs them."""

    n_layer: int
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    d_expert: int  # width of one routed expert's FFN
    d_shexp: int  # width of the shared expert's FFN, 0 when there is none
    rope_theta: float
    rms_eps: float
    vocab_size: int
    norm_topk_prob: bool
    context_length: int


class RawTensor(NamedTuple):
    """A tensor's bytes as stored: ggml blocks, one row of bytes per weight row."""

    ggml_type: GGMLQuantizationType
    data: np.ndarray  # uint8 (..., row_bytes)
    shape: tuple[int, ...]  # logical shape in NumPy order, e.g. (E, f, d)


_DIGEST_CACHE: dict[tuple[str, int, int], str] = {}


def _dequantizable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether gguf-py can turn this type into floats (tried on one zero block)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)  # (1, block_size)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return block_size > 0


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type and byte range before mapping it.

    gguf-py would otherwise fail with a bare reshape error on a truncated file;
    this names the first tensor whose bytes run past the end of the file.
    """

    def __init__(self, path: Path):
        self._label = path.name
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                ggml_type = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise InputError(f"{self._label}: tensor {name}: unknown tensor type {int(raw_dtype[0])}") from None
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            end = int(start_offs + offset_tensor[0]) + int(np.prod(dims)) * type_size // block_size
            if end > file_size:
                raise InputError(f"{self._label}: tensor {name}: truncated "
                                 f"(data ends at byte {end}, file has {file_size})")
        super()._build_tensors(start_offs, fields)


class GGUFModel:
    """A memory-mapped, validated GGUF file of a supported MoE architecture."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.name = self.path.name
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such file")
        self._reader = self._open_reader()
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.arch = self._read_arch()
        self._check_tensor_types()
        self._check_required_tensors()
        self.hp = self._read_hparams()

    # ---- validation -------------------------------------------------------

    def _open_reader(self) -> GGUFReader:
        try:
            return _CheckedReader(self.path)
        except InputError:
            raise
        except Exception as exc:  # gguf-py raises ValueError, struct/IndexError on garbage
            raise InputError(f"{self.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc

    def _read_arch(self) -> str:
        arch = self.metadata("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise InputError(
                f"{self.name}: general.architecture: unsupported architecture {arch!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        return arch

    def _check_tensor_types(self) -> None:
        for t in self._reader.tensors:
            if not _dequantizable(t.tensor_type):
                raise InputError(
                    f"{self.name}: tensor {t.name}: type {t.tensor_type.name} cannot be dequantized"
                )

    def _check_required_tensors(self) -> None:
        n_layer = int(self.metadata(f"{self.arch}.block_count", -1))
        if n_layer <= 0:
            raise InputError(f"{self.name}: key {self.arch}.block_count: missing or not positive")
        required = list(GLOBAL_TENSORS)
        has_shexp = "blk.0.ffn_up_shexp.weight" in self._tensors
        per_layer = LAYER_TENSORS + ARCH_LAYER_TENSORS[self.arch] + (SHEXP_TENSORS if has_shexp else ())
        required += [f"blk.{i}.{short}" for i in range(n_layer) for short in per_layer]
        for name in required:
            if name not in self._tensors:
                raise InputError(f"{self.name}: tensor {name}: missing")

    def _read_hparams(self) -> HParams:
        a = self.arch
        embd_shape = self._shape("token_embd.weight")  # (V, d)
        gate_exps = self._shape("blk.0.ffn_gate_exps.weight")  # (E, f, d)
        n_head = int(self._required_key(f"{a}.attention.head_count"))
        d_model = int(self.metadata(f"{a}.embedding_length", embd_shape[1]))
        q_rows = self._shape("blk.0.attn_q.weight")[0]  # n_head * head_dim
        norm_key = f"{a}.expert_weights_norm"
        return HParams(
            n_layer=int(self._required_key(f"{a}.block_count")),
            d_model=d_model,
            n_head=n_head,
            n_head_kv=int(self.metadata(f"{a}.attention.head_count_kv", n_head)),
            head_dim=int(self.metadata(f"{a}.attention.key_length", q_rows // n_head)),
            n_expert=int(self.metadata(f"{a}.expert_count", gate_exps[0])),
            n_expert_used=int(self._required_key(f"{a}.expert_used_count")),
            d_expert=int(gate_exps[1]),
            d_shexp=int(self._shape("blk.0.ffn_up_shexp.weight")[0]) if self.has_shared_expert else 0,
            rope_theta=float(self.metadata(f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(self.metadata(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            vocab_size=int(embd_shape[0]),
            norm_topk_prob=bool(self.metadata(norm_key, DEFAULT_NORM_TOPK_PROB[a])),
            context_length=int(self.metadata(f"{a}.context_length", 0)),
        )

    def _required_key(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise InputError(f"{self.name}: key {key}: missing")
        return value

    # ---- public API ---------------------------------------------------------

    @property
    def has_shared_expert(self) -> bool:
        return "blk.0.ffn_up_shexp.weight" in self._tensors

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def metadata(self, key: str, default: Any = None) -> Any:
        """A KV value as a Python scalar, string or list; `default` when absent."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            return list(value)
        return value

    def metadata_fields(self) -> dict[str, Any]:
        """Every KV field (gguf-py `ReaderField`s), for copying a file's metadata."""
        return dict(self._reader.fields)

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))  # ggml ne -> NumPy order

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape of a tensor in NumPy order."""
        self._require(name)
        return self._shape(name)

    def _require(self, name: str) -> None:
        if name not in self._tensors:
            raise InputError(f"{self.name}: tensor {name}: missing")

    def raw(self, name: str) -> RawTensor:
        """The stored blocks of a tensor (a view on the memory map; no copy)."""
        self._require(name)
        t = self._tensors[name]
        data = np.asarray(t.data)
        row_bytes = data.view(np.uint8).reshape(*data.shape[:-1], -1)  # (..., row_bytes)
        return RawTensor(ggml_type=t.tensor_type, data=row_bytes, shape=self._shape(name))

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, in NumPy shape order."""
        raw = self.raw(name)
        return dequantize_raw(raw)

    def rows(self, name: str, index: np.ndarray | slice) -> np.ndarray:
        """Selected rows of a 2-D tensor, dequantized (embedding lookup without the whole table)."""
        raw = self.raw(name)
        picked = raw.data[index]  # (n, row_bytes)
        return np.array(dequantize(picked, raw.ggml_type), dtype=np.float32)  # (n, cols)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Every `blk.{i}.*` tensor, dequantized, keyed by its short name (`attn_q.weight`)."""
        prefix = f"blk.{i}."
        return {n[len(prefix):]: self.tensor(n) for n in self._tensors if n.startswith(prefix)}

    def tokenizer(self):  # -> tokenizers.Tokenizer
        """The file's byte-level BPE tokenizer (see `pipeline.tokenizer`)."""
        from moeheal.pipeline.tokenizer import build_tokenizer

        return build_tokenizer(self)

    def digest(self) -> str:
        """SHA-256 of the file's bytes, cached per (path, mtime, size)."""
        st = self.path.stat()
        key = (str(self.path.resolve()), st.st_mtime_ns, st.st_size)
        if key not in _DIGEST_CACHE:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            _DIGEST_CACHE[key] = h.hexdigest()
        return _DIGEST_CACHE[key]


def dequantize_raw(raw: RawTensor) -> np.ndarray:
    """Float32 values of stored blocks, in the tensor's logical shape."""
    values = dequantize(raw.data, raw.ggml_type)  # (..., cols)
    return np.array(values, dtype=np.float32).reshape(raw.shape)  # a copy: never a view on the map
