"""A Hugging Face checkpoint directory to a GGUF reference, with NumPy alone (no torch at run time).

A checkpoint on a model hub is `config.json`, one or more `*.safetensors` files and
`tokenizer.json`. This module reads them without torch or transformers: the safetensors
header is a JSON table of byte ranges, each tensor a NumPy view of the memory-mapped file
(bf16 widened to float32 by a 16-bit shift, its exact value), and the config is a
`CheckpointConfig` that fills in the defaults transformers' config classes would. The
tensors are renamed from the checkpoint's form (one matrix per expert, Mixtral's
`block_sparse_moe.*.w1/w2/w3`) into the fused form transformers' modules hold, and from
there `pipeline.sources.convert.state_to_gguf` writes them exactly as it writes a loaded
transformers model: the same names, metadata and per-family rewrites as llama.cpp's
`convert_hf_to_gguf.py`.

A byte-level BPE's `tokenizer.ggml.pre` is not guessed from the family: every
pre-tokenizer we reproduce (`pipeline.gguf.tokenizer.PRE_TOKENIZERS`) is tried on a probe
text, and the first whose ids equal `tokenizer.json`'s own is written; none equal is an
`InputError`. What we cannot convert (another family, no safetensors, FP8 or integer
weights, a tokenizer we do not reproduce) is refused with one line naming llama.cpp's
converter, which handles far more.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from moeheal.pipeline.sources.convert import (
    ARCH_BY_MODEL_TYPE, id_ordered_tokens, is_sentencepiece, merge_strings, state_to_gguf,
)
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.writer import MATRIX_TYPES

ALTERNATIVE = "convert it with llama.cpp's convert_hf_to_gguf.py and pass the GGUF instead"

# safetensors dtype -> NumPy dtype as stored (bf16 is read as raw 16-bit words, `_to_float32`).
STORED_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

# Config values transformers' config classes default to when a checkpoint's config.json leaves
# them out (per `model_type`; the common ones for every family). Only keys `state_to_gguf` reads.
COMMON_DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    "head_dim": None, "moe_intermediate_size": None, "shared_expert_intermediate_size": None,
    "sliding_window": None, "attention_bias": False,
}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {}, "qwen3_moe": {}, "olmoe": {}, "mixtral": {},
    "qwen3_next": {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1, "head_dim": 256,
                   "full_attention_interval": 4, "linear_conv_kernel_dim": 4},
    "deepseek_v3": {"rope_interleave": True, "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                    "q_lora_rank": 1536},
}
# transformers' `attribute_map`s: a config key read under a second name.
ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {
    "deepseek_v3": {"num_local_experts": "n_routed_experts"},
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
}
# Mixtral's names for the expert matrices: w1 gate, w3 up, w2 down.
MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# A text that exercises a pre-tokenizer's every rule: spaces and line breaks, digits, contractions,
# punctuation runs, CJK, kana, Cyrillic, accents, emoji.
PRE_TOKENIZER_PROBE = ("Hello World\n\n  it's 12345 apples, isn't it?\t\tOK!!  ¿Qué tal? "
                       "東京は日本の首都です。カタカナ 你好世界 Привет, мир 3.14159 "
                       "'''``` \"\"\" ...... ------=== 🚀🙂 x_y=f(a,b)->c;\r\n    def f(): return 0\n")
PREFERRED_PRE = {"olmoe": "olmo", "deepseek_v3": "deepseek-v3"}  # else "qwen2" is tried first


class MissingConfigKey(InputError, AttributeError):
    """A config key neither config.json nor the family's defaults have: an AttributeError to
    `getattr(config, key, default)`, which then takes its default, and an InputError naming the
    key (a truncated config) to anything else."""


class CheckpointConfig:
    """config.json's values as attributes, with the family's defaults (`MissingConfigKey` else)."""

    def __init__(self, values: dict[str, Any], where: str):
        self._values, self._where = values, where

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self._values[key]
        except KeyError:
            raise MissingConfigKey(f"{self._where}: key {key}: missing") from None


def read_config(hf_dir: Path) -> CheckpointConfig:
    """`config.json` as a `CheckpointConfig`: refused unless its `model_type` is a supported family;
    the RoPE settings in transformers' current form (`rope_parameters`, from the older `rope_theta`,
    `rope_scaling` and `partial_rotary_factor`), Qwen3-Next's `layer_types` from its interval."""
    path = hf_dir / "config.json"
    if not path.is_file():
        raise InputError(f"{hf_dir}: no config.json, so not a Hugging Face checkpoint directory; "
                         f"for another layout, {ALTERNATIVE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in ARCH_BY_MODEL_TYPE:
        raise InputError(f"{path}: model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(sorted(ARCH_BY_MODEL_TYPE))}); {ALTERNATIVE}")
    values = {**COMMON_DEFAULTS, **FAMILY_DEFAULTS[model_type], **raw, "name_or_path": hf_dir.name}
    values.setdefault("num_key_value_heads", values.get("num_attention_heads"))
    for alias, key in ATTRIBUTE_MAPS.get(model_type, {}).items():
        for one, other in ((alias, key), (key, alias)):
            if one not in values and other in values:
                values[one] = values[other]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a list of ids: the first is the token
        if isinstance(values[key], list):
            values[key] = values[key][0] if values[key] else None
    if "rope_parameters" not in values:
        rope = dict(values.get("rope_scaling") or {})
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
        rope["rope_theta"] = values.get("rope_theta", 10000.0)
        if "partial_rotary_factor" in values:
            rope["partial_rotary_factor"] = values["partial_rotary_factor"]
        values["rope_parameters"] = rope
    if model_type == "qwen3_next" and "layer_types" not in values:
        interval = values["full_attention_interval"]
        values["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(values["num_hidden_layers"])]
    return CheckpointConfig(values, str(path))


class SafetensorsFile:
    """One `.safetensors` file, memory-mapped: its header's table of (dtype, shape, byte range)
    per tensor, and each tensor as a float32 array on request."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise InputError(f"{path}: header of {n} bytes runs past the end of the {size}-byte file")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"{path}: header is not JSON ({exc})") from None
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else b""
        if not isinstance(header, dict):
            raise InputError(f"{path}: header is not a JSON object")
        header.pop("__metadata__", None)
        for name, entry in header.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
                    and isinstance(entry.get("shape"), list) and all(isinstance(n, int) for n in entry["shape"])
                    and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2):
                raise InputError(f"{path}: tensor {name}: header entry is not {{dtype, shape, data_offsets}}")
        self._start, self._size = 8 + n, size
        self.entries: dict[str, dict[str, Any]] = header

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 (a copy): F32 as stored, F16 widened, BF16 shifted into float32's high half."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        stored = STORED_DTYPES.get(entry["dtype"])
        if stored is None:
            raise InputError(f"{self.path}: tensor {name}: dtype {entry['dtype']} is not supported (F32, F16 and "
                             f"BF16 are); {ALTERNATIVE}")
        shape = tuple(entry["shape"])
        if not 0 <= begin <= end <= self._size - self._start or end - begin != np.dtype(stored).itemsize * int(
                np.prod(shape)):
            raise InputError(f"{self.path}: tensor {name}: byte range [{begin}, {end}) does not hold "
                             f"{entry['dtype']} {list(shape)} inside the file")
        words = np.frombuffer(self._map, stored, int(np.prod(shape)), self._start + begin).reshape(shape)
        return _to_float32(words, entry["dtype"])


def _to_float32(words: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as float32: bf16 is float32's upper 16 bits, so a shift gives its exact value."""
    if dtype == "BF16":
        return (words.astype(np.uint32) << 16).view(np.float32)  # (...) exact
    return words.astype(np.float32)  # (...) a copy; f16 -> f32 is exact


def open_safetensors(hf_dir: Path) -> dict[str, SafetensorsFile]:
    """Every tensor name -> the file holding it, over the `*.safetensors` files of the directory."""
    paths = sorted(hf_dir.glob("*.safetensors"))
    if not paths:
        raise InputError(f"{hf_dir}: no *.safetensors files (PyTorch .bin checkpoints are not read); {ALTERNATIVE}")
    where: dict[str, SafetensorsFile] = {}
    for path in paths:
        shard = SafetensorsFile(path)
        for name in shard.entries:
            if name in where:
                raise InputError(f"{path}: tensor {name}: also in {where[name].path.name}")
            where[name] = shard
    return where


def _checkpoint_name(name: str, n_layer: int) -> tuple[str, int, str] | str | None:
    """A checkpoint tensor's name in transformers' module form; (layer, expert, matrix) for one
    expert's matrix, to be stacked; None for what the GGUF does not hold (multi-token-prediction
    layers, RoPE's cached frequencies)."""
    if name.startswith("mtp.") or name.endswith("rotary_emb.inv_freq"):
        return None
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer = int(parts[2])
        if layer >= n_layer:  # DeepSeek-V3's next-token-prediction layers follow the model's
            return None
        rest = parts[3:]
        if rest[:1] == ["block_sparse_moe"]:  # Mixtral
            rest = ["mlp"] + rest[1:]
            if rest[1:2] == ["experts"] and len(rest) == 5:
                rest[3] = MIXTRAL_EXPERT.get(rest[3], rest[3])
        if rest[:2] == ["mlp", "experts"] and len(rest) == 5 and rest[2].isdigit() and rest[4] == "weight":
            return layer, int(rest[2]), rest[3]
        return ".".join(["model", "layers", str(layer)] + rest)
    return name


def read_state(hf_dir: Path, config: CheckpointConfig) -> dict[str, np.ndarray]:
    """The checkpoint's float32 tensors in transformers' module names: per-expert matrices
    stacked into `mlp.experts.gate_up_proj` (E, 2f, d) and `mlp.experts.down_proj` (E, d, f);
    Qwen3-Next's A_log as -exp(A_log), under `linear_attn.ssm_a` (`pipeline.sources.convert` does it with torch)."""
    files = open_safetensors(hf_dir)
    state: dict[str, np.ndarray] = {}
    experts: dict[int, dict[str, dict[int, str]]] = {}
    for name, shard in files.items():
        target = _checkpoint_name(name, config.num_hidden_layers)
        if target is None:
            continue
        if isinstance(target, tuple):
            layer, expert, matrix = target
            experts.setdefault(layer, {}).setdefault(matrix, {})[expert] = name
            continue
        state[target] = shard.tensor(name)
    for layer, matrices in experts.items():
        stacked = {}
        for matrix in ("gate_proj", "up_proj", "down_proj"):
            names = matrices.get(matrix, {})
            if sorted(names) != list(range(len(names))) or not names:
                raise InputError(f"{hf_dir}: layer {layer}: experts' {matrix} are not numbered 0..E-1 "
                                 f"({len(names)} found)")
            stacked[matrix] = np.stack([files[names[e]].tensor(names[e]) for e in range(len(names))])  # (E, r, c)
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = np.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=1)  # (E, 2f, d): gate rows first
        state[prefix + "gate_up_proj"] = gate_up
        state[prefix + "down_proj"] = stacked["down_proj"]  # (E, d, f)
    for name in [n for n in state if n.endswith("linear_attn.A_log")]:  # Qwen3-Next
        # NumPy's float32 exp, within 2 ulp of the torch exp llama.cpp's converter applies; renamed
        # `ssm_a` so that `convert._qwen3next_state` passes it by.
        state[name.removesuffix("A_log") + "ssm_a"] = -np.exp(state.pop(name))  # (Hv,)
    return state


def read_tokenizer(hf_dir: Path) -> Tokenizer:
    """`tokenizer.json` (the vocabulary, merges and pre-tokenizer a GGUF's vocabulary is built from)."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{hf_dir}: no tokenizer.json (a SentencePiece tokenizer.model alone is not read); "
                         f"{ALTERNATIVE}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own Exception subclass on bad JSON
        raise InputError(f"{path}: cannot read ({exc})") from None


def pre_tokenizer_tag(tokenizer: Tokenizer, model_type: str, where: str) -> str:
    """The `PRE_TOKENIZERS` tag whose tokenizer, built from this vocabulary as a GGUF reader
    builds it, gives `tokenizer`'s own ids on `PRE_TOKENIZER_PROBE`; the family's usual tag first."""
    from moeheal.pipeline.gguf.tokenizer import PRE_TOKENIZERS, tokenizer_from_vocab

    tokens, merges = id_ordered_tokens(tokenizer), merge_strings(tokenizer)
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    types = [3 if t in added else 1 for t in tokens]
    want = tokenizer.encode(PRE_TOKENIZER_PROBE, add_special_tokens=False).ids
    first = PREFERRED_PRE.get(model_type, "qwen2")
    for tag in [first] + [t for t in PRE_TOKENIZERS if t != first]:
        if tokenizer_from_vocab(tokens, merges, types, tag).encode(PRE_TOKENIZER_PROBE).ids == want:
            return tag
    raise InputError(f"{where}: the tokenizer's pre-tokenizer is none we reproduce "
                     f"({', '.join(PRE_TOKENIZERS)}); {ALTERNATIVE}")


def convert_checkpoint(hf_dir: Path, out_gguf: Path, *, outtype: str = "f16") -> Path:
    """Write the checkpoint in `hf_dir` as the GGUF `out_gguf` (atomically) and return its path.

    `outtype` is the weight matrices' type (a `gguf_write.MATRIX_TYPES` name): "f16" (the default:
    half of float32's size, and every bf16 or f16 weight's value within f16's rounding; values
    beyond f16's range are refused), "bf16" (a bf16 checkpoint's exact values), "f32" (exact), or
    "q8_0". Norms, biases and routers stay F32, as llama.cpp writes them.
    """
    hf_dir, out_gguf = Path(hf_dir), Path(out_gguf)
    if outtype not in MATRIX_TYPES:
        raise InputError(f"outtype {outtype!r}: not one of {', '.join(MATRIX_TYPES)}")
    if not hf_dir.is_dir():
        raise InputError(f"{hf_dir}: no such directory")
    config = read_config(hf_dir)
    tokenizer = read_tokenizer(hf_dir)
    state = read_state(hf_dir, config)
    if outtype == "f16":
        for name, w in state.items():
            if w.ndim >= 2 and np.abs(w).max(initial=0.0) > np.finfo(np.float16).max:
                raise InputError(f"{hf_dir}: tensor {name}: values beyond float16's range; use outtype f32")
    pre = "qwen2" if is_sentencepiece(tokenizer) else pre_tokenizer_tag(tokenizer, config.model_type,
                                                                          str(hf_dir / "tokenizer.json"))
    try:
        state_to_gguf(state, config, tokenizer, out_gguf, outtype, pre=pre)
    except KeyError as exc:  # a tensor the family's rewrite needs is not in the checkpoint
        raise InputError(f"{hf_dir}: tensor {exc.args[0]}: missing; {ALTERNATIVE}") from None
    except ValueError as exc:  # a parameter with no GGUF name, or settings the family's graph computes otherwise
        unknown_tensor = str(exc).startswith("no GGUF name")
        raise InputError(f"{hf_dir}: {exc}" + (f"; {ALTERNATIVE}" if unknown_tensor else "")) from None
    return out_gguf
