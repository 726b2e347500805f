"""Export a transformers Qwen2-MoE / Qwen3-MoE / OLMoE / Mixtral / Qwen3-Next / DeepSeek-V3 model to GGUF,
as llama.cpp's converter does.

Tensor names, shapes and metadata keys follow llama.cpp's `convert_hf_to_gguf.py`
(Qwen2MoeModel / Qwen3MoeModel / OlmoeModel / LlamaModel / Qwen3NextModel / DeepseekV2Model), so that llama.cpp, transformers'
`from_pretrained(..., gguf_file=...)` (for the Qwen families) and `GGUFModel` all load the result.
OLMoE's q/k norms span every head, so `attn_{q,k}_norm` are as wide as q and k; its experts are
`intermediate_size` wide and, as llama.cpp's converter does, no `expert_feed_forward_length` is written.
Mixtral is written as `llama` the way LlamaModel writes it: experts `intermediate_size` wide (the
`feed_forward_length` key), `vocab_size` and `rope.dimension_count` keys, and the rows of the q and k
projections permuted within each head (`permute_rope_rows`) so that llama.cpp's adjacent-pair RoPE
reproduces transformers' rotate_half. A SentencePiece-shaped tokenizer (BPE with byte fallback, as
Mixtral's tokenizer.json) is written as llama.cpp's `llama` vocabulary, others as byte-level BPE.
Per-expert matrices are stacked into `*_exps` tensors `[E, rows, cols]`. Qwen3-Next's state is first
rewritten as its converter does (`_qwen3next_state`: norm +1, A_log -> -exp, qkvz split into qkv and z).
DeepSeek-V3 (`deepseek2`) is written as llama.cpp writes it for its absorbed-MLA graph: `kv_b_proj`
split into `attn_k_b` / `attn_v_b` (no combined `attn_kv_b`), one KV head, the MLA head sizes under
`key_length_mla` / `value_length_mla`, and the router's correction bias as `exp_probs_b.bias`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGML_QUANT_VERSION
from gguf.quants import quantize
from tokenizers import Tokenizer

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf_write import KV, TensorItem, write_gguf

MATRIX_TYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
ARCH_BY_MODEL_TYPE = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama",
                      "qwen3_next": "qwen3next", "deepseek_v3": "deepseek2"}

# HF parameter suffix (after `model.layers.{i}.`) -> llama.cpp tensor short name.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # DeepSeek-V3 (deepseek2): MLA, dense leading layers, the selection bias, ungated shared experts
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Per family, names that differ from LAYER_NAMES or only it has (after `ARCH_STATE` reshaped its state).
ARCH_LAYER_NAMES = {
    "qwen3next": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
        "linear_attn.in_proj_z.weight": "attn_gate.weight",
        "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
        "linear_attn.conv1d.weight": "ssm_conv1d.weight",
        "linear_attn.dt_bias": "ssm_dt.bias",
        "linear_attn.A_log": "ssm_a",
        "linear_attn.ssm_a": "ssm_a",  # -exp(A_log) already (`hf_convert`, which has no torch)
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
    },
    "deepseek2": {"self_attn.k_b_proj.weight": "attn_k_b.weight", "self_attn.v_b_proj.weight": "attn_v_b.weight"},
}
# Tensors llama.cpp keeps in F32 whatever the file type: routing decisions are
# sensitive to them and they are tiny (and ggml's convolution reads F32 kernels).
KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _tensor_type(short_name: str, data: np.ndarray, matrix_type: GGMLQuantizationType) -> GGMLQuantizationType:
    """llama.cpp's rule: 2-D+ weight matrices whose rows split into 32-blocks get the file's type."""
    if data.ndim < 2 or short_name.endswith(KEEP_F32) or data.shape[-1] % 32 != 0:
        return GGMLQuantizationType.F32
    return matrix_type


def _encode(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Float32 weights as stored: floats for F32/F16, block bytes otherwise."""
    if ggml_type == GGMLQuantizationType.F32:
        return data.astype(np.float32)
    if ggml_type == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return quantize(data.astype(np.float32), ggml_type)  # (..., row_bytes) uint8


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q or k projection (n_head * hd, d) reordered within each head so that row i + hd/2
    follows row i: transformers' rotate_half pair (i, i + hd/2) becomes llama.cpp's (2i, 2i + 1)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # (rows, d)


