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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES, GGML_QUANT_VERSION

KV = tuple[str, Any, GGUFValueType | None]  # a key, its value, its GGUF type (an array's item type)

U32, F32, BOOL, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL, GGUFValueType.STRING
INT32 = GGUFValueType.INT32

FILE_TYPE_KEY = "general.file_type"

# The file type (llama.cpp's `llama_ftype`) that llama-quantize is given to store a model's
# weights in a ggml type: `llama_ftype_get_default_type` (llama.cpp, src/llama-quant.cpp) read
# backwards. Where several file types store one type (Q3_K_S/_M/_L, Q2_K/Q2_K_S, IQ2_XS/IQ2_S,
# IQ3_XS/IQ3_S/IQ3_M), the one llama.cpp's loader names for a file of that type without the key
# (`llama_model_loader`): Q2_K, the _M k-quants, IQ2_XS, IQ3_S. IQ2_S is the default type of
# IQ2_M alone (llama-quantize's IQ2_S stores IQ2_XS), so a file of IQ2_S weights is an IQ2_M.
FILE_TYPE_OF: dict[GGMLQuantizationType, LlamaFileType] = {
    GGMLQuantizationType[ggml_type]: LlamaFileType[file_type] for ggml_type, file_type in (
        ("F32", "ALL_F32"), ("F16", "MOSTLY_F16"), ("BF16", "MOSTLY_BF16"), ("Q4_0", "MOSTLY_Q4_0"),
        ("Q4_1", "MOSTLY_Q4_1"), ("Q5_0", "MOSTLY_Q5_0"), ("Q5_1", "MOSTLY_Q5_1"), ("Q8_0", "MOSTLY_Q8_0"),
        ("Q1_0", "MOSTLY_Q1_0"), ("MXFP4", "MOSTLY_MXFP4_MOE"), ("Q2_K", "MOSTLY_Q2_K"), ("Q3_K", "MOSTLY_Q3_K_M"),
        ("Q4_K", "MOSTLY_Q4_K_M"), ("Q5_K", "MOSTLY_Q5_K_M"), ("Q6_K", "MOSTLY_Q6_K"), ("TQ1_0", "MOSTLY_TQ1_0"),
        ("TQ2_0", "MOSTLY_TQ2_0"), ("IQ1_S", "MOSTLY_IQ1_S"), ("IQ1_M", "MOSTLY_IQ1_M"),
        ("IQ2_XXS", "MOSTLY_IQ2_XXS"), ("IQ2_XS", "MOSTLY_IQ2_XS"), ("IQ2_S", "MOSTLY_IQ2_M"),
        ("IQ3_XXS", "MOSTLY_IQ3_XXS"), ("IQ3_S", "MOSTLY_IQ3_S"), ("IQ4_NL", "MOSTLY_IQ4_NL"),
        ("IQ4_XS", "MOSTLY_IQ4_XS"))
}


def _bits_per_weight(ggml_type: GGMLQuantizationType) -> float:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return 8 * type_size / block_size


def experts_file_type(weights: Mapping[GGMLQuantizationType, int]) -> LlamaFileType | None:
    """The `general.file_type` of a file whose routed experts hold `weights[t]` weights of ggml type
    t: the file type of the type holding the most of them; None when there are no experts or that
    type has no file type.

    Tools show a file's type as this key, and users read it as the type of the experts, which are
    nearly all of an MoE model's weights. llama-quantize writes the file type it was given, the one
    whose type the bulk of the weights takes (`FILE_TYPE_OF`; its mix puts a few other tensors in
    other types, a Q2_K file's output matrix in Q6_K). A budget's mix of formats was given no single
    file type: the type holding the most routed-expert weights sets most of the file's size and
    error, so it is the one the file is named by. A tie goes to the type of fewer bits per weight,
    so that a file never claims more precision than half its experts have.
    """
    if not weights:
        return None
    bulk = max(weights, key=lambda t: (weights[t], -_bits_per_weight(t)))
    return FILE_TYPE_OF.get(bulk)


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
    file_type: int = _required(FILE_TYPE_KEY, U32)
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
