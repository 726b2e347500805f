"""What a model family is to the pipeline, and the registry of the families we run.

Every family we support is a pre-norm decoder whose feed-forward half is a
Mixture of Experts (after any leading dense SwiGLU layers, `is_moe_layer`):

    h_attn = h + Attention(RMSNorm(h))
    mixed  = RMSNorm(h_attn)                                   (the MoE input)
    h_out  = h_attn + sum_k w_k * Expert_{e_k}(mixed) + Shared(mixed)

with SwiGLU experts stored stacked (`ffn_{gate,up,down}_exps`). Families
differ in how attention projects and normalises q/k (biases, per-head or
whole-vector RMSNorm, DeepSeek's latent attention) and which dimensions RoPE
rotates together, in routing (softmax or sigmoid scores, renormalised top-k or
not, a selection bias and expert groups) and in whether a shared expert, gated or
not, runs beside the routed ones.
An `Architecture` says exactly those things, by its llama.cpp name
(`general.architecture`), so the file reader, the runner and the stages ask
it instead of guessing from tensor names. A family is one file next to this
one; `ARCHITECTURES` finds it by name.

Methods that run on arrays are jitted with the architecture (a singleton,
hashed by identity) and `hp` static, so each family traces its own graph.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels.routing import topk_route
from moeheal.pipeline.model import layers as M
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.model.numerics import CACHE_K, CACHE_V, probe

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import GGUFModel, HParams

GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight")
OPTIONAL_GLOBAL_TENSORS = ("output.weight",)  # absent when the output projection is tied to token_embd
ATTENTION_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
MOE_TENSORS = ("ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
               "ffn_down_exps.weight")
SHARED_EXPERT_TENSORS = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                         "ffn_down_shexp.weight")
DENSE_FFN_TENSORS = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")

# "sigmoid_gated": out * sigmoid(x . ffn_gate_inp_shexp) (Qwen2-MoE); "ungated": out as is (DeepSeek).
SharedExpert = Literal["none", "sigmoid_gated", "ungated"]
SHARED_GATE_TENSORS = {"none": (), "sigmoid_gated": ("ffn_gate_inp_shexp.weight",), "ungated": ()}


class Routing(NamedTuple):
    """How router logits become (experts, weights): scores by `score`, the k best kept, their
    weights renormalised to sum 1 when the file's `expert_weights_norm` says so, else by default."""

    score: Literal["softmax", "sigmoid"]
    norm_topk_default: bool


