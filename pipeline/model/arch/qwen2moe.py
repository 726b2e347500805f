"""Qwen2-MoE (llama.cpp `qwen2moe`): biased q/k/v projections, softmax top-k routing without
renormalisation, and a shared expert behind a sigmoid gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.arch.base import Architecture, Routing, register

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import HParams


@register
class Qwen2Moe(Architecture):
    name = "qwen2moe"
    routing = Routing(score="softmax", norm_topk_default=False)
    shared_expert = "sigmoid_gated"
    attention_extra_tensors = ("attn_q.bias", "attn_k.bias", "attn_v.bias")

    def attention_extra_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}

    def project_qkv(self, params: dict, x: jax.Array, hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, T, _ = x.shape
        q = M.linear(params, "attn_q", x).reshape(B, T, hp.n_head, hp.head_dim)  # (B, T, H, hd)
        k = M.linear(params, "attn_k", x).reshape(B, T, hp.n_head_kv, hp.head_dim)  # (B, T, Hkv, hd)
        v = M.linear(params, "attn_v", x).reshape(B, T, hp.n_head_kv, hp.head_dim)  # (B, T, Hkv, hd)
        return q, k, v
