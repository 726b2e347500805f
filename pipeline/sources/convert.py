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
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from tokenizers import Tokenizer

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.metadata import KV, ArchKeys, Vocabulary, metadata_kv
from moeheal.pipeline.gguf.writer import MATRIX_TYPES, TensorItem, encode, write_gguf

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
# (DeepSeek-V3's config is checked where its keys are set, `_deepseek2_keys`).
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


def id_ordered_tokens(tokenizer: Tokenizer) -> list[str]:
    """The tokenizer's tokens (added ones included) in id order, the list a GGUF vocabulary holds."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    return tokens


def merge_strings(tokenizer: Tokenizer) -> list[str]:
    """The BPE's merges as GGUF holds them, "left right" (tokenizer.json has strings or pairs)."""
    merges = json.loads(tokenizer.to_str())["model"].get("merges", [])
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _int_or_none(value: int | None) -> int | None:
    """A token id from a config (an int, or None for none) as a plain int."""
    return None if value is None else int(value)


def _byte_level_vocabulary(tokenizer: Tokenizer, bos: int | None, eos: int | None, pad: int | None,
                           pre: str = "qwen2") -> Vocabulary:
    """A byte-level BPE as llama.cpp's `_set_vocab_gpt2` writes it, its words cut by the
    `pipeline.gguf.tokenizer.PRE_TOKENIZERS` regexes named `pre`; no BOS added at encode time."""
    tokens = id_ordered_tokens(tokenizer)
    added = tokenizer.get_added_tokens_decoder().values()
    special = {t.content for t in added if t.special}
    user = {t.content for t in added if not t.special}
    token_types = [3 if t in special else 4 if t in user else 1 for t in tokens]  # CONTROL / USER_DEFINED / NORMAL
    return Vocabulary(model="gpt2", pre=pre, tokens=tokens, token_types=token_types, merges=merge_strings(tokenizer),
                      bos=_int_or_none(bos), eos=_int_or_none(eos), padding=_int_or_none(pad), add_bos=False)


