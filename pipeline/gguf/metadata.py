"""The metadata keys of a GGUF model file, written by one function for every writer.

A model file carries its architecture's hyperparameters (`general.*` and `<arch>.*`) and its
vocabulary (`tokenizer.ggml.*`). `pipeline.sources.convert` (a transformers model or a checkpoint folder)
and `pipeline.sources.synth` (a named real model's shapes) describe a model in these two records,
`ArchKeys` and `Vocabulary`; `metadata_kv` turns either into the typed key/value list a writer
adds. So a key's name, its GGUF type (the one llama.cpp insists on) and its place in the file are
written once: a field's declaration order is the order of the keys in the file, and a field left
None is a key the file does not have (llama.cpp's converter writes a key only where the model's
config has the setting, and reads its default otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from gguf import GGUFValueType
from gguf.constants import GGML_QUANT_VERSION

KV = tuple[str, Any, GGUFValueType | None]  # a key, its value, its GGUF type (an array's item type)

U32, F32, BOOL, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL, GGUFValueType.STRING
INT32 = GGUFValueType.INT32


def _key(name: str, vtype: GGUFValueType, default: Any = None) -> Any:
    """A field written as key `name` (`{arch}` filled in) of GGUF type `vtype`, `default` when not given."""
    return field(default=default, metadata={"key": name, "type": vtype})


def _required(name: str, vtype: GGUFValueType) -> Any:
    """A field every file has, written as key `name` of GGUF type `vtype`."""
    return field(metadata={"key": name, "type": vtype})


@dataclass(frozen=True, kw_only=True)
class ArchKeys:
    """`general.*` and `<arch>.*` keys of a model, in file order (the `general.architecture` key
    is `arch`, which gguf-py's writer adds itself)."""

    arch: str
    name: str = _required("general.name", STR)
    description: str | None = _key("general.description", STR)
    file_type: int = _required("general.file_type", U32)
    quantization_version: int = _key("general.quantization_version", U32, GGML_QUANT_VERSION)
    context_length: int = _required("{arch}.context_length", U32)
    embedding_length: int = _required("{arch}.embedding_length", U32)
    block_count: int = _required("{arch}.block_count", U32)
    feed_forward_length: int = _required("{arch}.feed_forward_length", U32)
    head_count: int = _required("{arch}.attention.head_count", U32)
    head_count_kv: int = _required("{arch}.attention.head_count_kv", U32)
    rope_freq_base: float = _required("{arch}.rope.freq_base", F32)
    rms_eps: float = _required("{arch}.attention.layer_norm_rms_epsilon", F32)
    expert_count: int = _required("{arch}.expert_count", U32)
    expert_used_count: int = _required("{arch}.expert_used_count", U32)
    expert_feed_forward_length: int | None = _key("{arch}.expert_feed_forward_length", U32)
    key_length: int | None = _key("{arch}.attention.key_length", U32)
    value_length: int | None = _key("{arch}.attention.value_length", U32)
    expert_shared_feed_forward_length: int | None = _key("{arch}.expert_shared_feed_forward_length", U32)
    # the gated DeltaNet's shapes and the layer pattern (qwen3next)
    ssm_conv_kernel: int | None = _key("{arch}.ssm.conv_kernel", U32)
    ssm_state_size: int | None = _key("{arch}.ssm.state_size", U32)
    ssm_group_count: int | None = _key("{arch}.ssm.group_count", U32)
    ssm_time_step_rank: int | None = _key("{arch}.ssm.time_step_rank", U32)
    ssm_inner_size: int | None = _key("{arch}.ssm.inner_size", U32)
    recurrent_layers: tuple[bool, ...] | None = _key("{arch}.attention.recurrent_layers", BOOL)
    full_attention_interval: int | None = _key("{arch}.full_attention_interval", U32)
    # grouped routing, dense leading layers and MLA (deepseek2)
    expert_group_count: int | None = _key("{arch}.expert_group_count", U32)
    expert_group_used_count: int | None = _key("{arch}.expert_group_used_count", U32)
    expert_gating_func: int | None = _key("{arch}.expert_gating_func", U32)
    leading_dense_block_count: int | None = _key("{arch}.leading_dense_block_count", U32)
    vocab_size: int | None = _key("{arch}.vocab_size", U32)
    q_lora_rank: int | None = _key("{arch}.attention.q_lora_rank", U32)
    kv_lora_rank: int | None = _key("{arch}.attention.kv_lora_rank", U32)
    key_length_mla: int | None = _key("{arch}.attention.key_length_mla", U32)
    value_length_mla: int | None = _key("{arch}.attention.value_length_mla", U32)
    expert_shared_count: int | None = _key("{arch}.expert_shared_count", U32)
    expert_weights_scale: float | None = _key("{arch}.expert_weights_scale", F32)
    expert_weights_norm: bool | None = _key("{arch}.expert_weights_norm", BOOL)
    rope_scaling_type: str | None = _key("{arch}.rope.scaling.type", STR)
    rope_scaling_factor: float | None = _key("{arch}.rope.scaling.factor", F32)
    rope_scaling_original_context_length: int | None = _key("{arch}.rope.scaling.original_context_length", U32)
    yarn_beta_fast: float | None = _key("{arch}.rope.scaling.yarn_beta_fast", F32)
    yarn_beta_slow: float | None = _key("{arch}.rope.scaling.yarn_beta_slow", F32)
    yarn_log_multiplier: float | None = _key("{arch}.rope.scaling.yarn_log_multiplier", F32)
    rope_dimension_count: int | None = _key("{arch}.rope.dimension_count", U32)


@dataclass(frozen=True, kw_only=True)
class Vocabulary:
    """`tokenizer.ggml.*` keys, in file order: a byte-level BPE (`model` "gpt2", with merges) or a
    SentencePiece BPE (`model` "llama", with scores), as llama.cpp's converter writes them."""

    model: str = _required("tokenizer.ggml.model", STR)
    pre: str = _required("tokenizer.ggml.pre", STR)
    tokens: Sequence[str] = _required("tokenizer.ggml.tokens", STR)
    scores: Sequence[float] | None = _key("tokenizer.ggml.scores", F32)
    token_types: Sequence[int] = _required("tokenizer.ggml.token_type", INT32)  # gguf-py TokenType
    merges: Sequence[str] | None = _key("tokenizer.ggml.merges", STR)
    bos: int | None = _key("tokenizer.ggml.bos_token_id", U32)
    eos: int | None = _key("tokenizer.ggml.eos_token_id", U32)
    padding: int | None = _key("tokenizer.ggml.padding_token_id", U32)
    unknown: int | None = _key("tokenizer.ggml.unknown_token_id", U32)
    add_bos: bool = _required("tokenizer.ggml.add_bos_token", BOOL)
    add_eos: bool | None = _key("tokenizer.ggml.add_eos_token", BOOL)
    add_space_prefix: bool | None = _key("tokenizer.ggml.add_space_prefix", BOOL)


def metadata_kv(record: ArchKeys | Vocabulary) -> list[KV]:
    """The record's keys as (key, value, GGUF type) in field order, None fields left out; a
    sequence is a list whose type is its items' (what `gguf_write.add_kv` takes)."""
    arch = getattr(record, "arch", "")
    kv: list[KV] = []
    for f in fields(record):
        value = getattr(record, f.name)
        if "key" not in f.metadata or value is None:
            continue
        kv.append((f.metadata["key"].format(arch=arch),
                   list(value) if isinstance(value, (list, tuple)) else value, f.metadata["type"]))
    return kv
