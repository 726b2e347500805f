"""The building blocks of our MoE decoder layers in JAX, float32, as llama.cpp computes them.

Pure functions of arrays: `params` is one layer's tensors keyed by their GGUF
short names (`attn_q.weight`, `ffn_gate_exps.weight`, ...), as
`GGUFModel.layer(i)` returns them. Weight matrices are stored `[out, in]`, so
`x @ W.T` everywhere. Every matmul asks for full float32 precision, so a GPU
does not silently drop to TF32.

Every matrix product's input passes `probe` under the name of the weight it
meets: a no-op unless the runner records activation peaks (`pipeline.model.numerics`).

How a family puts them together (its q/k projections and norms, routing,
shared expert) is in its own file under `pipeline.model.arch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from moeheal.pipeline.model.numerics import PEAK_LAYER, probe

HIGHEST = jax.lax.Precision.HIGHEST
einsum = partial(jnp.einsum, precision=HIGHEST)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x (..., n) scaled to unit RMS, times w (n,)."""
    ms = jnp.mean(x * x, axis=-1, keepdims=True)  # (..., 1)
    return x * jax.lax.rsqrt(ms + eps) * w  # (..., n)


def rope_tables(n_pos: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin of position * frequency for positions 0..n_pos-1: each (T, head_dim/2)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # (hd/2,)
    angles = jnp.arange(n_pos, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NEOX-style rotary embedding (llama.cpp's rope type for qwen2moe, qwen3moe, olmoe): rotate the two halves.

    x (B, T, H, hd); dimension i pairs with i + hd/2.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (B, T, H, hd/2) each
    c, s = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, hd/2)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)  # (B, T, H, hd)


def apply_rope_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """llama.cpp's "normal" rotary embedding (llama, deepseek2): dimension 2i pairs with 2i + 1, at frequency i.

    x (B, T, H, hd), cos/sin (T, hd/2) -> (B, T, H, hd).
    """
    B, T, H, hd = x.shape
    pairs = x.reshape(B, T, H, hd // 2, 2)  # (B, T, H, hd/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # (B, T, H, hd/2) each
    c, s = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, hd/2)
    return jnp.stack([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1).reshape(B, T, H, hd)  # (B, T, H, hd)


def linear(params: dict, name: str, x: jax.Array) -> jax.Array:
    """x (..., d_in) @ W.T (+ bias when the layer has one) -> (..., d_out)."""
    probe(params, f"{name}.weight", x)
    y = einsum("...i,oi->...o", x, params[f"{name}.weight"])  # (..., d_out)
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query softmax attention of rotated heads, concatenated.

    q (B, T, H, hd), k (B, T, Hkv, hd), v (B, T, Hkv, hv) -> (B, T, H*hv); query head h reads KV head
    h // (H/Hkv). Scores are scaled by 1/sqrt(hd); hv may differ from hd (MLA's value heads do).
    """
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    q = q.reshape(B, T, Hkv, H // Hkv, hd)  # (B, T, Hkv, G, hd); head h = kv * G + g
    scores = einsum("btkgh,bskh->bkgts", q, k) / jnp.sqrt(jnp.float32(hd))  # (B, Hkv, G, T, T)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))  # (T, T): query t sees keys s <= t
    scores = jnp.where(causal, scores, -jnp.inf)  # (B, Hkv, G, T, T)
    probs = jax.nn.softmax(scores, axis=-1)  # (B, Hkv, G, T, T)
    return einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, H * v.shape[-1])  # (B, T, H*hv)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """silu(x Wg^T) * (x Wu^T): x (n, d), W (f, d) -> hidden (n, f)."""
    return jax.nn.silu(einsum("nd,fd->nf", x, w_gate)) * einsum("nd,fd->nf", x, w_up)  # (n, f)


def swiglu_ffn(params: dict, prefix: str, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A SwiGLU FFN stored as `ffn_{gate,up,down}{prefix}.weight` (a dense layer's, "", or the
    shared expert's, "_shexp"): x (n, d) -> out (n, d), hidden (n, f); every input probed."""
    for which in ("gate", "up"):
        probe(params, f"ffn_{which}{prefix}.weight", x)
    hidden = swiglu(x, params[f"ffn_gate{prefix}.weight"], params[f"ffn_up{prefix}.weight"])  # (n, f)
    probe(params, f"ffn_down{prefix}.weight", hidden)
    return einsum("nf,df->nd", hidden, params[f"ffn_down{prefix}.weight"]), hidden  # (n, d), (n, f)


_EXPERT_KEYS = {
    "gate": ("ffn_gate_exps.weight", "gate_exps"),
    "up": ("ffn_up_exps.weight", "up_exps"),
    "down": ("ffn_down_exps.weight", "down_exps"),
}
EXPERT_TENSORS = tuple(names[0] for names in _EXPERT_KEYS.values())  # the stacked experts' short names


@partial(jax.tree_util.register_dataclass, data_fields=["blocks", "scales", "codes"], meta_fields=["decode", "shape"])
@dataclass(frozen=True)
class PackedExperts:
    """A stacked expert tensor (E, rows, cols) as its stored blocks, decoded only where a product needs it.

    e2e's tuner passes its quantized experts so: the batched MoE product (`_moe_batched`) then decodes
    just the experts its blocks pick, instead of every expert followed by a one-hot product over the
    decoded matrices (at Qwen3-30B-A3B's width a third of a step's device time). The picked values are
    those of decoding every expert (the same bytes and scales, the scales picked by an exact one-hot
    product), so the forward is bit for bit the same; each block's scale gradient is summed to its
    expert by a one-hot product too (a matmul, not a scatter-add: no atomics, the same bits every run).
    """

    blocks: jax.Array  # (E, n, type_size) uint8: each expert's stored blocks, in the tensor's order
    scales: tuple[jax.Array, ...]  # per fp16 part (E, n, 1): what `decode` tunes the stored scales by
    codes: tuple[jax.Array, ...]  # per tuned code part (E, n, c)
    decode: Callable[..., jax.Array] = field(metadata={"static": True})  # (blocks (m, ts), scales, codes) -> (m, B)
    shape: tuple[int, int, int] = field(metadata={"static": True})  # (E, rows, cols)

    @staticmethod
    def _flat(a: jax.Array) -> jax.Array:
        return a.reshape(-1, a.shape[-1])  # (E*n, ...) or (nB*n, ...)

    def decoded(self) -> jax.Array:
        """Every expert's matrix: (E, rows, cols)."""
        return self.decode(self._flat(self.blocks), [self._flat(u) for u in self.scales],
                           [self._flat(c) for c in self.codes]).reshape(self.shape)

    def picked(self, index: jax.Array, one_hot: jax.Array) -> jax.Array:
        """The matrices of experts `index` (nB,), one_hot (nB, E) their rows: (nB, rows, cols)."""
        blocks = self.blocks[index]  # (nB, n, ts): integers, nothing to differentiate
        scales = [einsum("be,enc->bnc", one_hot, u) for u in self.scales]  # (nB, n, 1) exact copies
        codes = [einsum("be,enc->bnc", one_hot, c) for c in self.codes]  # (nB, n, c)
        values = self.decode(self._flat(blocks), [self._flat(u) for u in scales], [self._flat(c) for c in codes])
        return values.reshape(index.shape[0], *self.shape[1:])  # (nB, rows, cols)


def _expert_matrix(params: dict, which: str) -> jax.Array | PackedExperts:
    """A stacked expert tensor under its GGUF short name or its bare name (gate_exps, ...)."""
    for key in _EXPERT_KEYS[which]:
        if key in params:
            return params[key]
    raise KeyError(f"no {which} expert weights: need one of {_EXPERT_KEYS[which]}")


def block_size_for(n_pairs: int, n_expert: int) -> int:
    """Rows per expert block: about half an expert's mean load, a power of two in [8, 256].

    Each expert's token list is padded to whole blocks, so the padding costs
    at most n_expert * block rows: about half of n_pairs, whatever the balance.
    """
    mean_half = max(1, n_pairs // (2 * n_expert))
    return int(min(256, max(8, 1 << (mean_half - 1).bit_length())))


def expert_blocks(experts_flat: jax.Array, n_expert: int, block: int) -> tuple[jax.Array, jax.Array]:
    """Group (token, choice) pairs by expert into fixed-size blocks, each owned by one expert.

    experts_flat (P,) int32 expert of each pair -> block_expert (nB,), slot_pair (nB*block,)
    where slot_pair holds pair indices and P marks an empty slot. nB = ceil(P/block) + E is
    an upper bound that depends only on shapes, so this jits once per batch shape.
    """
    P = experts_flat.shape[0]
    n_blocks = -(-P // block) + n_expert
    order = jnp.argsort(experts_flat, stable=True)  # (P,) pair indices sorted by expert
    sorted_e = experts_flat[order]  # (P,)
    counts = jnp.bincount(experts_flat, length=n_expert)  # (E,)
    padded = -(-counts // block) * block  # (E,) counts rounded up to whole blocks
    start = jnp.cumsum(counts) - counts  # (E,) first sorted index of each expert
    padded_start = jnp.cumsum(padded) - padded  # (E,) first slot of each expert
    dest = padded_start[sorted_e] + jnp.arange(P) - start[sorted_e]  # (P,) slot of each sorted pair
    slot_pair = jnp.full((n_blocks * block,), P, dtype=jnp.int32).at[dest].set(order.astype(jnp.int32))  # (nB*b,)
    block_end = jnp.cumsum(padded) // block  # (E,) one past each expert's last block
    block_expert = jnp.searchsorted(block_end, jnp.arange(n_blocks), side="right")  # (nB,)
    return jnp.minimum(block_expert, n_expert - 1).astype(jnp.int32), slot_pair


# Mean (token, expert) pairs per expert up to which an accelerator runs the expert blocks as one batched
# product: the scan's hundreds of small programs leave a GPU mostly waiting there (Qwen3-30B-A3B's layer at
# 512 tokens, H100: forward + gradient 3.2x faster batched, 0.63x at 4,096 tokens; the CPU is faster
# with the scan at every load; bench/speed/bench_moe_forward.py).
BATCHED_MAX_LOAD = 64
# The same for `PackedExperts`: no one-hot product over every expert's decoded matrices, so the batched form
# stays ahead of the scan's small programs up to e2e's measurement passes (8 sequences of 512 tokens: a mean
# load of 256 at Qwen3-30B-A3B's 128 experts and top-8).
PACKED_MAX_LOAD = 256
# Expert blocks per product in `_moe_grouped` (an accelerator's forward-only passes over many rows): on an
# H100 at a 30B layer's shape, 64 took the forward 1.58x (65,536 rows) and 1.52x (8,192) as fast as the
# scan, 16 1.34x and 1.31x (bench/results/moe-forward/h100_grouped.txt); a group's matrices are 1.2 GB
# there. Fewer where an expert's three matrices are larger, so that a group's stay within GROUPED_BYTES.
GROUPED_BLOCKS = 64
GROUPED_BYTES = 1.5e9


@jax.jit
def moe_forward(expert_weights: dict, mixed: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Routed-expert output: sum_k weights[n, k] * Expert_{experts[n, k]}(mixed[n]), shared expert excluded.

    expert_weights: `ffn_{gate,up,down}_exps.weight` (or `{gate,up,down}_exps`), gate/up (E, f, d),
    down (E, d, f); mixed (N, d); experts (N, k) int; weights (N, k). Returns yr (N, d).
    Only the routed (token, expert) pairs are computed: pairs are sorted by expert into blocks
    and a scan runs one block (block, d) x (d, f) at a time, indexing that expert's matrices in
    place, so the cost is about N*k/E of a dense pass and no (N, E, ...) tensor is formed.
    On an accelerator, when the experts' mean load is small (`BATCHED_MAX_LOAD`: e2e's steps of one
    512-token sequence; `PACKED_MAX_LOAD` for `PackedExperts`, whose blocks are decoded only where
    picked: e2e's measurements of several sequences too), the blocks run as one batched product
    instead (`_moe_batched`).
    With probes on (`expert_weights` holds PEAK_LAYER), gate/up see all of `mixed` (llama.cpp
    converts the whole batch) and down the largest |hidden| over the routed pairs.
    """
    N, k = experts.shape
    gate = _expert_matrix(expert_weights, "gate")
    n_expert = gate.shape[0]
    most = PACKED_MAX_LOAD if isinstance(gate, PackedExperts) else BATCHED_MAX_LOAD
    if jax.default_backend() != "cpu" and N * k <= most * n_expert and PEAK_LAYER not in expert_weights:
        return _moe_batched(expert_weights, mixed, experts, weights)
    return _moe_scan(expert_weights, mixed, experts, weights)


@jax.jit
def moe_output(expert_weights: dict, mixed: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """`moe_forward` for passes that are never differentiated (calibrate's and the sensitivity measure's
    routed outputs over a layer's dump rows): on an accelerator, above the loads the batched form takes,
    groups of expert blocks as batched products (`_moe_grouped`); elsewhere `moe_forward`, whose scan
    the CPU runs at every load. (N, d) -> yr (N, d)."""
    N, k = experts.shape
    n_expert = _expert_matrix(expert_weights, "gate").shape[0]
    if jax.default_backend() != "cpu" and N * k > BATCHED_MAX_LOAD * n_expert:
        return _moe_grouped(expert_weights, mixed, experts, weights)
    return moe_forward(expert_weights, mixed, experts, weights)


def _moe_batched(expert_weights: dict, mixed: jax.Array, experts: jax.Array, weights: jax.Array,
                 block: int | None = None) -> jax.Array:
    """`moe_forward` as three batched products over all expert blocks of `block` rows (None: about twice
    the mean load, 16 to 128): (N, d) -> yr (N, d).

    Each block's expert matrices are picked by a one-hot product (`PackedExperts`: their blocks decoded,
    their scales picked so), which copies them exactly (1 x w plus
    0 x the others at full precision) and keeps the backward a matrix product: a gather's backward would
    be a scatter-add over repeated experts, whose order (GPU atomics) changes the bits from run to run.
    Every scatter left in the backward writes distinct rows. A token's k outputs are summed over k.
    """
    w_gate, w_up, w_down = (_expert_matrix(expert_weights, w) for w in ("gate", "up", "down"))
    N, d = mixed.shape
    k, n_expert = experts.shape[1], w_gate.shape[0]
    if block is None:
        block = int(min(128, max(16, 1 << (2 * N * k // n_expert - 1).bit_length())))  # about twice the mean load
    block_expert, slot_pair = expert_blocks(experts.reshape(-1).astype(jnp.int32), n_expert, block)  # (nB,), (nB*b,)
    n_blocks = block_expert.shape[0]
    pairs = jnp.broadcast_to(mixed[:, None, :], (N, k, d)).reshape(N * k, d)  # (P, d): each pair's input
    pairs = jnp.concatenate([pairs, jnp.zeros((1, d), mixed.dtype)])  # (P+1, d): row P is the empty slot
    xb = pairs[slot_pair].reshape(n_blocks, block, d)  # (nB, b, d)
    pick = jax.nn.one_hot(block_expert, n_expert, dtype=jnp.float32 if isinstance(w_gate, PackedExperts)
                          else w_gate.dtype)  # (nB, E)
    wg, wu, wd = (w.picked(block_expert, pick) if isinstance(w, PackedExperts) else einsum("be,e...->b...", pick, w)
                  for w in (w_gate, w_up, w_down))  # (nB, f, d) x2, (nB, d, f)
    hidden = jax.nn.silu(einsum("bcd,bfd->bcf", xb, wg)) * einsum("bcd,bfd->bcf", xb, wu)  # (nB, b, f)
    y = einsum("bcf,bdf->bcd", hidden, wd).reshape(n_blocks * block, d)  # (nB*b, d)
    return _tokens_from_slots(y, slot_pair, weights)  # (N, d)


def _tokens_from_slots(y: jax.Array, slot_pair: jax.Array, weights: jax.Array) -> jax.Array:
    """Each token's k pair outputs gathered back from the blocks' slots and summed in k's order, each times
    its routing weight: y (slots, d), slot_pair (slots,) each slot's pair (N * k: empty), weights (N, k) ->
    (N, d). A gather, not a scatter-add onto the tokens: a GPU adds repeated rows with atomics in no fixed
    order. Every pair has a slot; the empty slots all write the one index past the pairs."""
    N, k = weights.shape
    slot = jnp.zeros((N * k + 1,), jnp.int32).at[slot_pair].set(jnp.arange(slot_pair.shape[0], dtype=jnp.int32))
    y_pairs = y[slot[:N * k]].reshape(N, k, y.shape[-1])  # (N, k, d): each pair's output, in the token's order
    return jnp.sum(y_pairs * weights[..., None].astype(jnp.float32), axis=1)  # (N, d)


def _moe_grouped(expert_weights: dict, mixed: jax.Array, experts: jax.Array, weights: jax.Array,
                 group: int | None = None) -> jax.Array:
    """`moe_forward` as a scan over groups of `group` expert blocks, each group three batched products
    (its blocks' expert matrices gathered): (N, d) -> yr (N, d). At a real layer's 65,536 rows the
    scan's thousands of one-block programs leave the device waiting between them; a group's products
    are large enough to keep it busy. Each slot's output is kept in the blocks' order and a token's k
    outputs are gathered back (`_tokens_from_slots`, as `_moe_batched` does). Forward only
    (`moe_output`): the gather's gradient in the weights would add repeated experts' rows with atomics.
    `group` None: GROUPED_BLOCKS, fewer where a group's gathered matrices would pass GROUPED_BYTES."""
    w_gate, w_up, w_down = (_expert_matrix(expert_weights, w) for w in ("gate", "up", "down"))
    N, d = mixed.shape
    k, n_expert = experts.shape[1], w_gate.shape[0]
    if group is None:
        one = sum(math.prod(w.shape[1:]) * w.dtype.itemsize for w in (w_gate, w_up, w_down))  # an expert's, bytes
        group = max(1, min(GROUPED_BLOCKS, int(GROUPED_BYTES // one)))
    block = block_size_for(N * k, n_expert)
    block_expert, slot_pair = expert_blocks(experts.reshape(-1).astype(jnp.int32), n_expert, block)  # (nB,), (nB*b,)
    steps = -(-block_expert.shape[0] // group)
    pad = steps * group - block_expert.shape[0]  # empty blocks of expert 0 complete the last group
    block_expert = jnp.concatenate([block_expert, jnp.zeros((pad,), jnp.int32)])  # (S*G,)
    slot_pair = jnp.concatenate([slot_pair, jnp.full((pad * block,), N * k, jnp.int32)])  # (S*G*b,)
    pair_token = jnp.append(jnp.arange(N * k, dtype=jnp.int32) // k, N)[slot_pair]  # (S*G*b,) N = empty
    x_pad = jnp.concatenate([mixed, jnp.zeros((1, d), mixed.dtype)])  # (N+1, d): row N is the empty slot

    def one_group(_: None, blk: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        e, tok = blk  # (G,), (G, b)
        xb = x_pad[tok]  # (G, b, d)
        hidden = jax.nn.silu(einsum("gbd,gfd->gbf", xb, w_gate[e])) * einsum("gbd,gfd->gbf", xb, w_up[e])  # (G, b, f)
        return None, einsum("gbf,gdf->gbd", hidden, w_down[e])  # (G, b, d)

    _, y = jax.lax.scan(one_group, None, (block_expert.reshape(steps, group),
                                          pair_token.reshape(steps, group, block)))  # (S, G, b, d)
    return _tokens_from_slots(y.reshape(-1, d), slot_pair, weights)  # (N, d)


def _moe_scan(expert_weights: dict, mixed: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """`moe_forward` as a scan over the expert blocks, one (block, d) x (d, f) product at a time."""
    w_gate, w_up, w_down = (_expert_matrix(expert_weights, w) for w in ("gate", "up", "down"))
    w_gate, w_up, w_down = (w.decoded() if isinstance(w, PackedExperts) else w for w in (w_gate, w_up, w_down))
    for which in ("gate", "up"):
        probe(expert_weights, f"ffn_{which}_exps.weight", mixed)
    N, d = mixed.shape
    k = experts.shape[1]
    n_expert = w_gate.shape[0]
    block = block_size_for(N * k, n_expert)
    block_expert, slot_pair = expert_blocks(experts.reshape(-1).astype(jnp.int32), n_expert, block)
    pair_token = jnp.append(jnp.arange(N * k, dtype=jnp.int32) // k, N)[slot_pair]  # (nB*b,) N = empty
    pair_weight = jnp.append(weights.reshape(-1).astype(jnp.float32), 0.0)[slot_pair]  # (nB*b,)
    x_pad = jnp.concatenate([mixed, jnp.zeros((1, d), mixed.dtype)])  # (N+1, d): row N is the empty slot

    probing = PEAK_LAYER in expert_weights  # static under jit: a dict key

    def one_block(carry: tuple[jax.Array, jax.Array],
                  blk: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[tuple[jax.Array, jax.Array], None]:
        yr, peak = carry  # (N+1, d), () the largest |hidden| so far (only updated when probing)
        e, tok, w = blk  # (), (b,), (b,)
        hidden = swiglu(x_pad[tok], w_gate[e], w_up[e])  # (b, f); empty slots read row N: zeros
        y = einsum("bf,df->bd", hidden, w_down[e])  # (b, d)
        if probing:
            peak = jnp.maximum(peak, jnp.max(jnp.abs(hidden)))  # (); NaN propagates
        return (yr.at[tok].add(y * w[:, None]), peak), None  # (N+1, d), ()

    n_blocks = block_expert.shape[0]
    (yr, peak), _ = jax.lax.scan(one_block, (jnp.zeros((N + 1, d), jnp.float32), jnp.float32(0)),
                                 (block_expert, pair_token.reshape(n_blocks, block),
                                  pair_weight.reshape(n_blocks, block)))
    probe(expert_weights, "ffn_down_exps.weight", peak)
    return yr[:N]  # (N, d)


def sigmoid_gated_shared_expert(params: dict, mixed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Shared expert behind a sigmoid gate (Qwen2-MoE's): mixed (N, d) -> out (N, d),
    hh (N, f_s) = silu(gate)*up, gate (N,) = sigmoid(g . mixed). As llama.cpp, the gate multiplies
    the down projection's output, so hh is what that projection's input is."""
    out, hh = swiglu_ffn(params, "_shexp", mixed)  # (N, d), (N, f_s)
    probe(params, "ffn_gate_inp_shexp.weight", mixed)
    gate = jax.nn.sigmoid(einsum("nd,d->n", mixed, params["ffn_gate_inp_shexp.weight"]))  # (N,)
    return out * gate[:, None], hh, gate  # (N, d), (N, f_s), (N,)


@partial(jax.jit, static_argnames="eps")
def final_norm(h: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """h (B, T, d) -> normed (B, T, d), the input of the output projection."""
    return rms_norm(h, w, eps)


@jax.jit
def logits_chunk(x: jax.Array, w_rows: jax.Array) -> jax.Array:
    """x (B, T, d) @ rows of the output matrix (V_chunk, d).T -> (B, T, V_chunk)."""
    return einsum("btd,vd->btv", x, w_rows)

