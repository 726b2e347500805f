"""OLMoE (llama.cpp `olmoe`): RMSNorm over the whole projected q and the whole projected k (one
norm across all heads, not per head) before RoPE, softmax top-k routing without renormalisation
(llama.cpp's graph never renormalises it), no shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.arch.base import Architecture, Routing, register

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import HParams


@register
class Olmoe(Architecture):
    name = "olmoe"
    routing = Routing(score="softmax", norm_topk_default=False)
    shared_expert = "none"
    attention_extra_tensors = ("attn_q_norm.weight", "attn_k_norm.weight")

    def attention_extra_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        return {"attn_q_norm.weight": (hp.n_head * hp.head_dim,), "attn_k_norm.weight": (hp.n_head_kv * hp.head_dim,)}

    def project_qkv(self, params: dict, x: jax.Array, hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, T, _ = x.shape
        q = M.rms_norm(M.linear(params, "attn_q", x), params["attn_q_norm.weight"], hp.rms_eps)  # (B, T, H*hd)
        k = M.rms_norm(M.linear(params, "attn_k", x), params["attn_k_norm.weight"], hp.rms_eps)  # (B, T, Hkv*hd)
        v = M.linear(params, "attn_v", x)  # (B, T, Hkv*hd)
        return (q.reshape(B, T, hp.n_head, hp.head_dim),  # (B, T, H, hd)
                k.reshape(B, T, hp.n_head_kv, hp.head_dim),  # (B, T, Hkv, hd)
                v.reshape(B, T, hp.n_head_kv, hp.head_dim))  # (B, T, Hkv, hd)
