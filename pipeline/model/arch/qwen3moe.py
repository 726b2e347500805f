"""Qwen3-MoE (llama.cpp `qwen3moe`): RMSNorm on each head of q and k before RoPE, softmax top-k
routing renormalised over the chosen experts, no shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.arch.base import Architecture, Routing, register

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import HParams


@register
class Qwen3Moe(Architecture):
    name = "qwen3moe"
    routing = Routing(score="softmax", norm_topk_default=True)
    shared_expert = "none"
    attention_extra_tensors = ("attn_q_norm.weight", "attn_k_norm.weight")

    def attention_extra_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        return {"attn_q_norm.weight": (hp.head_dim,), "attn_k_norm.weight": (hp.head_dim,)}

    def project_qkv(self, params: dict, x: jax.Array, hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, T, _ = x.shape
        q = M.linear(params, "attn_q", x).reshape(B, T, hp.n_head, hp.head_dim)  # (B, T, H, hd)
        k = M.linear(params, "attn_k", x).reshape(B, T, hp.n_head_kv, hp.head_dim)  # (B, T, Hkv, hd)
        v = M.linear(params, "attn_v", x).reshape(B, T, hp.n_head_kv, hp.head_dim)  # (B, T, Hkv, hd)
        q = M.rms_norm(q, params["attn_q_norm.weight"], hp.rms_eps)  # (B, T, H, hd): per head
        k = M.rms_norm(k, params["attn_k_norm.weight"], hp.rms_eps)  # (B, T, Hkv, hd)
        return q, k, v
