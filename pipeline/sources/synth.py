"""`moeheal synth`: GGUF models with a real model's shapes and random weights, no download.

Healing, dumping and llama.cpp's tools behave differently at real scale (a
routed tensor of 128 x 768 x 2048 weights, a 151936-token vocabulary, split
files), and the real checkpoints are hundreds of GB. `synth` writes a file with
the tensor names, shapes, ggml types and metadata of a named model, so that
every size-dependent path can be exercised offline:

- `qwen3-30b-a3b`, `qwen3-235b`: `qwen3moe` exactly as llama.cpp's converter
  writes Qwen3-30B-A3B / Qwen3-235B-A22B (q/k norms, no shared expert).
- `qwen3-next-80b`: `qwen3next` as llama.cpp's converter writes Qwen3-Next-80B-A3B:
  48 layers, every fourth gated full attention (16 query / 2 key-value heads of
  dim 256, RoPE on 64 of them), the others gated DeltaNet (16 key / 32 value
  heads of dim 128, a 4-tap convolution), 512 experts top-10 of width 512 and a
  shared expert of width 512 behind a sigmoid gate. Its linear-attention
  matrices borrow the fit of the attention matrix they stand in for
  (`BORROWED_ROLES`), `ssm_a` is -A with A uniform in [0.01, 16] (transformers'
  initialisation) and `ssm_dt.bias` is zero. `--layers` must keep a
  full-attention layer (at least 4).
- `mixtral-8x7b`: `llama` with experts exactly as llama.cpp's converter writes
  Mixtral-8x7B (no shared expert, no q/k norms or biases; experts sized by
  `feed_forward_length`, `vocab_size` and `rope.dimension_count` keys). Its q/k
  rows are random, so the converter's RoPE row permutation has nothing to act on.
- `deepseek-v3`: `deepseek2` as llama.cpp's converter writes DeepSeek-V3 (MLA with
  the q LoRA, split k_b / v_b, YaRN rope scaling of factor 40 over 4096 tokens,
  3 dense leading layers, 256 experts in 8 groups, top-8 from 4 groups, an
  ungated shared expert). A synth of fewer layers keeps at least one MoE
  layer (dense leading layers = min(3, layers - 1)); with `--experts` too few
  for groups of two, one group. The MLA, dense FFN and bias roles draw from the
  demo fit of the role they stand in for (`BORROWED_ROLES`); the bias is zero.

Weights are random but shaped like trained ones. Each matrix is drawn from a
Student-t distribution whose degrees of freedom and scale come from the role it
plays (`ROLE_FITS`, fitted to the bundled trained demo model
`demo/model/demo-q8_0.gguf` by `fit_roles`: degrees of freedom by the method of
moments on excess kurtosis, nu = 4 + 6 / kurtosis, Gaussian when the kurtosis is
not positive; scale from the standard deviation). The table is a committed
constant, so `synth` needs no demo file at run time; `tests/test_synth.py`
refits it from the demo model and checks the constant. A role's standard
deviation is rescaled by sqrt(demo fan-in / fan-in), as trained matrices' are
(the token embedding, a lookup table, is not). Norm weights are 1 + N(0, 0.1^2),
near 1 as trained models have them. The demo model is small and nearly Gaussian,
and so are these weights: `bench/experiments/synth_tails.py` measures kurtosis 2.98 to 4.00
(a Gaussian's is 3) in every role but the shared expert's down projection and
gate, in the demo and in synth's files alike. They give a real model's shapes
and per-role spread, not a large trained model's heavy tails.

Deterministic: a tensor is cut into fixed row chunks (`CHUNK_WEIGHTS` weights),
and chunk k is drawn from the generator seeded by (seed, SHA-256 of the tensor
name, k), so any tensor can be regenerated alone (`tensor_values`).

Streaming: tensor infos are written first, then each tensor chunk by chunk
(drawn, quantized, written), so host memory holds one chunk and never a whole
tensor. Measured with `/usr/bin/time -v` on `--like qwen3-30b-a3b --layers 2`
(q8_0, 27 tensors, 1.99 GB of tensor data): peak RSS 134 MB (43 MB of it is the
interpreter and the imports), 61 s on a shared 2-core machine, i.e. about
30 s per GB written. `--jobs N` has N worker processes draw and encode the
chunks (spawned, in order; the bytes are the same), for real sizes on a
many-core host.

Vocabulary: the real Qwen tokenizer is not available offline, so the file
carries a valid byte-level BPE of the real size: the demo model's tokens and
merges (all 256 byte tokens included), unique filler tokens up to id 151643,
Qwen's `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at their real ids
151643-151645, and `[PAD<id>]` tokens after them as llama.cpp's converter writes
a padded vocabulary. The demo model's vocabulary ships as package data
(`moeheal/data/demo_vocab.json.gz`, written from the demo model by
`demo/corpus/bundle.py`), so `synth` runs from an installed wheel;
`write_synth(demo_model=...)` names another copy (that file, or a GGUF).
Mixtral's real tokenizer is a 32000-piece SentencePiece BPE, not available
offline either; its file carries a valid SentencePiece vocabulary
(`tokenizer.ggml.model = "llama"`) laid out as Mixtral's: `<unk>`, `<s>`, `</s>`
at ids 0-2, the byte pieces `<0x00>`..`<0xFF>` at 3-258, then the demo's
ordinary tokens spelled as text with "▁" for spaces, and `▁fill<i>` fillers up
to the size; a piece's score falls with its id (the merge order SentencePiece
gives), BOS is added as Mixtral's file says, but the pipeline encodes without it.

Options for tests only (hidden from --help): `--vocab N` and `--experts N`
shrink the vocabulary and the expert count, and `--zeros` writes zero weights
as a sparse file (real shapes and metadata, nothing drawn), so tests stay small
and fast.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from multiprocessing.pool import Pool
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from moeheal.pipeline.model.arch import ARCHITECTURES
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.metadata import KV, ArchKeys, Vocabulary, metadata_kv
from moeheal.pipeline.gguf.model import HParams
from moeheal.pipeline.gguf.writer import MATRIX_TYPES, add_kv, encode
from moeheal.pipeline.sources.package_data import DATA
from moeheal.pipeline.progress import progress

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import GGUFModel

DEMO_MODEL = Path(__file__).resolve().parents[2] / "demo" / "model" / "demo-q8_0.gguf"  # in a checkout only
# The demo model's tokenizer.ggml.{tokens, token_type, merges}: package data, all synth reads of the demo model.
DEMO_VOCAB = DATA / "demo_vocab.json.gz"
CHUNK_WEIGHTS = 1 << 22  # weights drawn at once: 16 MB of float32, the unit of memory and of seeding
NORM_STD = 0.1


@dataclass(frozen=True)
class LikeModel:
    """A real model as its GGUF describes it: the runner's hyper-parameters plus what only the
    file carries (llama.cpp converter's keys)."""

    title: str  # general.name
    arch: str
    hp: HParams
    d_ff: int  # the dense FFN width of the config (feed_forward_length), unused by MoE layers
    description: str


# What the weights are (bench/experiments/synth_tails.py measures them), in every file's general.description.
_WEIGHTS = ("random weights with each role's spread and kurtosis from the small demo model (nearly Gaussian "
            "routed experts)")
_MADE = "made by moeheal synth, not a trained model"
_QWEN3_NOTE = f"{_WEIGHTS} and a filler vocabulary; {_MADE}"
LIKE: dict[str, LikeModel] = {
    "qwen3-30b-a3b": LikeModel(
        title="Qwen3-30B-A3B shapes (synthetic)", arch="qwen3moe", d_ff=6144,
        hp=HParams(n_layer=48, d_model=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8,
                   d_expert=768, d_shexp=0, rope_theta=1e6, rms_eps=1e-6, vocab_size=151936,
                   norm_topk_prob=True, context_length=40960),
        description=f"Qwen3-30B-A3B's tensor shapes and metadata; {_QWEN3_NOTE}"),
    "qwen3-235b": LikeModel(
        title="Qwen3-235B-A22B shapes (synthetic)", arch="qwen3moe", d_ff=12288,
        hp=HParams(n_layer=94, d_model=4096, n_head=64, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8,
                   d_expert=1536, d_shexp=0, rope_theta=1e6, rms_eps=1e-6, vocab_size=151936,
                   norm_topk_prob=True, context_length=40960),
        description=f"Qwen3-235B-A22B's tensor shapes and metadata; {_QWEN3_NOTE}"),
    "qwen3-next-80b": LikeModel(
        title="Qwen3-Next-80B-A3B shapes (synthetic)", arch="qwen3next", d_ff=5120,
        hp=HParams(n_layer=48, d_model=2048, n_head=16, n_head_kv=2, head_dim=256, n_expert=512, n_expert_used=10,
                   d_expert=512, d_shexp=512, rope_theta=1e7, rms_eps=1e-6, vocab_size=151936,
                   norm_topk_prob=True, context_length=262144, rope_dim=64,
                   recurrent_layers=tuple((i + 1) % 4 != 0 for i in range(48)), ssm_conv_kernel=4,
                   ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32, ssm_inner_size=4096),
        description=f"Qwen3-Next-80B-A3B's tensor shapes and metadata; {_QWEN3_NOTE}"),
    "mixtral-8x7b": LikeModel(
        title="Mixtral-8x7B shapes (synthetic)", arch="llama", d_ff=14336,
        hp=HParams(n_layer=32, d_model=4096, n_head=32, n_head_kv=8, head_dim=128, n_expert=8, n_expert_used=2,
                   d_expert=14336, d_shexp=0, rope_theta=1e6, rms_eps=1e-5, vocab_size=32000,
                   norm_topk_prob=True, context_length=32768),
        description=f"Mixtral-8x7B's tensor shapes and metadata; {_WEIGHTS} and a filler SentencePiece "
                    f"vocabulary; {_MADE}"),
    "deepseek-v3": LikeModel(
        title="DeepSeek-V3 shapes (synthetic)", arch="deepseek2", d_ff=18432,
        hp=HParams(n_layer=61, d_model=7168, n_head=128, n_head_kv=1, head_dim=192, n_expert=256, n_expert_used=8,
                   d_expert=2048, d_shexp=2048, rope_theta=10000.0, rms_eps=1e-6, vocab_size=129280,
                   norm_topk_prob=True, context_length=163840, n_dense_lead=3, d_ff=18432, q_lora_rank=1536,
                   kv_lora_rank=512, rope_dim=64, v_head_dim=128, n_group=8, n_group_used=4,
                   expert_weights_scale=2.5, rope_scaling_factor=40.0, rope_orig_ctx=4096, yarn_log_mul=1.0),
        description="DeepSeek-V3's tensor shapes and metadata (MLA with the q LoRA, YaRN rope scaling of factor "
                    "40, 3 dense leading layers, 256 experts in 8 groups, top-8 from 4 groups, one ungated "
                    f"shared expert); {_WEIGHTS} and a Qwen-style filler vocabulary of DeepSeek-V3's size; {_MADE}"),
}


@dataclass(frozen=True)
class TailFit:
    """A role's weight distribution in the demo model: Student-t with `df` degrees of freedom."""

    df: float  # math.inf: Gaussian (the demo's excess kurtosis was not positive)
    std: float  # standard deviation of the demo's weights of this role
    fan_in: int  # the demo's row length for this role

    @property
    def excess_kurtosis(self) -> float:
        return 6.0 / (self.df - 4.0) if math.isfinite(self.df) else 0.0


# fit_roles(GGUFModel("demo/model/demo-q8_0.gguf")), rounded to 4 significant digits.
ROLE_FITS: dict[str, TailFit] = {
    "token_embd": TailFit(df=56.74, std=0.1574, fan_in=256),
    "output": TailFit(df=26.69, std=0.0897, fan_in=256),
    "attn_q": TailFit(df=12.8, std=0.0961, fan_in=256),
    "attn_k": TailFit(df=10.02, std=0.09533, fan_in=256),
    "attn_v": TailFit(df=27.53, std=0.06251, fan_in=256),
    "attn_output": TailFit(df=13.09, std=0.0684, fan_in=256),
    "ffn_gate_inp": TailFit(df=math.inf, std=0.08227, fan_in=256),
    "ffn_gate_exps": TailFit(df=146.9, std=0.089, fan_in=256),
    "ffn_up_exps": TailFit(df=118.3, std=0.09128, fan_in=256),
    "ffn_down_exps": TailFit(df=26.91, std=0.08989, fan_in=256),
    "ffn_gate_inp_shexp": TailFit(df=4.428, std=0.0541, fan_in=256),
    "ffn_gate_shexp": TailFit(df=176.2, std=0.07302, fan_in=256),
    "ffn_up_shexp": TailFit(df=55.62, std=0.07655, fan_in=256),
    "ffn_down_shexp": TailFit(df=4.928, std=0.07746, fan_in=256),
}
NORM_ROLE, ZERO_ROLE, DECAY_ROLE = "norm", "zero", "ssm_a"
# Roles the demo model (full attention, every layer MoE) has no fit for, drawn with the fit of the
# matrix they stand in for: the linear attention's fused q/k/v, its output gate, its beta/alpha, its
# output, and the convolution kernel (its std rescaled to the 4-tap fan-in, as any role's); MLA's
# projections; a dense layer's FFN.
BORROWED_ROLES = {"attn_qkv": "attn_q", "attn_gate": "attn_v", "ssm_ba": "attn_k", "ssm_out": "attn_output",
                  "ssm_conv1d": "attn_v",  # Qwen3-Next's linear attention
                  "attn_q_a": "attn_q", "attn_q_b": "attn_q", "attn_kv_a_mqa": "attn_k", "attn_k_b": "attn_k",
                  "attn_v_b": "attn_v", "ffn_gate": "ffn_gate_shexp", "ffn_up": "ffn_up_shexp",
                  "ffn_down": "ffn_down_shexp"}  # DeepSeek-V3's MLA and dense FFNs


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, logical shape (NumPy order), stored type, how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    role: str  # a ROLE_FITS key, NORM_ROLE or ZERO_ROLE

    @property
    def n_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block_size * type_size


@dataclass(frozen=True)
class SynthResult:
    paths: list[Path]  # the shards, in order (one path when not split)
    n_tensors: int
    n_bytes: int  # tensor data bytes
    seconds: float


# ---- the fit ----------------------------------------------------------------


def role_of(name: str) -> str:
    """How a tensor's values are drawn, from its name (`blk.3.ffn_up_exps.weight` -> `ffn_up_exps`)."""
    short = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if short.endswith("norm.weight"):
        return NORM_ROLE
    if short.endswith(".bias"):
        return ZERO_ROLE
    return short.removesuffix(".weight")


def fit_student_t(values: np.ndarray, fan_in: int) -> TailFit:
    """Method of moments: excess kurtosis k of a Student-t is 6 / (nu - 4), so nu = 4 + 6 / k."""
    x = values.astype(np.float64).ravel()
    centred = x - x.mean()
    var = float(np.mean(centred**2))
    kurtosis = float(np.mean(centred**4)) / var**2 - 3.0
    df = 4.0 + 6.0 / kurtosis if kurtosis > 0 else math.inf
    return TailFit(df=df, std=math.sqrt(var), fan_in=fan_in)


def fit_roles(model: GGUFModel) -> dict[str, TailFit]:
    """A `TailFit` per weight role, pooled over the layers of a trained model (how ROLE_FITS was made)."""
    pooled: dict[str, list[np.ndarray]] = {}
    fan_in: dict[str, int] = {}
    for name in model.tensor_names:
        role = role_of(name)
        if role in (NORM_ROLE, ZERO_ROLE):
            continue
        pooled.setdefault(role, []).append(model.tensor(name).ravel())
        fan_in[role] = model.shape(name)[-1]
    return {role: fit_student_t(np.concatenate(parts), fan_in[role]) for role, parts in pooled.items()}


# ---- the plan -----------------------------------------------------------------


def plan_tensors(like: LikeModel, n_layer: int, n_expert: int, vocab_size: int,
                 matrix_type: GGMLQuantizationType) -> list[TensorPlan]:
    """Every tensor in llama.cpp's converter order, shapes in NumPy order; 1-D tensors and the
    router stay F32 as the converter keeps them."""
    d, f, fs = like.hp.d_model, like.hp.d_expert, like.hp.d_shexp
    q, kv = like.hp.n_head * like.hp.head_dim, like.hp.n_head_kv * like.hp.head_dim
    F32 = GGMLQuantizationType.F32

    def t(name: str, *shape: int) -> TensorPlan:
        role = role_of(name)
        ggml_type = F32 if len(shape) == 1 or role in ("ffn_gate_inp", "ssm_conv1d") else matrix_type
        return TensorPlan(name, tuple(shape), ggml_type, role)

    plan = [t("token_embd.weight", vocab_size, d), t("output_norm.weight", d), t("output.weight", vocab_size, d)]
    if like.arch == "deepseek2":
        return plan + _deepseek2_plan(like.hp, n_layer, n_expert, t)
    for i in range(n_layer):
        b = f"blk.{i}."
        plan += [t(b + "attn_norm.weight", d)]
        if like.arch == "qwen3next":
            plan += [t(b + "post_attention_norm.weight", d)]
            plan += [t(b + short, *shape) for short, shape in _qwen3next_attention(like.hp, i).items()]
        else:
            plan += [t(b + "attn_q.weight", q, d), t(b + "attn_k.weight", kv, d), t(b + "attn_v.weight", kv, d),
                     t(b + "attn_output.weight", d, q)]
            arch = ARCHITECTURES[like.arch]  # its q/k/v biases or q/k norms, or none
            extra = arch.attention_extra_shapes(like.hp)
            plan += [t(b + short, *extra[short]) for short in arch.attention_extra_tensors]
            plan += [t(b + "ffn_norm.weight", d)]
        plan += [t(b + "ffn_gate_inp.weight", n_expert, d), t(b + "ffn_gate_exps.weight", n_expert, f, d),
                 t(b + "ffn_up_exps.weight", n_expert, f, d), t(b + "ffn_down_exps.weight", n_expert, d, f)]
        if fs:
            plan += [t(b + "ffn_gate_inp_shexp.weight", d), t(b + "ffn_gate_shexp.weight", fs, d),
                     t(b + "ffn_up_shexp.weight", fs, d), t(b + "ffn_down_shexp.weight", d, fs)]
    return plan


def deepseek2_shape(hp: HParams, n_layer: int, n_expert: int) -> tuple[int, int, int, int]:
    """(dense leading layers, expert groups, groups kept, experts per token) of a DeepSeek-V3 synth of
    `n_layer` layers and `n_expert` experts: at least one MoE layer; with too few experts for the real
    groups of two or more, one group."""
    n_group, n_group_used = hp.n_group, hp.n_group_used
    if n_expert % n_group or n_expert // n_group < 2:
        n_group = n_group_used = 1
    return min(hp.n_dense_lead, n_layer - 1), n_group, n_group_used, min(hp.n_expert_used, n_expert)


def _deepseek2_plan(hp: HParams, n_layer: int, n_expert: int, t) -> list[TensorPlan]:
    """A DeepSeek-V3 layer stack as llama.cpp's converter writes it: MLA with the q LoRA and split
    k_b / v_b, dense SwiGLU FFNs first, then router, correction bias, experts and the ungated shared expert."""
    d, H, E, f, fs = hp.d_model, hp.n_head, n_expert, hp.d_expert, hp.d_shexp
    n_dense = deepseek2_shape(hp, n_layer, n_expert)[0]
    plan = []
    for i in range(n_layer):
        b = f"blk.{i}."
        plan += [t(b + "attn_norm.weight", d), t(b + "attn_q_a.weight", hp.q_lora_rank, d),
                 t(b + "attn_q_a_norm.weight", hp.q_lora_rank), t(b + "attn_q_b.weight", H * hp.head_dim, hp.q_lora_rank),
                 t(b + "attn_kv_a_mqa.weight", hp.kv_lora_rank + hp.rope_dim, d),
                 t(b + "attn_kv_a_norm.weight", hp.kv_lora_rank),
                 t(b + "attn_k_b.weight", H, hp.kv_lora_rank, hp.head_dim - hp.rope_dim),
                 t(b + "attn_v_b.weight", H, hp.v_head_dim, hp.kv_lora_rank),
                 t(b + "attn_output.weight", d, H * hp.v_head_dim), t(b + "ffn_norm.weight", d)]
        if i < n_dense:
            plan += [t(b + "ffn_gate.weight", hp.d_ff, d), t(b + "ffn_up.weight", hp.d_ff, d),
                     t(b + "ffn_down.weight", d, hp.d_ff)]
            continue
        plan += [t(b + "ffn_gate_inp.weight", E, d), t(b + "exp_probs_b.bias", E),
                 t(b + "ffn_gate_exps.weight", E, f, d), t(b + "ffn_up_exps.weight", E, f, d),
                 t(b + "ffn_down_exps.weight", E, d, f), t(b + "ffn_gate_shexp.weight", fs, d),
                 t(b + "ffn_up_shexp.weight", fs, d), t(b + "ffn_down_shexp.weight", d, fs)]
    return plan


def _deepseek2_keys(hp: HParams, n_layer: int, n_expert: int) -> dict[str, Any]:
    """The `ArchKeys` llama.cpp's DeepseekV2Model converter sets beyond (or instead of) the common ones,
    YaRN's among them, but no `vocab_size` (a shrunk vocabulary's size is its token list's, which
    llama.cpp counts) and the shared expert as a count, not a width."""
    n_dense, n_group, n_group_used, k = deepseek2_shape(hp, n_layer, n_expert)
    return dict(
        expert_used_count=k, key_length=hp.kv_lora_rank + hp.rope_dim, value_length=hp.kv_lora_rank,
        expert_group_count=n_group, expert_group_used_count=n_group_used, expert_gating_func=2,
        leading_dense_block_count=n_dense, q_lora_rank=hp.q_lora_rank, kv_lora_rank=hp.kv_lora_rank,
        key_length_mla=hp.head_dim, value_length_mla=hp.v_head_dim, expert_shared_count=hp.d_shexp // hp.d_expert,
        expert_shared_feed_forward_length=None, expert_weights_scale=hp.expert_weights_scale,
        rope_dimension_count=hp.rope_dim, rope_scaling_type="yarn", rope_scaling_factor=hp.rope_scaling_factor,
        rope_scaling_original_context_length=hp.rope_orig_ctx, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_log_multiplier=0.1 * hp.yarn_log_mul,
    )


def _qwen3next_attention(hp: HParams, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s attention tensors and shapes: gated full attention or gated DeltaNet."""
    from moeheal.pipeline.model.arch.qwen3next import FULL_ATTENTION_TENSORS, LINEAR_ATTENTION_TENSORS

    kv = hp.n_head_kv * hp.head_dim
    shapes = {"attn_k.weight": (kv, hp.d_model), "attn_v.weight": (kv, hp.d_model),
              "attn_output.weight": (hp.d_model, hp.n_head * hp.head_dim),
              **ARCHITECTURES["qwen3next"].attention_extra_shapes(hp)}
    names = LINEAR_ATTENTION_TENSORS if hp.recurrent_layers[layer] else FULL_ATTENTION_TENSORS
    return {name: shapes[name] for name in names}


def arch_keys(like: LikeModel, n_layer: int, n_expert: int, file_type: LlamaFileType,
              vocab_size: int | None = None) -> ArchKeys:
    """`general.*` and `<arch>.*` keys of the model's file (`vocab_size`: a shrunk one)."""
    hp = like.hp
    keys: dict[str, Any] = dict(
        name=like.title, description=like.description, file_type=int(file_type),
        context_length=hp.context_length, embedding_length=hp.d_model, block_count=n_layer,
        feed_forward_length=like.d_ff, head_count=hp.n_head, head_count_kv=hp.n_head_kv,
        key_length=hp.head_dim, value_length=hp.head_dim, rope_freq_base=hp.rope_theta, rms_eps=hp.rms_eps,
        expert_count=n_expert, expert_used_count=min(hp.n_expert_used, n_expert),
        expert_feed_forward_length=hp.d_expert, expert_shared_feed_forward_length=hp.d_shexp or None,
        # qwen3next's converter writes no expert_weights_norm: llama.cpp always renormalises
        expert_weights_norm=None if like.arch == "qwen3next" else hp.norm_topk_prob,
    )
    if like.arch == "deepseek2":
        keys.update(_deepseek2_keys(hp, n_layer, n_expert))
    if like.arch == "llama":  # LlamaModel: no head-dim, expert-width or weights-norm keys (Mixtral's config has none)
        keys.update(key_length=None, value_length=None, expert_feed_forward_length=None, expert_weights_norm=None,
                    vocab_size=vocab_size or hp.vocab_size, rope_dimension_count=hp.head_dim)
    if hp.recurrent_layers:
        keys.update(ssm_conv_kernel=hp.ssm_conv_kernel, ssm_state_size=hp.ssm_state_size,
                    ssm_group_count=hp.ssm_group_count, ssm_time_step_rank=hp.ssm_time_step_rank,
                    ssm_inner_size=hp.ssm_inner_size, recurrent_layers=hp.recurrent_layers[:n_layer],
                    full_attention_interval=hp.recurrent_layers.index(False) + 1, rope_dimension_count=hp.rope_dim)
    return ArchKeys(arch=like.arch, **keys)


# ---- the vocabulary -----------------------------------------------------------

QWEN_TEXT_TOKENS = 151643  # Qwen2/Qwen3's ordinary BPE tokens; special tokens start here
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


def load_demo_vocabulary(path: Path) -> dict[str, list]:
    """The demo vocabulary's `tokenizer.ggml.*` lists, from the packaged JSON or from a GGUF."""
    if path.suffix == ".gguf":
        from moeheal.pipeline.gguf.model import GGUFModel

        model = GGUFModel(path)
        return {key: list(model.metadata(key)) for key in
                ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _fill(tokens: list[str], size: int, spelling: str) -> set[str]:
    """Append filler tokens `spelling` of 0, 1, 2, ... (skipping any already there) until `tokens`
    holds `size`; returns the set of its tokens."""
    kept = set(tokens)
    fill = 0
    while len(tokens) < size:
        candidate = spelling.format(fill)
        fill += 1
        if candidate not in kept:
            tokens.append(candidate)
            kept.add(candidate)
    return kept


def synth_vocabulary(vocab_size: int, demo: dict[str, list]) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of `vocab_size` entries laid out as Qwen's padded vocabulary.

    The demo's ordinary tokens come first (a prefix of them when `vocab_size` is
    small, merges kept only where both parts and the result are kept), then
    filler tokens spelled in the byte alphabet (reachable by no merge, like
    rare tokens), the three specials, then `[PAD<id>]` tokens.
    """
    demo_tokens, demo_types = demo["tokenizer.ggml.tokens"], demo["tokenizer.ggml.token_type"]
    ordinary = [tok for tok, ty in zip(demo_tokens, demo_types) if ty == TOKEN_NORMAL]
    n_text = min(QWEN_TEXT_TOKENS, vocab_size - len(QWEN_SPECIALS))
    tokens = ordinary[:n_text]
    kept = _fill(tokens, n_text, "ĠĠfill{}")  # Ġ is byte-level BPE's space
    merges = []
    for merge in demo["tokenizer.ggml.merges"]:
        left, right = merge.split(" ", 1)
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    types = [TOKEN_NORMAL] * n_text + [TOKEN_CONTROL] * len(QWEN_SPECIALS)
    tokens += list(QWEN_SPECIALS)
    pads = range(len(tokens), vocab_size)
    tokens += [f"[PAD{i}]" for i in pads]
    types += [TOKEN_UNUSED] * len(pads)
    return tokens, types, merges


def qwen_vocabulary(tokens: list[str], types: list[int], merges: list[str]) -> Vocabulary:
    """The vocabulary as llama.cpp's converter writes Qwen's (BOS = PAD = <|endoftext|>, EOS = <|im_end|>)."""
    return Vocabulary(model="gpt2", pre="qwen2", tokens=tokens, token_types=types, merges=merges,
                      bos=tokens.index("<|endoftext|>"), eos=tokens.index("<|im_end|>"),
                      padding=tokens.index("<|endoftext|>"), add_bos=False)


SPM_SPECIALS = ("<unk>", "<s>", "</s>")  # Mixtral's ids 0, 1, 2
TOKEN_UNKNOWN, TOKEN_BYTE = 2, 6


def sentencepiece_vocabulary(vocab_size: int, demo: dict[str, list]) -> tuple[list[str], list[int], list[float]]:
    """Tokens, token types and scores of `vocab_size` entries laid out as Mixtral's SentencePiece
    vocabulary (see the module docstring); the demo's byte-level tokens are spelled back to text."""
    from moeheal.pipeline.gguf.tokenizer import byte_spelling

    unspell = {c: b for b, c in byte_spelling().items()}
    tokens = list(SPM_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    kept = set(tokens)
    demo_tokens, demo_types = demo["tokenizer.ggml.tokens"], demo["tokenizer.ggml.token_type"]
    for token, ty in zip(demo_tokens, demo_types):
        if len(tokens) == vocab_size:
            break
        try:
            piece = bytes(unspell[c] for c in token).decode("utf-8").replace(" ", "▁")
        except (KeyError, UnicodeDecodeError):  # a token that is part of a character
            continue
        if ty == TOKEN_NORMAL and piece not in kept:
            tokens.append(piece)
            kept.add(piece)
    _fill(tokens, vocab_size, "▁fill{}")
    types += [TOKEN_NORMAL] * (vocab_size - len(types))
    scores = [0.0 if ty != TOKEN_NORMAL else -float(i) for i, ty in enumerate(types)]
    return tokens, types, scores


def mixtral_vocabulary(tokens: list[str], types: list[int], scores: list[float]) -> Vocabulary:
    """The vocabulary as llama.cpp's converter writes Mixtral's (BOS <s>, EOS </s>, UNK <unk>)."""
    return Vocabulary(model="llama", pre="default", tokens=tokens, scores=scores, token_types=types,
                      bos=tokens.index("<s>"), eos=tokens.index("</s>"), unknown=tokens.index("<unk>"),
                      add_bos=True, add_eos=False)


# ---- the weights --------------------------------------------------------------


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def _student_t(rng: np.random.Generator, df: float, size: tuple[int, int]) -> np.ndarray:
    """Unit-scale Student-t draws, float32: z / sqrt(chi2_df / df), chi2_df / df = Gamma(df / 2) / (df / 2)."""
    z = rng.standard_normal(size, dtype=np.float32)  # (rows, cols)
    if math.isfinite(df):
        z /= np.sqrt(rng.standard_gamma(df / 2, size, dtype=np.float32) / np.float32(df / 2))
    return z


def chunk_rows(shape: tuple[int, ...]) -> int:
    """Rows per drawn chunk of a tensor viewed as (rows, cols), cols = its row length."""
    return max(1, CHUNK_WEIGHTS // shape[-1])


def value_chunks(t: TensorPlan, seed: int) -> Iterator[np.ndarray]:
    """The tensor's values as float32 chunks (rows, cols) of `chunk_rows` rows, in storage order."""
    for k in range(n_chunks(t)):
        yield chunk_values(t, seed, k)


def n_chunks(t: TensorPlan) -> int:
    """How many row chunks `value_chunks` cuts the tensor into."""
    return -(-math.prod(t.shape[:-1]) // chunk_rows(t.shape))


def chunk_values(t: TensorPlan, seed: int, k: int) -> np.ndarray:
    """Chunk k of the tensor's values, float32 (rows, cols): a function of (seed, name, k) alone."""
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    step = chunk_rows(t.shape)
    size = (min(step, rows - k * step), cols)
    if t.role == ZERO_ROLE:
        return np.zeros(size, dtype=np.float32)
    rng = np.random.default_rng([seed, _name_key(t.name), k])
    if t.role == NORM_ROLE:
        return 1.0 + NORM_STD * rng.standard_normal(size, dtype=np.float32)
    if t.role == DECAY_ROLE:  # -A, A ~ U[0.01, 16] as transformers initialises A_log = log(A)
        return -rng.uniform(0.01, 16.0, size).astype(np.float32)
    fit = ROLE_FITS[BORROWED_ROLES.get(t.role, t.role)]
    std = fit.std if t.role == "token_embd" else fit.std * math.sqrt(fit.fan_in / cols)
    scale = std * math.sqrt((fit.df - 2) / fit.df) if math.isfinite(fit.df) else std  # t's variance is df/(df-2)
    chunk = _student_t(rng, fit.df, size)  # (rows, cols)
    chunk *= np.float32(scale)
    return chunk


def encoded_chunk(t: TensorPlan, seed: int, k: int) -> np.ndarray:
    """Chunk k of the tensor as stored (`gguf_write.encode`): what a worker process returns."""
    return encode(chunk_values(t, seed, k), t.ggml_type)


def tensor_values(t: TensorPlan, seed: int) -> np.ndarray:
    """One whole tensor, float32 in its shape, regenerated alone (tests; small tensors)."""
    return np.concatenate(list(value_chunks(t, seed))).reshape(t.shape)


# ---- the file -----------------------------------------------------------------

_SIZE = re.compile(r"(\d+)([KMG]?)")


def parse_size(text: str) -> int:
    """`500M`, `50G`, `4096`: bytes, with llama.cpp gguf-split's decimal units."""
    m = _SIZE.fullmatch(text.strip().upper())
    if not m or int(m[1]) == 0:
        raise InputError(f"synth: --split-max-size {text}: expected a positive size such as 500M or 50G")
    return int(m[1]) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m[2]]


def _writer(tmp: Path, like: LikeModel, plan: list[TensorPlan], kv: list[KV], split_max_size: int) -> GGUFWriter:
    """gguf-py's writer with every key and tensor info added; it assigns tensors to shards and
    writes llama.cpp's split.* keys."""
    writer = GGUFWriter(tmp, like.arch, split_max_size=split_max_size)
    for key, value, vtype in kv:
        add_kv(writer, key, value, vtype)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.ggml_type)
    return writer


def write_synth(out: str | os.PathLike[str], like_name: str, n_layer: int | None = None, seed: int = 0,
                matrix_type: str = "q8_0", split_max_size: int = 0, vocab_size: int | None = None,
                n_expert: int | None = None, zeros: bool = False, demo_model: Path = DEMO_VOCAB,
                jobs: int = 1) -> SynthResult:
    """Write the synthetic model to `out` (or its shards `<stem>-0000i-of-0000n.gguf`), atomically.

    Shards are written under temporary names and renamed once all are complete. With `jobs` > 1,
    that many worker processes draw and encode chunks (the file is the same: a chunk is a function
    of the seed, the tensor name and its index); host memory then holds about one chunk per worker
    plus the chunks drawn ahead of the writer.
    """
    like = _check_args(like_name, n_layer, seed, matrix_type, vocab_size, n_expert, demo_model)
    if jobs < 1:
        raise InputError(f"synth: --jobs {jobs}: need at least 1 worker")
    n_layer = like.hp.n_layer if n_layer is None else n_layer
    vocab_size = like.hp.vocab_size if vocab_size is None else vocab_size
    n_expert = like.hp.n_expert if n_expert is None else n_expert
    ggml_type, file_type = MATRIX_TYPES[matrix_type]
    started = time.monotonic()
    plan = plan_tensors(like, n_layer, n_expert, vocab_size, ggml_type)
    if like.arch == "llama":  # Mixtral: SentencePiece
        vocabulary = mixtral_vocabulary(*sentencepiece_vocabulary(vocab_size, load_demo_vocabulary(demo_model)))
    else:
        vocabulary = qwen_vocabulary(*synth_vocabulary(vocab_size, load_demo_vocabulary(demo_model)))
    kv = metadata_kv(arch_keys(like, n_layer, n_expert, file_type, vocab_size)) + metadata_kv(vocabulary)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = _writer(tmp, like, plan, kv, split_max_size)
    tmp_paths, final_paths = writer.format_shard_names(tmp), writer.format_shard_names(out)
    by_name = {t.name: t for t in plan}
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for fout in writer.fout:  # tensor data starts aligned after the tensor table
            writer.write_padding(fout, fout.tell())
        shard_of = [(fout, name) for fout, infos in zip(writer.fout, writer.tensors) for name in infos]
        with (get_context("spawn").Pool(jobs) if jobs > 1 and not zeros else nullcontext()) as pool:
            for fout, name in progress(shard_of, desc="synth", unit="tensors"):
                _write_tensor(fout, by_name[name], seed, zeros, pool)
                writer.write_padding(fout, by_name[name].n_bytes)
        for fout in writer.fout:
            fout.truncate()  # a sparse --zeros file ends where its last tensor does
        writer.close()
        for tmp_path, path in zip(tmp_paths, final_paths):
            os.replace(tmp_path, path)
    finally:
        writer.close()
        for tmp_path in tmp_paths:
            tmp_path.unlink(missing_ok=True)
    return SynthResult(final_paths, len(plan), sum(t.n_bytes for t in plan), time.monotonic() - started)


def _write_tensor(fout: BinaryIO, t: TensorPlan, seed: int, zeros: bool, pool: Pool | None) -> None:
    """One tensor's data at the file's position: drawn and encoded chunk by chunk (by `pool`'s
    workers, in order, when given), or a hole of zeros."""
    if zeros:
        fout.seek(t.n_bytes, os.SEEK_CUR)
        return
    chunks = range(n_chunks(t))
    encoded = (encoded_chunk(t, seed, k) for k in chunks) if pool is None else \
        pool.imap(partial(encoded_chunk, t, seed), chunks)
    for raw in encoded:
        raw.tofile(fout)


def _check_args(like_name: str, n_layer: int | None, seed: int, matrix_type: str, vocab_size: int | None,
                n_expert: int | None, demo_model: Path) -> LikeModel:
    """The named model, once every argument is one `write_synth` can honour (InputError otherwise)."""
    like = LIKE.get(like_name)
    if like is None:
        raise InputError(f"synth: --like {like_name}: unknown model (known: {', '.join(LIKE)})")
    if n_layer is not None and not 1 <= n_layer <= like.hp.n_layer:
        raise InputError(f"synth: --layers {n_layer}: {like_name} has 1 to {like.hp.n_layer} layers")
    kept = like.hp.recurrent_layers[:n_layer]
    if kept and all(kept):
        raise InputError(f"synth: --layers {n_layer}: the first {n_layer} layers of {like_name} are all linear "
                         f"attention; keep at least {like.hp.recurrent_layers.index(False) + 1} (one full attention)")
    if seed < 0:
        raise InputError(f"synth: --seed {seed}: expected a non-negative integer")
    if matrix_type not in MATRIX_TYPES:
        raise InputError(f"synth: --type {matrix_type}: expected one of {', '.join(MATRIX_TYPES)}")
    min_vocab = 256 + len(QWEN_SPECIALS)  # every byte token, and the specials
    if vocab_size is not None and not min_vocab <= vocab_size <= like.hp.vocab_size:
        raise InputError(f"synth: --vocab {vocab_size}: expected {min_vocab} to {like.hp.vocab_size}")
    if n_expert is not None and not 1 <= n_expert <= like.hp.n_expert:
        raise InputError(f"synth: --experts {n_expert}: expected 1 to {like.hp.n_expert}")
    if not demo_model.is_file():
        raise InputError(f"synth: {demo_model}: the demo vocabulary synth reuses is missing")
    return like