def _qwen3next_state(state: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """Qwen3-Next's parameters as llama.cpp's converter transforms them before naming: zero-centred
    norm weights + 1 (not the gated norm's), A_log -> -exp(A_log), the conv kernel (C, 1, K) -> (C, K),
    and in_proj_qkvz, stored per key head as [q, k, v, z], split into [all q, all k, all v] and z."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    out = {}
    for name, w in state.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1.0
        elif name.endswith(".A_log"):
            import torch  # only here: torch is a test extra; `hf_convert` rewrites A_log itself

            w = -torch.exp(torch.from_numpy(w)).numpy()  # torch's float32 exp, as the converter's, to the bit
        elif name.endswith("linear_attn.conv1d.weight"):
            w = w.squeeze(1)  # (C, K)
        elif name.endswith("linear_attn.in_proj_qkvz.weight"):
            per_head = w.reshape(nk, 2 * dk + 2 * nv // nk * dv, -1)  # (nk, dk + dk + r*dv + r*dv, d)
            q, k, v, z = np.split(per_head, np.cumsum([dk, dk, nv // nk * dv]), axis=1)
            d = w.shape[1]
            stem = name.removesuffix("in_proj_qkvz.weight")
            out[stem + "in_proj_qkv.weight"] = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
            out[stem + "in_proj_z.weight"] = z.reshape(-1, d)  # (nv*dv, d)
            continue
        out[name] = w
    return out


def _qwen3next_check(config) -> None:
    """Refuse Qwen3-Next variants llama.cpp's qwen3next graph cannot run (it always renormalises the
    top-k weights, runs an MoE in every layer, has no attention biases and one RoPE type)."""
    refuse = {
        "norm_topk_prob": not config.norm_topk_prob,
        "mlp_only_layers": bool(config.mlp_only_layers),
        "decoder_sparse_step": config.decoder_sparse_step != 1,
        "attention_bias": bool(config.attention_bias),
        "rope_parameters": (config.rope_parameters or {}).get("rope_type", "default") != "default",
        "linear_num_value_heads": config.linear_num_value_heads % config.linear_num_key_heads != 0,
        "linear_value_head_dim": config.linear_value_head_dim != config.linear_key_head_dim,
    }
    for key, bad in refuse.items():
        if bad:
            raise InputError(f"{getattr(config, 'name_or_path', '') or 'config'}: {key}: "
                             f"{getattr(config, key)!r} is not supported for qwen3next")


def _check_mixtral(config) -> None:
    """Refuse the Mixtral options llama.cpp's llama graph (and our runner) does not run."""
    where = getattr(config, "name_or_path", "") or "config"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise InputError(f"{where}: config rope_parameters.rope_type: {rope['rope_type']!r} is not supported "
                         "(plain RoPE only)")
    if getattr(config, "sliding_window", None) is not None:
        raise InputError(f"{where}: config sliding_window: {config.sliding_window} is not supported "
                         "(llama.cpp's llama graph attends to every earlier position)")


