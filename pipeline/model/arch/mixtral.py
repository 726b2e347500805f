"""Mixtral (llama.cpp `llama` with experts): plain q/k/v projections (no biases, no q/k norms),
softmax top-k routing renormalised over the chosen experts (llama.cpp's llama graph always
renormalises), no shared expert.

llama.cpp writes Mixtral as `general.architecture = "llama"` and rotates with its "normal" RoPE,
which pairs adjacent dimensions (2i, 2i+1) of a head, where transformers' rotate_half pairs i with
i + hd/2. Its converter (and ours, `pipeline.sources.convert`) therefore permutes the rows of the q and k
projections within each head so that HF's pair (i, i + hd/2) lands on rows (2i, 2i+1); attention
scores are unchanged because q and k move alike, and v is not touched. `apply_rope` here rotates
those adjacent pairs of the permuted weights.

A `llama` file without `llama.expert_count` is a dense Llama, not a MoE: `GGUFModel` refuses it,
because the key is required of every family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.arch.base import Architecture, Routing, register

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import HParams


@register
class Mixtral(Architecture):
    name = "llama"
    routing = Routing(score="softmax", norm_topk_default=True)
    shared_expert = "none"
    expert_width_key = "feed_forward_length"  # llama.cpp's llama loader sizes the experts by n_ff
    fixed_topk_norm = True  # llama.cpp's llama graph passes norm_w = true, never reading expert_weights_norm

    def apply_rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        return M.apply_rope_pairs(x, cos, sin)  # (B, T, H, hd)

    def project_qkv(self, params: dict, x: jax.Array, hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, T, _ = x.shape
        q = M.linear(params, "attn_q", x).reshape(B, T, hp.n_head, hp.head_dim)  # (B, T, H, hd), rows permuted
        k = M.linear(params, "attn_k", x).reshape(B, T, hp.n_head_kv, hp.head_dim)  # (B, T, Hkv, hd), rows permuted
        v = M.linear(params, "attn_v", x).reshape(B, T, hp.n_head_kv, hp.head_dim)  # (B, T, Hkv, hd)
        return q, k, v
