"""Qwen3-Next (llama.cpp `qwen3next`): a hybrid of gated full attention and gated DeltaNet linear
attention, with Qwen2-MoE's sigmoid-gated shared expert and renormalised softmax top-k routing.

Every `full_attention_interval`-th layer (1-based; the file's `attention.recurrent_layers` says
which, when present) is full attention; the others are linear attention:

    full:   [q | gate] = x Wq per head; q, k RMS-normed per head; RoPE on the first `rope_dim`
            dims of each head; o = softmax attention * sigmoid(gate); out = o Wo
    linear: qkv = x Wqkv, z = x Wgate, [b | a] = x Wba per key head;
            qkv = silu(causal depthwise conv(qkv)); q, k L2-normed; beta = sigmoid(b);
            g = softplus(a + dt_bias) * ssm_a (ssm_a = -exp(A_log), baked in by the converter);
            S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T;  o_t = S_t^T q_t / sqrt(dk)
            out = (RMSNorm(o) * silu(z)) Wout

Then, in every layer, the MoE half reads `post_attention_norm` (llama.cpp's name for
post_attention_layernorm in this family) instead of `ffn_norm`. Norm weights are stored with
transformers' zero-centred `1 + w` already added (the gated RMSNorm's weight is not zero-centred
and is stored as is). Sequences start at position 0 with a zero conv state and a zero delta-rule
state, as llama.cpp starts a fresh sequence.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from moeheal.pipeline.model import layers as M
from moeheal.pipeline.model.arch.base import MOE_TENSORS, SHARED_EXPERT_TENSORS, Architecture, Routing, register
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.model.numerics import CACHE_K, CACHE_V, probe

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import GGUFModel, HParams

COMMON_TENSORS = ("attn_norm.weight", "post_attention_norm.weight")
FULL_ATTENTION_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                          "attn_q_norm.weight", "attn_k_norm.weight")
LINEAR_ATTENTION_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                            "ssm_ba.weight", "ssm_norm.weight", "ssm_out.weight")
FFN_TENSORS = tuple(t for t in MOE_TENSORS if t != "ffn_norm.weight") + SHARED_EXPERT_TENSORS
SSM_KEYS = {"ssm_conv_kernel": "ssm.conv_kernel", "ssm_state_size": "ssm.state_size",
            "ssm_group_count": "ssm.group_count", "ssm_time_step_rank": "ssm.time_step_rank",
            "ssm_inner_size": "ssm.inner_size"}


def recurrent_layers(model: GGUFModel) -> tuple[bool, ...]:
    """Per layer, whether it is linear attention: `attention.recurrent_layers` when the file has it,
    else every layer but each `full_attention_interval`-th (default 4), as llama.cpp's loader reads it.
    A file with the multi-token-prediction block llama.cpp's converter appends by default is refused:
    its extra layer is no decoder layer of the forward pass."""
    n_layer = int(model.metadata("qwen3next.block_count"))
    nextn = model.metadata("qwen3next.nextn_predict_layers", 0)
    if nextn:
        raise InputError(f"{model.name}: key qwen3next.nextn_predict_layers: {nextn} multi-token-prediction "
                         "layer(s) are not supported (llama.cpp's converter leaves them out with --no-mtp)")
    key = "qwen3next.attention.recurrent_layers"
    flags = model.metadata(key)
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != n_layer or not all(isinstance(f, bool) for f in flags):
            raise InputError(f"{model.name}: key {key}: need {n_layer} booleans, got {flags!r:.80}")
        layers = tuple(flags)
    else:
        key = "qwen3next.full_attention_interval"  # in [1, 4096]: GGUFModel checked its range
        interval = int(model.metadata(key, 4))
        layers = tuple((i + 1) % interval != 0 for i in range(n_layer))
    if all(layers):
        raise InputError(f"{model.name}: key {key}: no full-attention layer (qwen3next needs at least one)")
    return layers


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """x (..., n) / sqrt(sum x^2 + eps): llama.cpp's (and the FLA kernels') L2 norm of q and k."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)  # (..., n)


def partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NEOX rotation of the first 2 * cos.shape[-1] dims of each head, the rest unchanged.
    x (B, T, H, hd), cos/sin (T, r/2) -> (B, T, H, hd)."""
    r = 2 * cos.shape[-1]
    return jnp.concatenate([M.apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)  # (B, T, H, hd)


def causal_conv(x: jax.Array, w: jax.Array) -> jax.Array:
    """Causal depthwise convolution from a zero state, then silu: x (B, T, C), w (C, K) -> (B, T, C);
    out[t] = silu(sum_j w[:, j] * x[t - K + 1 + j])."""
    T, K = x.shape[1], w.shape[1]
    padded = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0)))  # (B, T+K-1, C): K-1 zero steps of state
    out = sum(padded[:, j:j + T] * w[:, j] for j in range(K))  # (B, T, C)
    return jax.nn.silu(out)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array) -> jax.Array:
    """The gated delta rule from a zero state, one position at a time (a scan over T), float32.

    q, k (B, T, Hv, dk) (q already scaled); v (B, T, Hv, dv); g, beta (B, T, Hv) -> o (B, T, Hv, dv).
    """
    B, _, Hv, dk = k.shape
    dv = v.shape[-1]

    def step(S: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = xs  # (B, Hv, dk) x2, (B, Hv, dv), (B, Hv) x2
        S = S * jnp.exp(g_t)[..., None, None]  # (B, Hv, dk, dv): decayed state
        recalled = M.einsum("bhkv,bhk->bhv", S, k_t)  # (B, Hv, dv): what the state stores under k_t
        delta = (v_t - recalled) * b_t[..., None]  # (B, Hv, dv)
        S = S + M.einsum("bhk,bhv->bhkv", k_t, delta)  # (B, Hv, dk, dv)
        return S, M.einsum("bhkv,bhk->bhv", S, q_t)  # (B, Hv, dv)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)]  # (T, B, ...) each
    _, o = jax.lax.scan(step, jnp.zeros((B, Hv, dk, dv), jnp.float32), time_major)  # o (T, B, Hv, dv)
    return jnp.moveaxis(o, 0, 1)  # (B, T, Hv, dv)


@register
class Qwen3Next(Architecture):
    name = "qwen3next"
    routing = Routing(score="softmax", norm_topk_default=True)  # llama.cpp's graph always renormalises
    shared_expert = "sigmoid_gated"
    standard_attention = False  # the roles' attention code assumes ungated full attention in every layer

    # ---- what the file holds ----------------------------------------------

    def read_hparams(self, model: GGUFModel) -> dict[str, Any]:
        a = self.name
        extra: dict[str, Any] = super().read_hparams(model)
        for field, key in SSM_KEYS.items():
            value = model.metadata(f"{a}.{key}")
            if value is None:
                raise InputError(f"{model.name}: key {a}.{key}: missing")
            extra[field] = int(value)
        nk, nv, dk = extra["ssm_group_count"], extra["ssm_time_step_rank"], extra["ssm_state_size"]
        if nv % nk:
            raise InputError(f"{model.name}: key {a}.ssm.group_count: {nk} does not divide "
                             f"ssm.time_step_rank {nv}")
        if extra["ssm_inner_size"] != nv * dk:
            raise InputError(f"{model.name}: key {a}.ssm.inner_size: {extra['ssm_inner_size']}, expected "
                             f"ssm.time_step_rank x ssm.state_size = {nv * dk} (llama.cpp's value heads are "
                             "as wide as its key heads)")
        head_dim = int(model.metadata(f"{a}.attention.key_length", 0)) or None
        rope_dim = int(model.metadata(f"{a}.rope.dimension_count", 0))
        if rope_dim % 2 or (head_dim and rope_dim > head_dim):
            raise InputError(f"{model.name}: key {a}.rope.dimension_count: {rope_dim} is not an even number "
                             f"of a head's {head_dim} dimensions")
        extra["rope_dim"] = rope_dim
        extra["recurrent_layers"] = recurrent_layers(model)
        return extra

    def layer_tensors(self, layer: int, hp: HParams) -> tuple[str, ...]:
        attention = LINEAR_ATTENTION_TENSORS if hp.recurrent_layers[layer] else FULL_ATTENTION_TENSORS
        return COMMON_TENSORS + attention + FFN_TENSORS

    def query_projection(self, model: GGUFModel) -> tuple[str, int]:
        return f"blk.{recurrent_layers(model).index(False)}.attn_q.weight", 2  # rows: [query | gate] per head

    def attention_extra_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        d, hd = hp.d_model, hp.head_dim
        key_dim, value_dim = hp.ssm_group_count * hp.ssm_state_size, hp.ssm_inner_size
        conv_dim = 2 * key_dim + value_dim
        return {"post_attention_norm.weight": (d,), "attn_q.weight": (2 * hp.n_head * hd, d),
                "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
                "attn_qkv.weight": (conv_dim, d), "attn_gate.weight": (value_dim, d),
                "ssm_conv1d.weight": (conv_dim, hp.ssm_conv_kernel), "ssm_dt.bias": (hp.ssm_time_step_rank,),
                "ssm_a": (hp.ssm_time_step_rank,), "ssm_ba.weight": (2 * hp.ssm_time_step_rank, d),
                "ssm_norm.weight": (hp.ssm_state_size,), "ssm_out.weight": (d, value_dim)}

    # ---- attention --------------------------------------------------------

    def rope_tables(self, n_pos: int, hp: HParams) -> tuple[jax.Array, jax.Array]:
        return M.rope_tables(n_pos, hp.rope_dim or hp.head_dim, hp.rope_theta)  # (T, rope_dim/2) each

    def layer_attention_block(self, layer: int, params: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
                              hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        if hp.recurrent_layers[layer]:
            return self.linear_attention_block(params, h, hp)
        return self.attention_block(params, h, cos, sin, hp)

    @partial(jax.jit, static_argnames=("self", "hp"))
    def attention_heads(self, params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, hp: HParams) -> jax.Array:
        """Gated full attention up to the input of `attn_output`. x (B, T, d) normed -> (B, T, H*hd)."""
        B, T, _ = x.shape
        H, Hkv, hd = hp.n_head, hp.n_head_kv, hp.head_dim
        qg = M.linear(params, "attn_q", x).reshape(B, T, H, 2 * hd)  # (B, T, H, 2hd): [query | gate] per head
        q, gate = qg[..., :hd], qg[..., hd:]  # (B, T, H, hd) each
        k = M.linear(params, "attn_k", x).reshape(B, T, Hkv, hd)  # (B, T, Hkv, hd)
        v = M.linear(params, "attn_v", x).reshape(B, T, Hkv, hd)  # (B, T, Hkv, hd)
        q = partial_rope(M.rms_norm(q, params["attn_q_norm.weight"], hp.rms_eps), cos, sin)  # (B, T, H, hd)
        k = partial_rope(M.rms_norm(k, params["attn_k_norm.weight"], hp.rms_eps), cos, sin)  # (B, T, Hkv, hd)
        probe(params, CACHE_K, k)  # llama.cpp's KV cache holds the rotated keys
        probe(params, CACHE_V, v)
        return M.causal_attention(q, k, v) * jax.nn.sigmoid(gate.reshape(B, T, H * hd))  # (B, T, H*hd)

    def _moe_input(self, params: dict, h_attn: jax.Array, attn_in: jax.Array,
                   hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The block's outputs once h_attn (B, T, d) is known: post_attention_norm, then the router."""
        mixed = M.rms_norm(h_attn, params["post_attention_norm.weight"], hp.rms_eps)  # (B, T, d)
        probe(params, "ffn_gate_inp.weight", mixed)
        router_logits = M.einsum("btd,ed->bte", mixed, params["ffn_gate_inp.weight"])  # (B, T, E)
        return h_attn, attn_in, mixed, router_logits

    @partial(jax.jit, static_argnames=("self", "hp"))
    def attention_block(self, params: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
                        hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """A full-attention layer's residual attention, MoE input and router logits (as the base's)."""
        attn_in = M.rms_norm(h, params["attn_norm.weight"], hp.rms_eps)  # (B, T, d)
        h_attn = h + self.attention(params, attn_in, cos, sin, hp)  # (B, T, d)
        return self._moe_input(params, h_attn, attn_in, hp)

    @partial(jax.jit, static_argnames=("self", "hp"))
    def linear_attention(self, params: dict, x: jax.Array, hp: HParams) -> jax.Array:
        """Gated DeltaNet with its output projection. x (B, T, d) normed -> (B, T, d)."""
        B, T, _ = x.shape
        nk, nv, dk = hp.ssm_group_count, hp.ssm_time_step_rank, hp.ssm_state_size
        r, dv = nv // nk, hp.ssm_inner_size // nv
        qkv = causal_conv(M.linear(params, "attn_qkv", x), params["ssm_conv1d.weight"])  # (B, T, 2nk*dk + nv*dv)
        q = l2_norm(qkv[..., :nk * dk].reshape(B, T, nk, dk), hp.rms_eps)  # (B, T, nk, dk)
        k = l2_norm(qkv[..., nk * dk:2 * nk * dk].reshape(B, T, nk, dk), hp.rms_eps)  # (B, T, nk, dk)
        v = qkv[..., 2 * nk * dk:].reshape(B, T, nv, dv)  # (B, T, nv, dv); value head j reads key head j // r
        q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)  # (B, T, nv, dk) each
        ba = M.linear(params, "ssm_ba", x).reshape(B, T, nk, 2 * r)  # (B, T, nk, 2r): [b | a] per key head
        beta = jax.nn.sigmoid(ba[..., :r].reshape(B, T, nv))  # (B, T, nv)
        g = jax.nn.softplus(ba[..., r:].reshape(B, T, nv) + params["ssm_dt.bias"]) * params["ssm_a"]  # (B, T, nv) <= 0
        o = gated_delta_rule(q / jnp.sqrt(jnp.float32(dk)), k, v, g, beta)  # (B, T, nv, dv)
        z = M.linear(params, "attn_gate", x).reshape(B, T, nv, dv)  # (B, T, nv, dv)
        o = M.rms_norm(o, params["ssm_norm.weight"], hp.rms_eps) * jax.nn.silu(z)  # (B, T, nv, dv)
        return M.linear(params, "ssm_out", o.reshape(B, T, nv * dv))  # (B, T, d)

    @partial(jax.jit, static_argnames=("self", "hp"))
    def linear_attention_block(self, params: dict, h: jax.Array,
                               hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """A linear-attention layer's residual DeltaNet, MoE input and router logits."""
        attn_in = M.rms_norm(h, params["attn_norm.weight"], hp.rms_eps)  # (B, T, d)
        h_attn = h + self.linear_attention(params, attn_in, hp)  # (B, T, d)
        return self._moe_input(params, h_attn, attn_in, hp)
