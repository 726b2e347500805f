"""Importance weights and expert statistics against float64 NumPy loops and scipy quadrature."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest
from scipy import integrate, special, stats

from moeheal.kernels.importance import (
    RELATIVE_FLOOR,
    analytic_hidden_sq,
    down_importance,
    expert_gate_up_importance,
    expert_hidden_stats,
    gate_up_importance,
    gaussian_silu_moments,
    hessian_mass,
    pooled_second_moment,
    shrink_hessian,
)

pytestmark = pytest.mark.compile_bound  # tests/conftest.py


def silu(v: np.ndarray) -> np.ndarray:
    return v * special.expit(v)


def loop_expert_stats(w_gate, w_up, x, experts, routing_weights=None):
    """Token-by-token float64 reference for expert_hidden_stats:
    (counts, sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t, weight_sums), the Hessian sums weighted by
    routing_weights (N, k) when given, the diagonal sums never."""
    n_expert, width, d_model = w_gate.shape
    weights = np.ones(experts.shape) if routing_weights is None else routing_weights.astype(np.float64)
    counts, weight_sums = np.zeros(n_expert, dtype=np.int64), np.zeros(n_expert)
    sum_x_sq, sum_h_sq = np.zeros((n_expert, d_model)), np.zeros((n_expert, width))
    sum_xx_t, sum_hh_t = np.zeros((n_expert, d_model, d_model)), np.zeros((n_expert, width, width))
    for token, chosen, chosen_weights in zip(x.astype(np.float64), experts, weights):
        for e, w in zip(chosen, chosen_weights):
            h = silu(w_gate[e].astype(np.float64) @ token) * (w_up[e].astype(np.float64) @ token)  # (f,)
            counts[e] += 1
            weight_sums[e] += w
            sum_x_sq[e] += token * token
            sum_h_sq[e] += h * h
            sum_xx_t[e] += w * np.outer(token, token)
            sum_hh_t[e] += w * np.outer(h, h)
    return counts, sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t, weight_sums


def random_layer(rng: np.random.Generator, n_expert=6, width=8, d_model=12, n_tokens=90, k=2):
    w_gate = (rng.normal(size=(n_expert, width, d_model)) / np.sqrt(d_model)).astype(np.float32)
    w_up = (rng.normal(size=(n_expert, width, d_model)) / np.sqrt(d_model)).astype(np.float32)
    x = (rng.normal(size=(n_tokens, d_model)) * rng.uniform(0.2, 3.0, size=d_model)).astype(np.float32)
    # skewed routing: expert 5 is never chosen, expert 0 often
    popularity = np.array([0.4, 0.2, 0.2, 0.15, 0.05, 0.0])[:n_expert]
    experts = np.array([rng.choice(n_expert, size=k, replace=False, p=popularity / popularity.sum()) for _ in range(n_tokens)])
    return w_gate, w_up, x, experts


def test_gate_up_importance_is_tempered_mean_one() -> None:
    mean_sq = np.array([4.0, 1.0, 0.25, 0.0, 9.0])
    w = gate_up_importance(mean_sq, 0.5)
    floored = np.maximum(mean_sq, RELATIVE_FLOOR * mean_sq.mean())
    expected = np.sqrt(floored) / np.sqrt(floored).mean()
    np.testing.assert_allclose(w, expected, rtol=1e-6)
    assert w.mean() == pytest.approx(1.0, rel=1e-6) and w[3] > 0
    np.testing.assert_allclose(gate_up_importance(mean_sq, 0.0), np.ones(5))
    np.testing.assert_allclose(gate_up_importance(np.zeros(3), 0.5), np.ones(3))
    # scale-free: multiplying activations by 10 leaves the weights unchanged
    np.testing.assert_allclose(gate_up_importance(100 * mean_sq, 0.7), gate_up_importance(mean_sq, 0.7), rtol=1e-6)


@pytest.mark.parametrize("block_tokens", [4, 128])
def test_expert_hidden_stats_match_token_loop(block_tokens: int) -> None:
    rng = np.random.default_rng(0)
    w_gate, w_up, x, experts = random_layer(rng)
    got = expert_hidden_stats(w_gate, w_up, x, experts, block_tokens=block_tokens)
    counts, sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t, _ = loop_expert_stats(w_gate, w_up, x, experts)
    assert got.weight_sums is None
    np.testing.assert_array_equal(got.counts, counts)
    assert got.counts[5] == 0 and np.all(got.sum_h_sq[5] == 0) and np.all(got.sum_xx_t[5] == 0)
    np.testing.assert_allclose(got.sum_x_sq, sum_x_sq, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(got.sum_h_sq, sum_h_sq, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum_xx_t, sum_xx_t, rtol=2e-5, atol=1e-4)
    np.testing.assert_allclose(got.sum_hh_t, sum_hh_t, rtol=2e-5, atol=1e-5)


def softmax_routing_weights(rng: np.random.Generator, n_tokens: int, k: int) -> np.ndarray:
    """Top-k router weights as a softmax gives them: positive, uneven, at most 1 per token."""
    logits = rng.normal(size=(n_tokens, k + 4)) * 2.0
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)  # (N, k + 4)
    return np.sort(probs, axis=1)[:, ::-1][:, :k].astype(np.float32)  # (N, k)


@pytest.mark.parametrize("block_tokens", [4, 128])
def test_router_weighted_hessian_sums_match_token_loop(block_tokens: int) -> None:
    rng = np.random.default_rng(5)
    w_gate, w_up, x, experts = random_layer(rng)
    routing_weights = softmax_routing_weights(rng, len(x), experts.shape[1])
    got = expert_hidden_stats(w_gate, w_up, x, experts, block_tokens=block_tokens, routing_weights=routing_weights)
    counts, sum_x_sq, sum_h_sq, sum_xx_t, sum_hh_t, weight_sums = loop_expert_stats(
        w_gate, w_up, x, experts, routing_weights)
    np.testing.assert_array_equal(got.counts, counts)
    np.testing.assert_allclose(got.weight_sums, weight_sums, rtol=1e-6)
    assert got.weight_sums[5] == 0 and np.all(got.sum_xx_t[5] == 0)
    np.testing.assert_allclose(got.sum_xx_t, sum_xx_t, rtol=2e-5, atol=1e-4)
    np.testing.assert_allclose(got.sum_hh_t, sum_hh_t, rtol=2e-5, atol=1e-5)
    # importance statistics are not router-weighted
    np.testing.assert_allclose(got.sum_x_sq, sum_x_sq, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(got.sum_h_sq, sum_h_sq, rtol=2e-5, atol=1e-6)
    # weighted and additive over chunks; never mixed with unweighted sums
    parts = expert_hidden_stats(w_gate, w_up, x[:37], experts[:37], routing_weights=routing_weights[:37]) + \
        expert_hidden_stats(w_gate, w_up, x[37:], experts[37:], routing_weights=routing_weights[37:])
    for field in ("weight_sums", "sum_x_sq", "sum_h_sq", "sum_xx_t", "sum_hh_t"):
        np.testing.assert_allclose(getattr(parts, field), getattr(got, field), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="router-weighted"):
        _ = got + expert_hidden_stats(w_gate, w_up, x, experts)


def test_router_weighted_hessian_is_a_weighted_mean_shrunk_in_average_tokens() -> None:
    rng = np.random.default_rng(6)
    w_gate, w_up, x, experts = random_layer(rng)
    routing_weights = softmax_routing_weights(rng, len(x), experts.shape[1]).astype(np.float64)
    weighted = expert_hidden_stats(w_gate, w_up, x, experts, routing_weights=routing_weights)
    plain = expert_hidden_stats(w_gate, w_up, x, experts)
    counts, shrink = hessian_mass(plain, 8.0)
    np.testing.assert_array_equal(counts, plain.counts)
    assert shrink == 8.0
    mass, pseudo = hessian_mass(weighted, 8.0)
    mean_weight = routing_weights.sum() / routing_weights.size
    assert pseudo == pytest.approx(8.0 * mean_weight, rel=1e-12)
    h_layer = pooled_second_moment(weighted.sum_xx_t, mass)
    x64 = x.astype(np.float64)
    token_weight = routing_weights.sum(axis=1)  # (N,) a token's weight summed over its k experts
    np.testing.assert_allclose(h_layer, (x64.T * token_weight) @ x64 / token_weight.sum(), rtol=1e-5, atol=1e-6)
    shrunk = shrink_hessian(weighted.sum_xx_t, mass, h_layer, pseudo)
    for e in range(w_gate.shape[0]):
        w = np.where(experts == e, routing_weights, 0.0).sum(axis=1)  # (N,) each token's weight for e
        effective = w.sum() / mean_weight  # e's tokens in units of the layer's mean pair weight
        own = (x64.T * w) @ x64 / max(w.sum(), 1e-300)  # (d, d) the weighted mean of x x^T
        expected = (effective * own + 8.0 * h_layer) / (effective + 8.0)
        np.testing.assert_allclose(shrunk[e], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shrunk[5], h_layer, rtol=1e-6)  # unrouted expert: the layer's H
    # equal weights everywhere give exactly the unweighted Hessians: the knob changes the mix, not the scale
    uniform = expert_hidden_stats(w_gate, w_up, x, experts, routing_weights=np.full(experts.shape, 0.25))
    u_mass, u_pseudo = hessian_mass(uniform, 8.0)
    np.testing.assert_allclose(
        shrink_hessian(uniform.sum_hh_t, u_mass, pooled_second_moment(uniform.sum_hh_t, u_mass), u_pseudo),
        shrink_hessian(plain.sum_hh_t, counts, pooled_second_moment(plain.sum_hh_t, counts), shrink),
        rtol=1e-5, atol=1e-7)


def test_expert_hidden_stats_are_additive_over_chunks() -> None:
    rng = np.random.default_rng(1)
    w_gate, w_up, x, experts = random_layer(rng)
    whole = expert_hidden_stats(w_gate, w_up, x, experts)
    parts = expert_hidden_stats(w_gate, w_up, x[:37], experts[:37]) + expert_hidden_stats(
        w_gate, w_up, x[37:], experts[37:]
    )
    np.testing.assert_array_equal(parts.counts, whole.counts)
    for field in ("sum_x_sq", "sum_h_sq", "sum_xx_t", "sum_hh_t"):
        np.testing.assert_allclose(getattr(parts, field), getattr(whole, field), rtol=1e-5, atol=1e-4)
    no_hessians = expert_hidden_stats(w_gate, w_up, x, experts, with_hessians=False)
    assert no_hessians.sum_xx_t is None and no_hessians.sum_hh_t is None
    np.testing.assert_allclose(no_hessians.sum_h_sq, whole.sum_h_sq, rtol=1e-6)
    assert (no_hessians + whole).sum_xx_t is None


def test_gaussian_silu_moments_match_quadrature() -> None:
    # 64 Gauss-Hermite nodes: near machine precision for moderate std, ~1e-4 when sigmoid's
    # poles (g = +-i*pi) come close to the real axis in units of a large std.
    for std, rel in ((0.05, 1e-12), (0.7, 1e-12), (1.5, 1e-10), (3.0, 1e-5), (6.0, 5e-4), (20.0, 5e-4), (100.0, 5e-4)):
        density = stats.norm(scale=std).pdf
        ref_sq = integrate.quad(lambda g: silu(g) ** 2 * density(g), -np.inf, np.inf, epsabs=0, epsrel=1e-13, limit=500)[0]
        ref_sq_g2 = integrate.quad(
            lambda g: silu(g) ** 2 * g * g * density(g), -np.inf, np.inf, epsabs=0, epsrel=1e-13, limit=500
        )[0]
        got_sq, got_sq_g2 = gaussian_silu_moments(np.array(std))
        assert got_sq == pytest.approx(ref_sq, rel=rel)
        assert got_sq_g2 == pytest.approx(ref_sq_g2, rel=rel)


def test_analytic_prior_is_exact_for_gaussian_diagonal_inputs() -> None:
    """With x ~ N(0, diag(s^2)), g and u are exactly jointly Gaussian: the prior equals E[h^2]."""
    rng = np.random.default_rng(2)
    d_model, width, n_tokens = 10, 6, 200_000
    scales = rng.uniform(0.3, 2.0, size=d_model)
    w_gate = rng.normal(size=(1, width, d_model)) / np.sqrt(d_model)
    # correlated gate/up rows, as trained SwiGLU rows are, so the covariance term matters
    w_up = 0.8 * w_gate + 0.6 * rng.normal(size=(1, width, d_model)) / np.sqrt(d_model)
    x = rng.normal(size=(n_tokens, d_model)) * scales  # (N, d)
    h = silu(x @ w_gate[0].T) * (x @ w_up[0].T)  # (N, f)
    monte_carlo = np.mean(h * h, axis=0)  # (f,)
    prior = analytic_hidden_sq(w_gate.astype(np.float32), w_up.astype(np.float32), scales**2)  # (1, f)
    np.testing.assert_allclose(prior[0], monte_carlo, rtol=0.03)
    # ignoring the gate/up correlation would be visibly wrong here
    silu_sq, _ = gaussian_silu_moments(np.sqrt((w_gate[0] ** 2) @ scales**2))
    independent = silu_sq * ((w_up[0] ** 2) @ scales**2)
    assert np.max(np.abs(independent / monte_carlo - 1)) > 0.1


def test_down_importance_blends_exact_and_prior() -> None:
    rng = np.random.default_rng(3)
    exact_sum = rng.uniform(0, 5, size=(3, 8))
    analytic = rng.uniform(0.1, 1, size=(3, 8))
    counts = np.array([0, 4, 1000])
    exact_sum[0] = 0.0
    got = down_importance(exact_sum, counts, analytic, blend_tokens=16.0, beta=0.5)
    blend = (exact_sum + 16.0 * analytic) / (counts[:, None] + 16.0)
    expected = np.sqrt(blend) / np.sqrt(blend).mean(axis=1, keepdims=True)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(got.mean(axis=1), 1.0, rtol=1e-6)
    prior_only = np.sqrt(analytic[0]) / np.sqrt(analytic[0]).mean()
    np.testing.assert_allclose(got[0], prior_only, rtol=1e-6)  # no tokens: the prior
    no_blend = down_importance(exact_sum, counts, analytic, blend_tokens=0.0, beta=1.0)
    np.testing.assert_allclose(no_blend[0], analytic[0] / analytic[0].mean(), rtol=1e-6)  # 0/0 falls back to the prior
    np.testing.assert_allclose(no_blend[2], exact_sum[2] / exact_sum[2].mean(), rtol=1e-6)


def test_expert_gate_up_importance_blends_each_expert_with_the_layer() -> None:
    """Each expert's own E[x^2] (llama.cpp's imatrix entry) pulled to the layer's by the pseudo-count."""
    rng = np.random.default_rng(8)
    sum_x_sq = rng.uniform(0, 5, size=(3, 8))
    sum_x_sq[0] = 0.0
    counts = np.array([0, 4, 1000])
    layer = rng.uniform(0.1, 1, size=8)
    got = expert_gate_up_importance(sum_x_sq, counts, layer, blend_tokens=16.0, beta=0.5)
    blend = (sum_x_sq + 16.0 * layer) / (counts[:, None] + 16.0)
    np.testing.assert_allclose(got, np.sqrt(blend) / np.sqrt(blend).mean(axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(got[0], gate_up_importance(layer, 0.5), rtol=1e-6)  # no tokens: the layer's
    own = expert_gate_up_importance(sum_x_sq, counts, layer, blend_tokens=0.0, beta=1.0)
    np.testing.assert_allclose(own[2], sum_x_sq[2] / sum_x_sq[2].mean(), rtol=1e-6)  # llama.cpp's qw, mean 1
    np.testing.assert_allclose(own[0], layer / layer.mean(), rtol=1e-6)  # 0/0 falls back to the layer's


def test_shrink_hessian_and_pooled_moment() -> None:
    rng = np.random.default_rng(4)
    w_gate, w_up, x, experts = random_layer(rng)
    stats_ = expert_hidden_stats(w_gate, w_up, x, experts)
    h_layer = pooled_second_moment(stats_.sum_xx_t, stats_.counts)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(h_layer, x64.T @ x64 / len(x), rtol=1e-5, atol=1e-6)
    # summed on the device, in float64: the host's float64 sum to the last float32 bit
    host = np.sum(np.asarray(stats_.sum_xx_t), axis=0, dtype=np.float64) / float(np.sum(stats_.counts))
    assert np.array_equal(np.asarray(h_layer), host.astype(np.float32))
    shrunk = shrink_hessian(stats_.sum_xx_t, stats_.counts, h_layer, shrink=8.0)
    for e in range(w_gate.shape[0]):
        own = x64[np.any(experts == e, axis=1)]
        expected = (own.T @ own + 8.0 * h_layer) / (len(own) + 8.0)
        np.testing.assert_allclose(shrunk[e], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shrunk[5], h_layer, rtol=1e-6)  # unrouted expert: the layer's H
    no_shrink = shrink_hessian(stats_.sum_xx_t, stats_.counts, h_layer, shrink=0.0)
    np.testing.assert_allclose(no_shrink[5], h_layer)
    np.testing.assert_allclose(no_shrink[0], stats_.sum_xx_t[0] / stats_.counts[0], rtol=1e-6)