def is_sentencepiece(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer is SentencePiece-shaped: BPE with byte fallback (Mixtral's tokenizer.json)."""
    model = json.loads(tokenizer.to_str())["model"]
    return model["type"] == "BPE" and bool(model.get("byte_fallback"))


def _sentencepiece_vocabulary(tokenizer: Tokenizer, bos: int | None, eos: int | None, pad: int | None) -> Vocabulary:
    """A SentencePiece BPE as llama.cpp's `_set_vocab_sentencepiece` writes it: model "llama", pre
    "default", token scores and types, no merges, a space prefix, no BOS added at encode time.

    SentencePiece's BPE scores a piece by when its merge was learnt (later, lower), and llama.cpp
    merges by those scores: a token made by merge number r scores -r here, the others 0 (single
    characters, bytes and specials are never the result of a merge). Types: UNKNOWN for the unknown
    token, BYTE for <0xXX>, CONTROL for other special tokens, USER_DEFINED for other added tokens.
    """
    spec = json.loads(tokenizer.to_str())["model"]
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = id_ordered_tokens(tokenizer)
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
    return Vocabulary(model="llama", pre="default", tokens=tokens, scores=scores, token_types=token_types,
                      bos=_int_or_none(bos), eos=_int_or_none(eos), padding=_int_or_none(pad),
                      unknown=vocab.get(unknown) if unknown else None, add_bos=False, add_space_prefix=True)


def _arch_keys(config, arch: str, file_type: LlamaFileType) -> ArchKeys:
    """The `general.*` and `<arch>.*` keys llama.cpp's converter writes for the config's family:
    the ones every family has, a key of an optional setting only where the config has it."""
    rope_theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or None
    keys = dict(
        name=getattr(config, "name_or_path", "") or arch, file_type=int(file_type),
        context_length=config.max_position_embeddings, embedding_length=config.hidden_size,
        block_count=config.num_hidden_layers, feed_forward_length=config.intermediate_size,
        head_count=config.num_attention_heads, head_count_kv=config.num_key_value_heads,
        rope_freq_base=float(rope_theta), rms_eps=float(config.rms_norm_eps),
        expert_count=getattr(config, "num_experts", None) or config.num_local_experts,
        expert_used_count=config.num_experts_per_tok,
        expert_feed_forward_length=getattr(config, "moe_intermediate_size", None) or None,
        key_length=head_dim, value_length=head_dim,
        expert_shared_feed_forward_length=getattr(config, "shared_expert_intermediate_size", None) or None,
    )
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        keys.update(vocab_size=config.vocab_size,
                    rope_dimension_count=head_dim or config.hidden_size // config.num_attention_heads)
    if arch == "qwen3next":  # Qwen3NextModel's keys: the gated DeltaNet's shapes and the layer pattern
        keys.update(ssm_conv_kernel=config.linear_conv_kernel_dim, ssm_state_size=config.linear_key_head_dim,
                    ssm_group_count=config.linear_num_key_heads, ssm_time_step_rank=config.linear_num_value_heads,
                    ssm_inner_size=config.linear_value_head_dim * config.linear_num_value_heads,
                    recurrent_layers=tuple(t == "linear_attention" for t in config.layer_types),
                    full_attention_interval=getattr(config, "full_attention_interval", 4),
                    rope_dimension_count=int(config.head_dim
                                             * config.rope_parameters.get("partial_rotary_factor", 0.25)))
    if arch == "deepseek2":
        keys.update(_deepseek2_keys(config))
    return ArchKeys(arch=arch, **keys)


def _deepseek2_keys(config) -> dict[str, Any]:
    """The `ArchKeys` llama.cpp's DeepseekV2Model converter sets beyond (or instead of) the common ones:
    MLA as MQA with one KV head (key = latent + rope key, value = latent) and the decompressed head
    sizes, leading dense layers, the routing's groups, gating, scale and norm. Refuses what our
    runner does not model."""
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
    keys = dict(
        head_count_kv=1, expert_group_count=config.n_group, expert_group_used_count=config.topk_group,
        expert_gating_func=2,  # sigmoid: DeepSeek-V3's scoring_func
        leading_dense_block_count=config.first_k_dense_replace, vocab_size=config.vocab_size,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=kv_lora, key_length=kv_lora + rope_dim, value_length=kv_lora,
        key_length_mla=config.qk_nope_head_dim + rope_dim, value_length_mla=config.v_head_dim,
        expert_feed_forward_length=config.moe_intermediate_size, expert_shared_count=config.n_shared_experts,
        expert_weights_scale=float(config.routed_scaling_factor),
        expert_weights_norm=True if config.norm_topk_prob else None, rope_dimension_count=rope_dim,
    )
    if yarn:  # the common rope-scaling keys, then DeepSeek's log multiplier with the converter's 0.1 factor
        keys.update(rope_scaling_type="yarn", rope_scaling_factor=float(rope["factor"]),
                    rope_scaling_original_context_length=rope["original_max_position_embeddings"],
                    yarn_beta_fast=float(rope["beta_fast"]) if "beta_fast" in rope else None,
                    yarn_beta_slow=float(rope["beta_slow"]) if "beta_slow" in rope else None,
                    yarn_log_multiplier=0.1 * rope["mscale_all_dim"])
    return keys


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

    Matrices go to `matrix_type` (a `MATRIX_TYPES` name: "q8_0", "f16", "bf16" or "f32"); norms, biases, the
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
    keys = _arch_keys(config, arch, file_type)
    if is_sentencepiece(tokenizer):  # its specials are <s>, </s>: ids only from the config
        vocabulary = _sentencepiece_vocabulary(tokenizer, config.bos_token_id, config.eos_token_id,
                                               config.pad_token_id)
    else:
        vocabulary = _byte_level_vocabulary(tokenizer,
                                            bos=_special_id(tokenizer, config.bos_token_id, "<|endoftext|>"),
                                            eos=_special_id(tokenizer, config.eos_token_id, "<|endoftext|>"),
                                            pad=_special_id(tokenizer, config.pad_token_id, "<|endoftext|>"), pre=pre)
    kv = metadata_kv(keys) + metadata_kv(vocabulary) + list(extra_kv or [])

    def tensors() -> Iterator[TensorItem]:
        for name, data in _gguf_tensors(state, config.num_hidden_layers, tied,
                                        {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}):
            ggml_type = _tensor_type(name, data, ggml_matrix)
            yield name, encode(data, ggml_type), ggml_type

    write_gguf(out_path, arch, kv, tensors())
