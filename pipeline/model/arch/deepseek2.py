"""DeepSeek-V2/V3 (llama.cpp `deepseek2`): multi-head latent attention, leading dense layers, an
ungated shared expert, and sigmoid routing with a selection bias and expert groups.

Attention (MLA). q comes from x directly (`attn_q`, V2-Lite) or through a low-rank path
(`attn_q_a`, RMSNorm `attn_q_a_norm`, `attn_q_b`, V3); each head's q is `nope` unrotated dims
then `rope` rotated ones. `attn_kv_a_mqa` projects x to a compressed latent c (kv_lora_rank,
RMSNorm `attn_kv_a_norm`) and ONE rotated key k_pe shared by every head. The up-projections are
stored split, as llama.cpp's converter writes them for its absorbed-MLA graph: `attn_k_b`
(H, kv_lora, nope) gives each head's unrotated key from c, `attn_v_b` (H, v, kv_lora) its value.
We run the decompressed form, which llama.cpp's absorbed form equals algebraically:

    score(t, s) = (q_nope_t . (c_s Kb_h) + rope(q_pe_t) . rope(k_pe_s)) / sqrt(nope + rope)

RoPE here is llama.cpp's NORM type for this architecture: interleaved pairs (2i, 2i+1), which is
transformers' `rope_interleave=True` (the converter permutes nothing). YaRN rope scaling (DeepSeek-V3's
factor 40) is computed as llama.cpp computes it for deepseek2 (`yarn_rope_tables`): frequencies
interpolated by 1/s outside the correction band of beta_fast 32 / beta_slow 1 (llama.cpp reads no beta
keys for this architecture), and the attention scale times mscale^2, mscale = 1 + 0.1 * mscale_all_dim
* ln s, mscale_all_dim from `yarn_log_multiplier` (required: without it llama.cpp scales differently
from transformers).

Routing: scores s = sigmoid(router logits); selection ranks s + `exp_probs_b` (the correction
bias) within the `n_group_used` groups whose two best biased scores sum highest; the weights are
the UNbiased s of the chosen experts, renormalised if `expert_weights_norm`, times
`expert_weights_scale`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.arch.base import Architecture, Routing, register
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.model.numerics import CACHE_K, CACHE_V, probe

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import GGUFModel, HParams

SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
Q_LORA = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight")
MLA = ("attn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight",
       "attn_output.weight")


YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's defaults, the only values it uses for deepseek2


def yarn_score_scale(hp: HParams) -> float:
    """The factor on q that makes llama.cpp's deepseek2 attention scale mscale^2 / sqrt(hd),
    mscale = 1 + 0.1 * mscale_all_dim * ln s (transformers' `yarn_get_mscale`); 1 without rope scaling."""
    mscale = 1.0 + 0.1 * hp.yarn_log_mul * math.log(hp.rope_scaling_factor)
    return mscale * mscale


def yarn_rope_tables(n_pos: int, hp: HParams) -> tuple[jax.Array, jax.Array]:
    """YaRN cos/sin (T, rope/2) as ggml's rope computes them for deepseek2: pair i's frequency theta_i is
    extrapolated (kept) below the correction band [low, high] and interpolated (theta_i / s) above
    it, linearly mixed inside; the band is where a pair turns beta_fast .. beta_slow times over the
    pretraining context."""
    r, s = hp.rope_dim, hp.rope_scaling_factor

    def corr_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over the context
        return r * math.log(hp.rope_orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(hp.rope_theta))

    low, high = max(0.0, math.floor(corr_dim(YARN_BETA_FAST))), min(r - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))
    pair = jnp.arange(r // 2, dtype=jnp.float32)  # (r/2,)
    keep = 1.0 - jnp.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)  # (r/2,) 1: extrapolate
    inv_freq = 1.0 / (hp.rope_theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))  # (r/2,)
    inv_freq = inv_freq / s * (1.0 - keep) + inv_freq * keep  # (r/2,)
    angles = jnp.arange(n_pos, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, r/2)
    return jnp.cos(angles), jnp.sin(angles)  # the file's mscale_all_dim cancels YaRN's own cos/sin scale