def _llama_state(state: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """Mixtral's parameters with the q and k projection rows permuted as LlamaModel.permute does."""
    out = dict(state)
    for i in range(config.num_hidden_layers):
        for proj, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            out[name] = permute_rope_rows(state[name], heads)  # (heads * hd, d)
    return out


def _split_kv_b(kv_b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b_proj (H*(nope+v), kv_lora) as llama.cpp's converter splits it for the absorbed
    graph: attn_k_b (H, kv_lora, nope), each head's key rows transposed, and attn_v_b (H, v, kv_lora)."""
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    per_head = kv_b.reshape(-1, nope + v, kv_b.shape[-1])  # (H, nope+v, kv_lora)
    return per_head[:, :nope].transpose(0, 2, 1), per_head[:, nope:]  # (H, kv_lora, nope), (H, v, kv_lora)


def _deepseek2_state(state: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """DeepSeek-V3's parameters with every kv_b_proj split into its key and value halves (`_split_kv_b`)."""
    out = {}
    for name, w in state.items():
        if name.endswith("self_attn.kv_b_proj.weight"):
            stem = name.removesuffix("kv_b_proj.weight")
            out[stem + "k_b_proj.weight"], out[stem + "v_b_proj.weight"] = _split_kv_b(w, config)
            continue
        out[name] = w
    return out


# Per family: a check of the config, and the state dict rewritten as llama.cpp's converter rewrites it
# (DeepSeek-V3's config is checked where its keys are written, `_deepseek2_kv`).
ARCH_STATE = {"qwen3next": (_qwen3next_check, _qwen3next_state), "llama": (_check_mixtral, _llama_state),
              "deepseek2": (lambda config: None, _deepseek2_state)}


def _gguf_tensors(state: dict[str, np.ndarray], n_layer: int, tied: bool,
                  layer_names: dict[str, str] = LAYER_NAMES) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) for every parameter, experts stacked; errors on leftovers."""
    used: set[str] = set()
    for hf_name, gguf_name in GLOBAL_NAMES.items():
        if hf_name in state:
            used.add(hf_name)
            if not (tied and gguf_name == "output.weight"):
                yield gguf_name, state[hf_name]
    for i in range(n_layer):
        prefix = f"model.layers.{i}."
        for suffix, short in layer_names.items():
            if prefix + suffix in state:
                used.add(prefix + suffix)
                w = state[prefix + suffix]
                if short == "ffn_gate_inp_shexp.weight":
                    w = w.reshape(-1)  # (1, d) -> (d,)
                yield f"blk.{i}.{short}", w
        fused = prefix + "mlp.experts.gate_up_proj"  # (E, 2f, d): gate rows first, then up rows
        if fused in state:
            used.add(fused)
            f = state[fused].shape[1] // 2
            yield f"blk.{i}.ffn_gate_exps.weight", state[fused][:, :f]  # (E, f, d)
            yield f"blk.{i}.ffn_up_exps.weight", state[fused][:, f:]  # (E, f, d)
    leftover = sorted(set(state) - used)
    if leftover:
        raise ValueError(f"no GGUF name for parameter {leftover[0]} (and {len(leftover) - 1} more)")


def _vocab_kv(tokenizer: Tokenizer, bos: int | None, eos: int | None, pad: int | None,
              pre: str = "qwen2") -> list[KV]:
    """`tokenizer.ggml.*` for a byte-level BPE (llama.cpp's `_set_vocab_gpt2` keys), its words cut
    by the `pipeline.tokenizer.PRE_TOKENIZERS` regexes named `pre`."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    user = {t.content for t in tokenizer.get_added_tokens_decoder().values() if not t.special}
    token_types = [3 if t in special else 4 if t in user else 1 for t in tokens]  # CONTROL / USER_DEFINED / NORMAL
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    kv: list[KV] = [
        ("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING),
        ("tokenizer.ggml.pre", pre, GGUFValueType.STRING),
        ("tokenizer.ggml.tokens", tokens, None),
        ("tokenizer.ggml.token_type", token_types, GGUFValueType.INT32),
        ("tokenizer.ggml.merges", merges, None),
    ]
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("padding_token_id", pad)):
        if value is not None:
            kv.append((f"tokenizer.ggml.{key}", int(value), GGUFValueType.UINT32))
    kv.append(("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL))
    return kv


def is_sentencepiece(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer is SentencePiece-shaped: BPE with byte fallback (Mixtral's tokenizer.json)."""
    model = json.loads(tokenizer.to_str())["model"]
    return model["type"] == "BPE" and bool(model.get("byte_fallback"))


def _sentencepiece_vocab_kv(tokenizer: Tokenizer, bos: int | None, eos: int | None, pad: int | None) -> list[KV]:
    """`tokenizer.ggml.*` for a SentencePiece BPE, as llama.cpp's `_set_vocab_sentencepiece` writes
    them: model "llama", pre "default", token scores and types, no merges.

    SentencePiece's BPE scores a piece by when its merge was learnt (later, lower), and llama.cpp
    merges by those scores: a token made by merge number r scores -r here, the others 0 (single
    characters, bytes and specials are never the result of a merge). Types: UNKNOWN for the unknown
    token, BYTE for <0xXX>, CONTROL for other special tokens, USER_DEFINED for other added tokens.
    """
    spec = json.loads(tokenizer.to_str())["model"]
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    scores = [0.0] * len(tokens)
    for rank, merge in enumerate(spec["merges"]):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        scores[vocab[left + right]] = -float(rank)
    added = tokenizer.get_added_tokens_decoder().values()
    special = {t.content for t in added if t.special}
    user = {t.content for t in added if not t.special}
    unknown = spec.get("unk_token")
    token_types = [2 if t == unknown else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 3 if t in special
                   else 4 if t in user else 1 for t in tokens]  # gguf-py TokenType
    kv: list[KV] = [
        ("tokenizer.ggml.model", "llama", GGUFValueType.STRING),
        ("tokenizer.ggml.pre", "default", GGUFValueType.STRING),
        ("tokenizer.ggml.tokens", tokens, None),
        ("tokenizer.ggml.scores", scores, GGUFValueType.FLOAT32),
        ("tokenizer.ggml.token_type", token_types, GGUFValueType.INT32),
    ]
    special_ids = (("bos_token_id", bos), ("eos_token_id", eos), ("padding_token_id", pad),
                   ("unknown_token_id", vocab.get(unknown) if unknown else None))
    for key, value in special_ids:
        if value is not None:
            kv.append((f"tokenizer.ggml.{key}", int(value), GGUFValueType.UINT32))
    kv += [("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL),
           ("tokenizer.ggml.add_space_prefix", True, GGUFValueType.BOOL)]
    return kv


def _hparams_kv(config, arch: str, file_type: LlamaFileType) -> list[KV]:
    """The `<arch>.*` keys llama.cpp's converter writes for Qwen2-MoE / Qwen3-MoE / OLMoE."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    rope_theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    n_expert = getattr(config, "num_experts", None) or config.num_local_experts
    kv: list[KV] = [
        ("general.name", getattr(config, "name_or_path", "") or arch, GGUFValueType.STRING),
        ("general.file_type", int(file_type), u32),
        ("general.quantization_version", GGML_QUANT_VERSION, u32),
        (f"{arch}.context_length", config.max_position_embeddings, u32),
        (f"{arch}.embedding_length", config.hidden_size, u32),
        (f"{arch}.block_count", config.num_hidden_layers, u32),
        (f"{arch}.feed_forward_length", config.intermediate_size, u32),
        (f"{arch}.attention.head_count", config.num_attention_heads, u32),
        (f"{arch}.attention.head_count_kv", config.num_key_value_heads, u32),
        (f"{arch}.rope.freq_base", float(rope_theta), f32),
        (f"{arch}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps), f32),
        (f"{arch}.expert_count", n_expert, u32),
        (f"{arch}.expert_used_count", config.num_experts_per_tok, u32),
    ]
    if getattr(config, "moe_intermediate_size", None):
        kv.append((f"{arch}.expert_feed_forward_length", config.moe_intermediate_size, u32))
    if getattr(config, "head_dim", None):
        kv += [(f"{arch}.attention.key_length", config.head_dim, u32),
               (f"{arch}.attention.value_length", config.head_dim, u32)]
    if getattr(config, "shared_expert_intermediate_size", None):
        kv.append((f"{arch}.expert_shared_feed_forward_length", config.shared_expert_intermediate_size, u32))
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        rope_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv += [(f"{arch}.vocab_size", config.vocab_size, u32), (f"{arch}.rope.dimension_count", rope_dim, u32)]
    if arch == "qwen3next":  # Qwen3NextModel's keys: the gated DeltaNet's shapes and the layer pattern
        kv += [(f"{arch}.ssm.conv_kernel", config.linear_conv_kernel_dim, u32),
               (f"{arch}.ssm.state_size", config.linear_key_head_dim, u32),
               (f"{arch}.ssm.group_count", config.linear_num_key_heads, u32),
               (f"{arch}.ssm.time_step_rank", config.linear_num_value_heads, u32),
               (f"{arch}.ssm.inner_size", config.linear_value_head_dim * config.linear_num_value_heads, u32),
               (f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in config.layer_types],
                GGUFValueType.BOOL),
               (f"{arch}.full_attention_interval", getattr(config, "full_attention_interval", 4), u32),
               (f"{arch}.rope.dimension_count",
                int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 0.25)), u32)]
    return kv


def _deepseek2_kv(config) -> list[KV]:
    """The keys llama.cpp's DeepseekV2Model converter writes beyond the common ones: MLA as MQA with one
    KV head (key = latent + rope key, value = latent) and the decompressed head sizes, leading dense
    layers, the routing's groups, gating, scale and norm. Refuses what our runner does not model."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    a = "deepseek2"
    rope = dict(getattr(config, "rope_parameters", None) or {})
    yarn = rope.get("rope_type", "default") == "yarn"
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise ValueError(f"rope scaling {rope['rope_type']!r} is not supported for {a} (only yarn)")
    if yarn and (rope.get("truncate", True) is not True or rope.get("attention_factor") is not None
                 or (rope.get("beta_fast", 32), rope.get("beta_slow", 1)) != (32, 1)
                 or not rope.get("mscale_all_dim") or rope.get("mscale", rope["mscale_all_dim"]) != rope["mscale_all_dim"]):
        raise ValueError(f"yarn {rope}: for {a} only mscale = mscale_all_dim, beta_fast 32, beta_slow 1 and "
                         "a truncated correction band are supported (llama.cpp computes the others differently "
                         "from transformers)")
    if not config.rope_interleave:
        raise ValueError(f"rope_interleave=False is not supported for {a}: llama.cpp rotates interleaved pairs "
                         "and its converter permutes no weights")
    if config.attention_bias:
        raise ValueError(f"attention_bias=True is not supported for {a}: llama.cpp loads no attention biases")
    kv_lora, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
    kv: list[KV] = [
        (f"{a}.attention.head_count_kv", 1, u32),
        (f"{a}.expert_group_count", config.n_group, u32),
        (f"{a}.expert_group_used_count", config.topk_group, u32),
        (f"{a}.expert_gating_func", 2, u32),  # sigmoid: DeepSeek-V3's scoring_func
        (f"{a}.leading_dense_block_count", config.first_k_dense_replace, u32),
        (f"{a}.vocab_size", config.vocab_size, u32),
    ]
    if config.q_lora_rank is not None:
        kv.append((f"{a}.attention.q_lora_rank", config.q_lora_rank, u32))
    kv += [
        (f"{a}.attention.kv_lora_rank", kv_lora, u32),
        (f"{a}.attention.key_length", kv_lora + rope_dim, u32),
        (f"{a}.attention.value_length", kv_lora, u32),
        (f"{a}.attention.key_length_mla", config.qk_nope_head_dim + rope_dim, u32),
        (f"{a}.attention.value_length_mla", config.v_head_dim, u32),
        (f"{a}.expert_feed_forward_length", config.moe_intermediate_size, u32),
        (f"{a}.expert_shared_count", config.n_shared_experts, u32),
        (f"{a}.expert_weights_scale", float(config.routed_scaling_factor), f32),
    ]
    if config.norm_topk_prob:
        kv.append((f"{a}.expert_weights_norm", True, GGUFValueType.BOOL))
    if yarn:  # the common rope-scaling keys, then DeepSeek's log multiplier with the converter's 0.1 factor
        kv += [(f"{a}.rope.scaling.type", "yarn", GGUFValueType.STRING),
               (f"{a}.rope.scaling.factor", float(rope["factor"]), f32),
               (f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"], u32)]
        kv += [(f"{a}.rope.scaling.yarn_{beta}", float(rope[beta]), f32) for beta in ("beta_fast", "beta_slow")
               if beta in rope]
        kv.append((f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"], f32))
    return kv + [(f"{a}.rope.dimension_count", rope_dim, u32)]


def _special_id(tokenizer: Tokenizer, config_id: int | None, fallback: str) -> int | None:
    return config_id if config_id is not None else tokenizer.token_to_id(fallback)


def hf_to_gguf(hf_model, tokenizer: Tokenizer, out_path: str | os.PathLike[str], matrix_type: str = "q8_0",
               extra_kv: list[KV] | None = None) -> None:
    """Write `hf_model` (Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / OlmoeForCausalLM /
    MixtralForCausalLM / Qwen3NextForCausalLM / DeepseekV3ForCausalLM) and its tokenizer as one GGUF
    (`state_to_gguf` on its state dict in float32)."""
    state = {k: v.detach().to("cpu").float().numpy() for k, v in hf_model.state_dict().items()}
    state_to_gguf(state, hf_model.config, tokenizer, out_path, matrix_type, extra_kv)


def state_to_gguf(state: dict[str, np.ndarray], config, tokenizer: Tokenizer, out_path: str | os.PathLike[str],
                  matrix_type: str = "q8_0", extra_kv: list[KV] | None = None, pre: str = "qwen2") -> None:
    """Write a float32 state dict in transformers' names (experts fused, as its modules hold them)
    with `config` (anything with the config's attributes) and its tokenizer as one GGUF.

    Matrices go to `matrix_type` ("q8_0", "f16" or "f32"); norms, biases, the
    router and the shared-expert gate stay F32. BOS/EOS/PAD ids come from the
    config, else (byte-level BPE) `<|endoftext|>`; no BOS is added at encode time
    (Qwen's way, and the pipeline's: it encodes without one for every family).
    A byte-level BPE's words are cut by the `pre` regexes.
    """
    arch = ARCH_BY_MODEL_TYPE.get(config.model_type)
    if arch is None:
        raise ValueError(f"unsupported model type {config.model_type!r} (supported: {sorted(ARCH_BY_MODEL_TYPE)})")
    ggml_matrix, file_type = MATRIX_TYPES[matrix_type]
    if arch in ARCH_STATE:
        check, rewrite = ARCH_STATE[arch]
        check(config)
        state = rewrite(state, config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    eos = _special_id(tokenizer, config.eos_token_id, "<|endoftext|>")
    kv = _hparams_kv(config, arch, file_type)
    if arch == "deepseek2":  # its keys overwrite the common ones in place, as gguf-py's writer does
        family = {item[0]: item for item in _deepseek2_kv(config)}
        kv = [family.pop(item[0], item) for item in kv] + list(family.values())
    if is_sentencepiece(tokenizer):  # its specials are <s>, </s>: ids only from the config
        kv += _sentencepiece_vocab_kv(tokenizer, config.bos_token_id, config.eos_token_id, config.pad_token_id)
    else:
        kv += _vocab_kv(tokenizer,
                        bos=_special_id(tokenizer, config.bos_token_id, "<|endoftext|>"),
                        eos=eos,
                        pad=_special_id(tokenizer, config.pad_token_id, "<|endoftext|>"), pre=pre)
    kv += list(extra_kv or [])

    def tensors() -> Iterator[TensorItem]:
        for name, data in _gguf_tensors(state, config.num_hidden_layers, tied,
                                        {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}):
            ggml_type = _tensor_type(name, data, ggml_matrix)
            yield name, _encode(data, ggml_type), ggml_type

    write_gguf(out_path, arch, kv, tensors())
