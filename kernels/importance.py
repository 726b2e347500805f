"""Activation-importance weights and per-expert Hessians for quantizing experts.

Quantizing a weight row w to w + dw changes a linear layer's output by dw . x,
whose mean square is dw^T E[x x^T] dw. Keeping only the diagonal, the error of
element j costs E[x_j^2] dw_j^2: E[x_j^2] is the diagonal-Hessian-optimal
weight on squared weight error (beta = 1). We use E[x_j^2]^beta and call beta
a tempering exponent: beta = 0.5 weights by the input RMS, beta = 0 is plain
least squares. The same beta convention holds for gate/up (input: the MoE
input x) and for down (input: the expert's hidden activation h), so
`beta_gate_up = beta_down` means the same thing on both.

An expert's rounding error costs it through its own inputs: over the tokens
routed to e, sum_t (dw . x_t)^2 = dw^T H_e dw with H_e = sum_{t->e} x_t x_t^T,
so the diagonal weight is expert e's E[x_j^2], not the layer's (llama.cpp's
imatrix stores the same per-expert statistic). Routing specialises: an
expert that serves code tokens sees other channel magnitudes than one that
serves prose. An expert sees only the tokens routed to it, often a few dozen,
so its estimate is blended with a prior worth `blend_tokens` pseudo-tokens
(`blended_second_moment`): for gate/up the layer's E[x_j^2] over every token,
for W_down, whose input is h_c = silu(g_c) * u_c with g = W_gate x, u = W_up x,
an analytic prior from the layer's diagonal input statistics. Thinly routed
experts still get a sane weight, well-fed ones their own.

GPTQ Hessians may be router-weighted: a token contributes to expert e's
H = E[x x^T] (and to down's E[h h^T]) in proportion to its routing weight w_te,
the factor by which e's output enters the layer's output, so tokens that e
barely serves cost less of its rounding budget. (The layer's output error
scales with w_te^2; weighting by w_te is the milder, tempered choice.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels.gptq import damp_hessian

# Importance below this fraction of the mean is raised to it: a dimension that
# never fired in calibration still deserves a nonzero (tiny) weight, and the
# floor is relative so it does not depend on the activation scale.
RELATIVE_FLOOR = 1e-8

# Gauss-Hermite nodes for E[f(g)], g ~ N(0, s^2). silu(g)^2 = g^2 sigmoid(g)^2
# is analytic but sigmoid has poles at g = +-i*pi, which come close to the real
# axis in units of s when s is large. Measured against scipy.integrate.quad:
# relative error < 1e-11 for s <= 1.5, < 3e-4 for any s up to 100: far below
# what a tempered, blended prior needs.
_GH_NODES, _GH_WEIGHTS = np.polynomial.hermite.hermgauss(64)


def _tempered_mean_one(second_moment: np.ndarray, beta: float) -> np.ndarray:
    """max(m, floor)^beta normalised to mean 1 along the last axis; all-zero rows give ones."""
    m = np.asarray(second_moment, dtype=np.float64)  # (..., n)
    mean = np.mean(m, axis=-1, keepdims=True)  # (..., 1)
    floored = np.maximum(m, RELATIVE_FLOOR * mean)  # (..., n)
    tempered = np.where(mean > 0, floored, 1.0) ** beta  # (..., n)
    return (tempered / np.mean(tempered, axis=-1, keepdims=True)).astype(np.float32)  # (..., n)


def gate_up_importance(mean_sq_x: np.ndarray, beta: float) -> np.ndarray:
    """Per input-column weight of a matrix that every token reaches: w_j = E[x_j^2]^beta, mean 1.

    mean_sq_x (..., d) = E[x_j^2] over the calibration tokens (the diagonal
    of E[x x^T]). Values below RELATIVE_FLOOR * mean are floored first.
    """
    return _tempered_mean_one(mean_sq_x, beta)  # (..., d)


def blended_second_moment(exact_sum: np.ndarray, counts: np.ndarray, prior: np.ndarray,
                          blend_tokens: float) -> np.ndarray:
    """Per-expert E[v_j^2] with a prior worth `blend_tokens` pseudo-tokens (the posterior mean):

        m[e, j] = (exact_sum[e, j] + blend_tokens * prior[e, j]) / (counts[e] + blend_tokens)

    An expert with no routed tokens gets the prior; one with many its own data.
    exact_sum (E, n) sums of v^2 over e's routed tokens, counts (E,), prior
    (E, n) or (n,) -> (E, n) float64.
    """
    exact = np.asarray(exact_sum, dtype=np.float64)  # (E, n)
    prior = np.broadcast_to(np.asarray(prior, dtype=np.float64), exact.shape)  # (E, n)
    n = np.asarray(counts, dtype=np.float64)[:, None]  # (E, 1)
    denominator = n + blend_tokens  # (E, 1)
    safe = np.where(denominator > 0, denominator, 1.0)  # (E, 1)
    return np.where(denominator > 0, (exact + blend_tokens * prior) / safe, prior)  # (E, n)


def expert_gate_up_importance(sum_x_sq: np.ndarray, counts: np.ndarray, mean_sq_x: np.ndarray,
                              blend_tokens: float, beta: float) -> np.ndarray:
    """Per input-column weight for W_gate / W_up of every expert: (E, d), mean 1 per expert.

    w[e, j] = m[e, j]^beta with m expert e's E[x_j^2] over its routed tokens,
    blended with the layer's E[x_j^2] (mean_sq_x (d,), every token) by
    `blend_tokens` pseudo-tokens (`blended_second_moment`). sum_x_sq (E, d)
    and counts (E,) from `expert_hidden_stats`.
    """
    return gate_up_importance(blended_second_moment(sum_x_sq, counts, mean_sq_x, blend_tokens), beta)  # (E, d)


@dataclass(frozen=True)
class ExpertStats:
    """Per-expert sufficient statistics of one layer, additive over token chunks.

    Sums run over the (token, expert) pairs of the routing: expert e sees the
    tokens routed to it, x its MoE input and h = silu(W_gate[e] x) * (W_up[e] x).
    counts (E,): tokens routed to e.
    sum_x_sq (E, d): sum of x_j^2 (gate/up importance per expert, llama.cpp imatrix).
    sum_h_sq (E, f): sum of h_c^2 (down importance).
    sum_xx_t (E, d, d), sum_hh_t (E, f, f): sums of x x^T and h h^T (GPTQ
    Hessians of gate/up and of down), None unless requested; with routing
    weights, sums of w x x^T and w h h^T. They stay on the device that summed
    them (``jax.Array``): at a real layer they are GBs that only device code
    (`pooled_second_moment`, `expert_hessians`, GPTQ) reads.
    weight_sums (E,): sum of the routing weights w of e's pairs, the normaliser
    of the weighted Hessian sums (see `hessian_mass`); None when unweighted.
    The diagonal sums stay unweighted either way: they feed importance (and the
    llama.cpp imatrix), a separate knob, so router weighting changes only H.
    """

    counts: np.ndarray
    sum_x_sq: np.ndarray
    sum_h_sq: np.ndarray
    sum_xx_t: jax.Array | None
    sum_hh_t: jax.Array | None
    weight_sums: np.ndarray | None = None

    def __add__(self, other: ExpertStats) -> ExpertStats:
        def add(a: np.ndarray | jax.Array | None, b: np.ndarray | jax.Array | None) -> np.ndarray | jax.Array | None:
            return a + b if a is not None and b is not None else None

        if (self.weight_sums is None) != (other.weight_sums is None):
            # the Hessian sums of the two would mix weighted and unweighted rows
            raise ValueError("cannot add router-weighted and unweighted expert statistics")
        return ExpertStats(
            counts=self.counts + other.counts,
            sum_x_sq=self.sum_x_sq + other.sum_x_sq,
            sum_h_sq=self.sum_h_sq + other.sum_h_sq,
            sum_xx_t=add(self.sum_xx_t, other.sum_xx_t),
            sum_hh_t=add(self.sum_hh_t, other.sum_hh_t),
            weight_sums=add(self.weight_sums, other.weight_sums),
        )


def _expert_blocks(
    experts: np.ndarray,
    n_expert: int,
    block_tokens: int,
    block_multiple: int = 16,
    pair_weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Group routed (token, expert) pairs into fixed-size single-expert blocks.

    Returns block_expert (nb,), block_rows (nb, bt) token indices, block_valid
    (nb, bt) and block_weight (nb, bt): each pair's weight in the Hessian sums,
    its routing weight from `pair_weights` (N, k) if given, else 1; 0 on padding.
    Each expert's tokens fill ceil(n_e / bt) blocks, the last one padded; nb is
    rounded up to a multiple of `block_multiple` with empty blocks so that
    chunks of similar size reuse one compiled scan.
    """
    n_tokens, k = experts.shape
    flat_expert = experts.reshape(-1).astype(np.int64)  # (N*k,)
    flat_weight = (np.ones(n_tokens * k, np.float32) if pair_weights is None
                   else np.asarray(pair_weights, np.float32).reshape(-1))  # (N*k,)
    flat_token = np.repeat(np.arange(n_tokens), k)  # (N*k,)
    order = np.argsort(flat_expert, kind="stable")  # (N*k,)
    sorted_expert, sorted_token = flat_expert[order], flat_token[order]  # (N*k,)
    counts = np.bincount(flat_expert, minlength=n_expert)  # (E,)
    blocks_per_expert = -(-counts // block_tokens)  # (E,)
    first_pair = np.concatenate([[0], np.cumsum(counts)[:-1]])  # (E,)
    first_block = np.concatenate([[0], np.cumsum(blocks_per_expert)[:-1]])  # (E,)
    pos = np.arange(sorted_expert.size) - first_pair[sorted_expert]  # (N*k,) rank within its expert
    block = first_block[sorted_expert] + pos // block_tokens  # (N*k,)
    n_blocks = int(blocks_per_expert.sum())
    n_padded = max(block_multiple, -(-n_blocks // block_multiple) * block_multiple)
    block_expert = np.zeros(n_padded, dtype=np.int32)  # (nb,)
    block_expert[:n_blocks] = np.repeat(np.arange(n_expert), blocks_per_expert)
    block_rows = np.zeros((n_padded, block_tokens), dtype=np.int32)  # (nb, bt)
    block_valid = np.zeros((n_padded, block_tokens), dtype=bool)  # (nb, bt)
    block_weight = np.zeros((n_padded, block_tokens), dtype=np.float32)  # (nb, bt)
    block_rows[block, pos % block_tokens] = sorted_token
    block_valid[block, pos % block_tokens] = True
    block_weight[block, pos % block_tokens] = flat_weight[order]
    return block_expert, block_rows, block_valid, block_weight


@partial(jax.jit, static_argnames=("with_hessians",))
def _blocked_expert_sums(
    w_gate: jax.Array,
    w_up: jax.Array,
    x: jax.Array,
    block_expert: jax.Array,
    block_rows: jax.Array,
    block_valid: jax.Array,
    block_weight: jax.Array,
    with_hessians: bool,
) -> tuple[jax.Array, ...]:
    """Scan over single-expert token blocks: one (bt, d) x (d, f) product per block.

    Memory is one block's activations plus the per-expert sums, not
    (N, k, f, d) gathered weights; work is the routed tokens' own matmuls plus
    padding of at most one block per expert. The (E, d, d) and (E, f, f) sums
    are scan carries updated in place. Each row enters the Hessian sums scaled
    by its block_weight (1 when unweighted, an exact multiply), the diagonal
    sums unscaled.
    """
    n_expert, width, d_model = w_gate.shape

    def block_step(carry: tuple[jax.Array, ...], block: tuple[jax.Array, ...]):
        sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t = carry
        expert, rows, valid, weight = block  # (), (bt,), (bt,), (bt,)
        xb = jnp.where(valid[:, None], x[rows], 0.0)  # (bt, d) padding rows are zero, so h = 0 there
        hidden = jax.nn.silu(xb @ w_gate[expert].T) * (xb @ w_up[expert].T)  # (bt, f)
        sum_x_sq = sum_x_sq.at[expert].add(jnp.sum(xb * xb, axis=0))  # (E, d)
        sum_h_sq = sum_h_sq.at[expert].add(jnp.sum(hidden * hidden, axis=0))  # (E, f)
        if with_hessians:
            sum_xx_t = sum_xx_t.at[expert].add((xb * weight[:, None]).T @ xb)  # (E, d, d) += (d, bt) @ (bt, d)
            sum_hh_t = sum_hh_t.at[expert].add((hidden * weight[:, None]).T @ hidden)  # (E, f, f) += (f, bt) @ (bt, f)
        return (sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t), None

    hessian_shapes = ((n_expert, d_model, d_model), (n_expert, width, width)) if with_hessians else ((0,), (0,))
    init = (
        jnp.zeros((n_expert, d_model), jnp.float32),
        jnp.zeros((n_expert, width), jnp.float32),
        jnp.zeros(hessian_shapes[0], jnp.float32),
        jnp.zeros(hessian_shapes[1], jnp.float32),
    )
    sums, _ = jax.lax.scan(block_step, init, (block_expert, block_rows, block_valid, block_weight))
    return sums


def expert_hidden_stats(
    w_gate: np.ndarray,
    w_up: np.ndarray,
    x: np.ndarray,
    experts: np.ndarray,
    with_hessians: bool = True,
    block_tokens: int = 128,
    routing_weights: np.ndarray | None = None,
) -> ExpertStats:
    """Exact per-expert statistics of the routed tokens: see `ExpertStats`.

    w_gate, w_up (E, f, d); x (N, d) the layer's MoE inputs (after ffn_norm);
    experts (N, k) the routing. routing_weights (N, k), the router's weight of
    each chosen expert, if given weight each pair's rows in the Hessian sums
    and fill `weight_sums`; the activations and the diagonal sums never see
    them (they scale W_down's output, not any expert matrix's input). Results
    are additive over token chunks (`ExpertStats.__add__`), so a dump can be
    streamed chunk by chunk. Sums are float32, accumulated per block of
    `block_tokens` tokens; weight_sums float64.
    """
    n_expert = w_gate.shape[0]
    routing = np.asarray(experts)  # (N, k)
    block_expert, block_rows, block_valid, block_weight = _expert_blocks(
        routing, n_expert, block_tokens, pair_weights=routing_weights
    )
    sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t = _blocked_expert_sums(
        jnp.asarray(w_gate, jnp.float32),
        jnp.asarray(w_up, jnp.float32),
        jnp.asarray(x, jnp.float32),
        jnp.asarray(block_expert),
        jnp.asarray(block_rows),
        jnp.asarray(block_valid),
        jnp.asarray(block_weight),
        with_hessians,
    )
    weight_sums = None if routing_weights is None else np.bincount(
        routing.reshape(-1), weights=np.asarray(routing_weights, np.float64).reshape(-1), minlength=n_expert
    )  # (E,)
    return ExpertStats(
        counts=np.bincount(routing.reshape(-1), minlength=n_expert).astype(np.int64),
        sum_x_sq=np.asarray(sum_x_sq),
        sum_h_sq=np.asarray(sum_h_sq),
        sum_xx_t=sum_xx_t if with_hessians else None,
        sum_hh_t=sum_hh_t if with_hessians else None,
        weight_sums=weight_sums,
    )


def gaussian_silu_moments(std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E[silu(g)^2] and E[silu(g)^2 g^2] for g ~ N(0, std^2), by 64-node Gauss-Hermite.

    E[f(g)] = pi^-1/2 sum_i w_i f(sqrt(2) std x_i) for the Hermite nodes x_i, weights w_i.
    """
    s = np.asarray(std, dtype=np.float64)[..., None]  # (..., 1)
    g = np.sqrt(2.0) * s * _GH_NODES  # (..., n)
    silu_sq = (g * 0.5 * (1.0 + np.tanh(0.5 * g))) ** 2  # (..., n) sigmoid via tanh: no overflow
    w = _GH_WEIGHTS / np.sqrt(np.pi)  # (n,)
    return silu_sq @ w, (silu_sq * g * g) @ w  # (...,), (...,)


@jax.jit
def _diag_projected_moments(w_gate: jax.Array, w_up: jax.Array, mean_sq_x: jax.Array) -> tuple[jax.Array, ...]:
    """var_g, var_u, cov_gu (E, f) under a diagonal input second moment, one expert at a time."""

    def one_expert(weights: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        gate, up = weights  # (f, d) each
        scaled_gate = gate * mean_sq_x  # (f, d)
        return (
            jnp.sum(scaled_gate * gate, axis=-1),  # (f,) var_g
            jnp.sum(up * mean_sq_x * up, axis=-1),  # (f,) var_u
            jnp.sum(scaled_gate * up, axis=-1),  # (f,) cov
        )

    return jax.lax.map(one_expert, (w_gate, w_up))  # (E, f) each


def analytic_hidden_sq(w_gate: np.ndarray, w_up: np.ndarray, mean_sq_x: np.ndarray) -> np.ndarray:
    """Prior estimate of E[h_c^2] per expert and hidden unit from diagonal input stats only.

    Assumptions: the input x has a diagonal second moment E[x x^T] =
    diag(mean_sq_x) and the pre-activations g = W_gate[e,c] . x, u = W_up[e,c] . x
    are jointly Gaussian with zero mean (sums of many weakly dependent terms).
    Their moments are then
        var_g = sum_d W_gate[c,d]^2 E[x_d^2],  var_u = sum_d W_up[c,d]^2 E[x_d^2],
        cov   = sum_d W_gate[c,d] W_up[c,d] E[x_d^2].
    Writing u = a g + b z with a = cov / var_g, b^2 = var_u - cov^2 / var_g, z
    independent standard normal, h = silu(g) u gives the closed form
        E[h^2] = a^2 E[silu(g)^2 g^2] + b^2 E[silu(g)^2],
    both expectations over g ~ N(0, var_g) by Gauss-Hermite quadrature. With
    uncorrelated gate and up rows (cov = 0) this is E[silu(g)^2] var_u. It
    ignores input means and off-diagonal input correlations, which is why it is
    only a prior (see `down_importance`). w_gate, w_up (E, f, d) -> (E, f) float64.
    """
    var_gate, var_up, cov = (
        np.asarray(m, dtype=np.float64)
        for m in _diag_projected_moments(
            jnp.asarray(w_gate, jnp.float32), jnp.asarray(w_up, jnp.float32), jnp.asarray(mean_sq_x, jnp.float32)
        )
    )  # (E, f) each
    silu_sq, silu_sq_g_sq = gaussian_silu_moments(np.sqrt(var_gate))  # (E, f) each
    safe_var = np.where(var_gate > 0, var_gate, 1.0)  # (E, f)
    slope = np.where(var_gate > 0, cov / safe_var, 0.0)  # (E, f)
    resid_var = np.maximum(var_up - slope * cov, 0.0)  # (E, f)
    return slope**2 * silu_sq_g_sq + resid_var * silu_sq  # (E, f)


def down_importance(
    exact_sum: np.ndarray, counts: np.ndarray, analytic: np.ndarray, blend_tokens: float, beta: float
) -> np.ndarray:
    """Per input-column weight for W_down of every expert: (E, f), mean 1 per expert.

    A pseudo-count blend of the exact routed-token statistic with the analytic prior:
        m[e, c] = (exact_sum[e, c] + blend_tokens * analytic[e, c]) / (counts[e] + blend_tokens)
        w[e, c] = max(m[e, c], floor)^beta, normalised to mean 1 over c,
    i.e. the posterior mean of E[h_c^2] when the prior is worth `blend_tokens`
    tokens. An expert with no routed tokens gets the prior; one with many gets
    its own data. exact_sum (E, f) from `expert_hidden_stats`, analytic (E, f)
    from `analytic_hidden_sq`, counts (E,).
    """
    return _tempered_mean_one(blended_second_moment(exact_sum, counts, analytic, blend_tokens), beta)  # (E, f)


def pooled_second_moment(sum_xx_t: np.ndarray | jax.Array, counts: np.ndarray) -> jax.Array:
    """The layer's E[x x^T] from per-expert sums: sum_e sum_xx_t[e] / sum_e counts[e].

    Every token is counted once per chosen expert, k times in both sums, so for
    x this is the plain mean over the layer's tokens; for h (which differs per
    expert) it is the mean over routed (token, expert) pairs. With router-weighted
    sums and `counts` the weight sums, it is the same mean weighted by w.
    Summed in float64 on the device holding the sums (a real layer's are GBs):
    float64 holds 29 more bits than a float32 term, so the sum of E terms is
    exact, and equal to the host's whatever the order, unless their magnitudes
    span more than about 2^(29 - log2 E); even then only a last-bit tie of the
    float32 rounding could tell them apart (tests/test_importance.py compares
    them bit for bit).
    (E, n, n), (E,) -> (n, n) float32; all-zero counts give zeros.
    """
    total = float(np.sum(counts, dtype=np.float64))
    with jax.enable_x64(True):
        return _pooled(jnp.asarray(sum_xx_t, jnp.float32), jnp.float64(total if total > 0 else 1.0))  # (n, n)


@jax.jit
def _pooled(sum_xx_t: jax.Array, total: jax.Array) -> jax.Array:
    """`pooled_second_moment`'s arithmetic (traced with 64-bit types on): (E, n, n), () -> (n, n) float32."""
    return (jnp.sum(sum_xx_t.astype(jnp.float64), axis=0) / total).astype(jnp.float32)  # (n, n)


def hessian_mass(stats: ExpertStats, shrink: float) -> tuple[np.ndarray, float]:
    """The normaliser of each expert's Hessian sums and the shrink pseudo-count in the same unit.

    Unweighted: (counts, shrink), shrink counted in tokens. Router-weighted:
    the normaliser is weight_sums W_e = sum_{t->e} w_te, so the expert's own
    part of H is the weighted mean sum w x x^T / W_e, and the pseudo-count is
    shrink * wbar, wbar = sum_e W_e / sum_e n_e the layer's mean pair weight.
    That is `shrink_hessian` on effective counts W_e / wbar (in tokens of
    average weight, sum_e W_e / wbar = sum_e n_e): `gptq_shrink` keeps its
    meaning in tokens, so turning weighting on does not also make the shrink
    about 1/wbar (~k) times stronger, as raw weight sums would. An expert whose
    tokens weight it less than average counts as fewer tokens and leans more
    on the layer's H. (E,) float64 and a float.
    """
    if stats.weight_sums is None:
        return np.asarray(stats.counts, np.float64), shrink
    total_weight = float(np.sum(stats.weight_sums))
    mean_weight = total_weight / max(int(np.sum(stats.counts)), 1)
    return np.asarray(stats.weight_sums, np.float64), shrink * mean_weight


def shrink_hessian(sum_xx_t: np.ndarray, counts: np.ndarray, h_layer: np.ndarray, shrink: float) -> np.ndarray:
    """Per-expert GPTQ Hessians E[x x^T], pulled toward the layer's:

        H[e] = (sum_xx_t[e] + shrink * h_layer) / (counts[e] + shrink)

    `shrink` is a pseudo-count: an expert with n_e << shrink tokens gets
    essentially the layer's H (its own few tokens would give a rank-deficient,
    noisy H); one with n_e >> shrink keeps its own. An expert with no tokens
    and shrink 0 gets h_layer. Damping is applied afterwards, by
    `kernels.gptq.damp_hessian`. Works the same for down's h h^T, and for
    router-weighted sums with counts and shrink from `hessian_mass`.
    Runs on the default JAX device: at a real layer's shapes (128 experts of
    2048 x 2048) the host spent seconds on these elementwise passes.
    sum_xx_t (E, n, n), counts (E,), h_layer (n, n) -> (E, n, n) float32.
    """
    return np.asarray(_shrunk(jnp.asarray(sum_xx_t, jnp.float32), jnp.asarray(counts, jnp.float32),
                              jnp.asarray(h_layer, jnp.float32), jnp.float32(shrink)))  # (E, n, n)


@jax.jit
def _shrunk(sum_xx_t: jax.Array, counts: jax.Array, h_layer: jax.Array, shrink: jax.Array) -> jax.Array:
    """`shrink_hessian`'s arithmetic: (E, n, n), (E,), (n, n), () -> (E, n, n) float32."""
    denominator = counts[:, None, None] + shrink  # (E, 1, 1)
    pooled = sum_xx_t + shrink * h_layer  # (E, n, n)
    safe = jnp.where(denominator > 0, denominator, 1.0)  # (E, 1, 1)
    return jnp.where(denominator > 0, pooled / safe, h_layer[None])  # (E, n, n)


@jax.jit
def _shrunk_damped(sum_xx_t: jax.Array, counts: jax.Array, h_layer: jax.Array, shrink: jax.Array,
                   damp: jax.Array) -> jax.Array:
    """`expert_hessians`' arithmetic on the device: (E, n, n) -> (E, n, n) float32."""
    return jax.vmap(damp_hessian, in_axes=(0, None))(_shrunk(sum_xx_t, counts, h_layer, shrink), damp)  # (E, n, n)


def expert_hessians(sum_xx_t: np.ndarray | jax.Array, counts: np.ndarray, h_layer: np.ndarray | jax.Array,
                    shrink: float, damp: float) -> jax.Array:
    """The GPTQ Hessians of a layer's experts: `shrink_hessian`, then `damp_hessian` on each, in one
    device program, left on the device for GPTQ. (E, n, n), (E,), (n, n) -> (E, n, n) float32."""
    return _shrunk_damped(jnp.asarray(sum_xx_t, jnp.float32), jnp.asarray(counts, jnp.float32),
                          jnp.asarray(h_layer, jnp.float32), jnp.float32(shrink), jnp.float32(damp))