@register
class Deepseek2(Architecture):
    name = "deepseek2"
    routing = Routing(score="sigmoid", norm_topk_default=False)  # llama.cpp's default: no renormalising
    shared_expert = "ungated"
    router_extra_tensors = ("exp_probs_b.bias",)
    standard_attention = False  # MLA: no q/k/v matrices for `pipeline.model.roles` to measure

    # ---- what the file holds ----------------------------------------------

    def read_hparams(self, model: GGUFModel) -> dict[str, Any]:
        a, where = self.name, model.name

        def key(suffix: str, default: Any = None) -> Any:
            value = model.metadata(f"{a}.{suffix}", default)
            if value is None:
                raise InputError(f"{where}: key {a}.{suffix}: missing (needed by {a}'s MLA and routing)")
            return value

        scaling = model.metadata(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "yarn"):
            raise InputError(f"{where}: key {a}.rope.scaling.type: {scaling!r} rope scaling is not supported "
                             f"for {a} (only yarn)")
        if model.metadata(f"{a}.rope.scaling.attn_factor", 1.0) != 1.0:
            raise InputError(f"{where}: key {a}.rope.scaling.attn_factor: only 1 is supported for {a}")
        yarn = {"rope_scaling_factor": float(key("rope.scaling.factor")),
                "rope_orig_ctx": int(key("rope.scaling.original_context_length")),
                "yarn_log_mul": float(key("rope.scaling.yarn_log_multiplier")) / 0.1} if scaling == "yarn" else {}
        gating = key("expert_gating_func", 0)
        if gating != SIGMOID_GATING:
            raise InputError(f"{where}: key {a}.expert_gating_func: {gating or 'missing'}; only sigmoid gating "
                             f"({SIGMOID_GATING}, DeepSeek-V3's) is supported for {a}")
        n_head = int(key("attention.head_count"))
        head_dim, rope_dim = int(key("attention.key_length_mla")), int(key("rope.dimension_count"))
        if not 0 < rope_dim < head_dim or rope_dim % 2:
            raise InputError(f"{where}: key {a}.rope.dimension_count: {rope_dim} is not an even width below "
                             f"key_length_mla {head_dim}")
        n_expert = int(key("expert_count"))
        n_group, n_group_used = int(key("expert_group_count", 1)), int(key("expert_group_used_count", 1))
        if n_expert % n_group or (n_group > 1 and n_expert // n_group < 2) or n_group_used > n_group:
            raise InputError(f"{where}: key {a}.expert_group_count: {n_group} groups (keeping {n_group_used}) "
                             f"do not split {n_expert} experts into groups of two or more")
        if int(key("expert_used_count")) > n_group_used * (n_expert // n_group):
            raise InputError(f"{where}: key {a}.expert_used_count: more experts than {n_group_used} groups hold")
        return {"n_head": n_head, "n_head_kv": int(key("attention.head_count_kv", n_head)), "head_dim": head_dim,
                "q_lora_rank": int(key("attention.q_lora_rank", 0)), "kv_lora_rank": int(key("attention.kv_lora_rank")),
                "rope_dim": rope_dim, "v_head_dim": int(key("attention.value_length_mla")),
                "n_group": n_group, "n_group_used": n_group_used,
                "expert_weights_scale": float(key("expert_weights_scale", 1.0)), **yarn}

    def attention_layer_tensors(self, hp: HParams) -> tuple[str, ...]:
        return MLA + (Q_LORA if hp.q_lora_rank else ("attn_q.weight",))

    def attention_extra_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        d, H, r_q, r_kv = hp.d_model, hp.n_head, hp.q_lora_rank, hp.kv_lora_rank
        nope = hp.head_dim - hp.rope_dim
        return {"attn_q.weight": (H * hp.head_dim, d), "attn_q_a.weight": (r_q, d), "attn_q_a_norm.weight": (r_q,),
                "attn_q_b.weight": (H * hp.head_dim, r_q), "attn_kv_a_mqa.weight": (r_kv + hp.rope_dim, d),
                "attn_kv_a_norm.weight": (r_kv,), "attn_k_b.weight": (H, r_kv, nope),
                "attn_v_b.weight": (H, hp.v_head_dim, r_kv), "attn_output.weight": (d, H * hp.v_head_dim)}

    # ---- attention --------------------------------------------------------

    def rope_tables(self, n_pos: int, hp: HParams) -> tuple[jax.Array, jax.Array]:
        if hp.rope_scaling_factor == 1.0:
            return M.rope_tables(n_pos, hp.rope_dim, hp.rope_theta)  # (T, rope/2) each
        return yarn_rope_tables(n_pos, hp)

    @partial(jax.jit, static_argnames=("self", "hp"))
    def attention_heads(self, params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, hp: HParams) -> jax.Array:
        """MLA up to the heads' concatenated values: x (B, T, d) normed input -> (B, T, H*v)."""
        B, T, _ = x.shape
        H, nope, r_kv = hp.n_head, hp.head_dim - hp.rope_dim, hp.kv_lora_rank
        if hp.q_lora_rank:
            q_a = M.rms_norm(M.linear(params, "attn_q_a", x), params["attn_q_a_norm.weight"], hp.rms_eps)  # (B, T, r_q)
            q = M.linear(params, "attn_q_b", q_a)  # (B, T, H*hd)
        else:
            q = M.linear(params, "attn_q", x)  # (B, T, H*hd)
        q = q.reshape(B, T, H, hp.head_dim)  # (B, T, H, hd)
        q_pe = M.apply_rope_pairs(q[..., nope:], cos, sin)  # (B, T, H, rope)
        kv_a = M.linear(params, "attn_kv_a_mqa", x)  # (B, T, r_kv + rope)
        c = M.rms_norm(kv_a[..., :r_kv], params["attn_kv_a_norm.weight"], hp.rms_eps)  # (B, T, r_kv)
        k_pe = M.apply_rope_pairs(kv_a[..., None, r_kv:], cos, sin)  # (B, T, 1, rope): one key for all heads
        probe(params, CACHE_K, jnp.concatenate([c, k_pe[:, :, 0]], axis=-1))  # (B, T, r_kv + rope): llama.cpp's MLA cache
        probe(params, CACHE_V, c)  # its V is a view of the cached latent
        probe(params, "attn_k_b.weight", q[..., :nope])  # absorbed MLA: attn_k_b meets q_nope (B, T, H, nope)
        probe(params, "attn_v_b.weight", c)  # ... and attn_v_b the attention-weighted latent, bounded by max|c|
        k_nope = M.einsum("btc,hcn->bthn", c, params["attn_k_b.weight"])  # (B, T, H, nope)
        v = M.einsum("btc,hvc->bthv", c, params["attn_v_b.weight"])  # (B, T, H, v)
        q = jnp.concatenate([q[..., :nope], q_pe], axis=-1) * yarn_score_scale(hp)  # (B, T, H, hd)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (B, T, H, hp.rope_dim))], axis=-1)  # (B, T, H, hd)
        return M.causal_attention(q, k, v)  # (B, T, H*v), scaled by 1/sqrt(hd) (and YaRN's mscale^2)

    # ---- routing ----------------------------------------------------------

    @partial(jax.jit, static_argnames=("self", "hp"))
    def route_layer(self, params: dict, router_logits: jax.Array, hp: HParams) -> tuple[jax.Array, jax.Array]:
        scores = jax.nn.sigmoid(router_logits)  # (B, T, E)
        biased = scores + params["exp_probs_b.bias"]  # (B, T, E): only ranks, never weighs
        *lead, E = biased.shape
        groups = biased.reshape(*lead, hp.n_group, E // hp.n_group)  # (B, T, G, E/G)
        group_score = jnp.sum(jax.lax.top_k(groups, min(2, E // hp.n_group))[0], axis=-1)  # (B, T, G): two best
        _, kept = jax.lax.top_k(group_score, hp.n_group_used)  # (B, T, Gu)
        keep = jnp.any(kept[..., None] == jnp.arange(hp.n_group), axis=-2)  # (B, T, G)
        masked = jnp.where(keep[..., None], groups, -jnp.inf).reshape(biased.shape)  # (B, T, E)
        _, experts = jax.lax.top_k(masked, hp.n_expert_used)  # (B, T, k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)  # (B, T, k) unbiased
        if hp.norm_topk_prob:
            weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 6.103515625e-5)  # llama.cpp's clamp
        return experts.astype(jnp.int32), weights * hp.expert_weights_scale