class Architecture:
    """One MoE family. Subclasses set the class attributes and `project_qkv`; the rest is shared."""

    name: ClassVar[str]  # llama.cpp's `general.architecture`, also the prefix of its keys
    routing: ClassVar[Routing]
    shared_expert: ClassVar[SharedExpert]
    attention_extra_tensors: ClassVar[tuple[str, ...]] = ()  # per-layer tensors beyond ATTENTION_TENSORS
    # The `<arch>.` key that holds a routed expert's FFN width: llama.cpp sizes the expert tensors by it.
    expert_width_key: ClassVar[str] = "expert_feed_forward_length"
    # True: llama.cpp's graph renormalises the top-k weights whatever `<arch>.expert_weights_norm` says,
    # so a file that says otherwise is refused. None: the key is read (default `routing.norm_topk_default`).
    fixed_topk_norm: ClassVar[bool | None] = None
    router_extra_tensors: ClassVar[tuple[str, ...]] = ()  # per-MoE-layer tensors the routing reads beyond the router
    # Whether attention is the standard q/k/v/output one that `pipeline.model.roles` measures and a budget over
    # every role ("all") may choose formats for.
    standard_attention: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<architecture {self.name}>"

    # ---- what the file holds ----------------------------------------------

    @property
    def has_shared_expert(self) -> bool:
        """Whether a shared expert runs beside the routed ones; healing fits a ridge through it."""
        return self.shared_expert != "none"

    @property
    def supports_moce(self) -> bool:
        """Whether cache-aware routing (`kernels.moce`, softmax scores of the router logits alone)
        reproduces this family's routing at bonus 0."""
        return self.routing.score == "softmax" and not self.router_extra_tensors

    def is_moe_layer(self, layer: int, hp: HParams) -> bool:
        """Whether `layer`'s feed-forward half is a Mixture of Experts: all but the file's leading
        dense layers (`leading_dense_block_count`, 0 in the families without any). The one rule
        every stage that walks layers asks, through `moe_layers`."""
        return layer >= hp.n_dense_lead

    def moe_layers(self, hp: HParams) -> tuple[int, ...]:
        """The MoE layers' indices in order: the layers routed-expert work (dump, quantize, heal) visits."""
        return tuple(i for i in range(hp.n_layer) if self.is_moe_layer(i, hp))

    def layer_tensors(self, layer: int, hp: HParams) -> tuple[str, ...]:
        """Short names of the tensors `blk.{layer}` must hold, and no others."""
        return self.attention_layer_tensors(hp) + self.ffn_layer_tensors(layer, hp)

    def attention_layer_tensors(self, hp: HParams) -> tuple[str, ...]:
        """Short names of the attention tensors every layer holds."""
        return ATTENTION_TENSORS + self.attention_extra_tensors

    def ffn_layer_tensors(self, layer: int, hp: HParams) -> tuple[str, ...]:
        """Short names of `blk.{layer}`'s feed-forward tensors: the MoE's, or a dense layer's FFN."""
        if not self.is_moe_layer(layer, hp):
            return DENSE_FFN_TENSORS
        shared = self.shared_gate_tensors + SHARED_EXPERT_TENSORS[1:]  # its gate's (if any), gate/up/down
        return MOE_TENSORS + self.router_extra_tensors + (shared if self.has_shared_expert else ())

    def read_hparams(self, model: GGUFModel) -> dict[str, Any]:
        """The HParams fields the family's attention sets: n_head, n_head_kv, head_dim (and its own,
        validated here: an InputError naming the file and key), from `model`'s keys and its query
        projection (`query_projection`)."""
        a = self.name
        n_head = int(model._required_key(f"{a}.attention.head_count"))
        q_name, q_per_dim = self.query_projection(model)
        q_rows = model.shape(q_name)[0] // q_per_dim  # n_head * head_dim
        if q_rows % n_head:
            raise InputError(f"{model.name}: key {a}.attention.head_count: {n_head} does not divide the "
                             f"{q_rows} rows of {q_name}")
        n_head_kv = int(model.metadata(f"{a}.attention.head_count_kv", n_head))
        if n_head % n_head_kv:
            raise InputError(f"{model.name}: key {a}.attention.head_count_kv: {n_head_kv} does not divide "
                             f"head_count {n_head}")
        return {"n_head": n_head, "n_head_kv": n_head_kv,
                "head_dim": int(model.metadata(f"{a}.attention.key_length", q_rows // n_head))}

    def attention_extra_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        """NumPy shapes of `attention_extra_tensors`, as the hyperparameters imply them (an entry
        here also replaces the common expectation of a tensor of the same name)."""
        return {}

    # ---- what the file's keys say (read before the tensor table is checked) --

    def query_projection(self, model: GGUFModel) -> tuple[str, int]:
        """(tensor, rows per query head dimension): the projection whose rows are
        n_head * head_dim times the second value; blk.0's attn_q by default."""
        return "blk.0.attn_q.weight", 1

    # ---- attention --------------------------------------------------------

    def rope_tables(self, n_pos: int, hp: HParams) -> tuple[jax.Array, jax.Array]:
        """cos/sin tables for positions 0..n_pos-1, (T, rotated dims / 2) each, as `attention_block` uses them."""
        return M.rope_tables(n_pos, hp.head_dim, hp.rope_theta)

    def layer_attention_block(self, layer: int, params: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
                              hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """`attention_block` of layer `layer`; a family whose layers differ (linear-attention
        layers, say) chooses here, by layer index, which jitted block runs."""
        return self.attention_block(params, h, cos, sin, hp)

    def apply_rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Rotary embedding of projected heads, x (B, T, H, hd) -> (B, T, H, hd): NEOX's halves here,
        as llama.cpp runs qwen2moe, qwen3moe and olmoe; a family whose file pairs dimensions otherwise
        overrides it."""
        return M.apply_rope(x, cos, sin)

    def project_qkv(self, params: dict, x: jax.Array,
                    hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (B, T, d) normed input -> q (B, T, H, hd), k (B, T, Hkv, hd), v (B, T, Hkv, hd), before RoPE."""
        raise NotImplementedError

    @partial(jax.jit, static_argnames=("self", "hp"))
    def attention_heads(self, params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, hp: HParams) -> jax.Array:
        """Causal grouped-query self-attention up to the heads' concatenated outputs, the input of
        `attn_output`. x (B, T, d) normed input -> (B, T, H*hd)."""
        q, k, v = self.project_qkv(params, x, hp)  # (B, T, H, hd), (B, T, Hkv, hd) x2
        q, k = self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)  # the family's rotation, shapes kept
        probe(params, CACHE_K, k)  # llama.cpp's KV cache holds the rotated keys
        probe(params, CACHE_V, v)
        return M.causal_attention(q, k, v)  # (B, T, H*hd)

    @partial(jax.jit, static_argnames=("self", "hp"))
    def attention(self, params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, hp: HParams) -> jax.Array:
        """Causal self-attention with its output projection. x (B, T, d) normed input -> (B, T, d)."""
        return M.linear(params, "attn_output", self.attention_heads(params, x, cos, sin, hp))  # (B, T, d)

    @partial(jax.jit, static_argnames=("self", "hp"))
    def attention_block(self, params: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
                        hp: HParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Residual attention, then the MoE input and router logits.

        h (B, T, d) -> h_attn (B, T, d), attn_in (B, T, d) the attention's normed input,
        mixed (B, T, d), router_logits (B, T, E).
        """
        attn_in = M.rms_norm(h, params["attn_norm.weight"], hp.rms_eps)  # (B, T, d)
        h_attn = h + self.attention(params, attn_in, cos, sin, hp)  # (B, T, d)
        mixed = M.rms_norm(h_attn, params["ffn_norm.weight"], hp.rms_eps)  # (B, T, d)
        if "ffn_gate_inp.weight" not in params:  # a dense layer: no router (static under jit: dict keys)
            return h_attn, attn_in, mixed, jnp.zeros(mixed.shape[:2] + (0,), jnp.float32)  # (B, T, 0)
        probe(params, "ffn_gate_inp.weight", mixed)
        router_logits = M.einsum("btd,ed->bte", mixed, params["ffn_gate_inp.weight"])  # (B, T, E)
        return h_attn, attn_in, mixed, router_logits

    @partial(jax.jit, static_argnames="self")
    def dense_ffn_block(self, params: dict, h_attn: jax.Array, mixed: jax.Array) -> jax.Array:
        """A dense layer's feed-forward half, a SwiGLU FFN: h_attn, mixed (B, T, d) -> h_out (B, T, d)."""
        B, T, d = mixed.shape
        out, _ = M.swiglu_ffn(params, "", mixed.reshape(B * T, d))  # (N, d), (N, f)
        return h_attn + out.reshape(B, T, d)  # (B, T, d)

    # ---- routing and experts ----------------------------------------------

    def route_layer(self, params: dict, router_logits: jax.Array, hp: HParams) -> tuple[jax.Array, jax.Array]:
        """A MoE layer's routing from its tensors (`params`, for a family whose routing reads more than
        the router logits) and router_logits (B, T, E) -> experts (B, T, k) int32, weights (B, T, k)."""
        return self.route(router_logits, hp.n_expert_used, hp.norm_topk_prob)

    def route(self, router_logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
        """router_logits (..., E) -> experts (..., k) int32, weights (..., k)."""
        if self.routing.score == "softmax":
            return topk_route(router_logits, k, norm_topk_prob)
        return sigmoid_topk_route(router_logits, k, norm_topk_prob)

    @property
    def shared_gate_tensors(self) -> tuple[str, ...]:
        """Short names of the tensors `shared_expert_gate` reads (none for an ungated shared expert)."""
        return SHARED_GATE_TENSORS[self.shared_expert]

    def shared_expert_gate(self, params: dict, mixed: np.ndarray) -> np.ndarray:
        """The shared expert's output multiplier per token, in NumPy (healing's ridge reads it on
        dumped rows): mixed (N, d) -> (N,), its sigmoid gate, or ones (ungated, or none)."""
        if self.shared_expert == "sigmoid_gated":
            return 1.0 / (1.0 + np.exp(-(mixed @ params["ffn_gate_inp_shexp.weight"].reshape(-1))))  # (N,)
        return np.ones(len(mixed), np.float32)  # (N,)

    @partial(jax.jit, static_argnames="self")
    def shared_expert_forward(self, params: dict, mixed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The shared expert on mixed (N, d): out (N, d), hh (N, f_s) its hidden silu(gate)*up,
        gate (N,) its sigmoid gate, ones when ungated. Without one: out zeros, hh (N, 0), gate ones."""
        if self.shared_expert == "sigmoid_gated":
            return M.sigmoid_gated_shared_expert(params, mixed)
        N, d = mixed.shape
        gate = jnp.ones((N,), jnp.float32)  # (N,)
        if self.shared_expert == "ungated":
            out, hh = M.swiglu_ffn(params, "_shexp", mixed)  # (N, d), (N, f_s)
            return out, hh, gate  # (N, d), (N, f_s), (N,)
        return jnp.zeros((N, d), jnp.float32), jnp.zeros((N, 0), jnp.float32), gate

    @partial(jax.jit, static_argnames="self")
    def moe_block(self, params: dict, h_attn: jax.Array, mixed: jax.Array, experts: jax.Array,
                  weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The layer's MoE half from given routing.

        h_attn, mixed (B, T, d); experts, weights (B, T, k) ->
        h_out (B, T, d), yr (B, T, d) routed output, hh (B, T, f_s), shexp_gate (B, T).
        """
        B, T, d = mixed.shape
        flat = mixed.reshape(B * T, d)  # (N, d)
        yr = M.moe_forward(params, flat, experts.reshape(B * T, -1), weights.reshape(B * T, -1))  # (N, d)
        shared, hh, gate = self.shared_expert_forward(params, flat)  # (N, d), (N, f_s), (N,)
        h_out = h_attn + (yr + shared).reshape(B, T, d)  # (B, T, d)
        return h_out, yr.reshape(B, T, d), hh.reshape(B, T, -1), gate.reshape(B, T)


def sigmoid_topk_route(router_logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Sigmoid scores, the k highest, optionally renormalised: (..., E) -> experts (..., k), weights (..., k)."""
    scores = jax.nn.sigmoid(router_logits)  # (..., E)
    weights, experts = jax.lax.top_k(scores, k)  # (..., k) each
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)  # (..., k)
    return experts.astype(jnp.int32), weights


ARCHITECTURES: dict[str, Architecture] = {}


def register(family: type[Architecture]) -> type[Architecture]:
    """Add one instance of `family` to `ARCHITECTURES` under its llama.cpp name."""
    ARCHITECTURES[family.name] = family()
    return family
