"""token_kld against float64 NumPy, scipy.special.rel_entr and scipy.stats.entropy."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest
from scipy import special, stats

from moeheal.kernels.kld import token_kld


def logits_pair(rng: np.random.Generator, n_tokens: int, vocab: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """LM-like reference logits (a few strong candidates, entropy ~0.5-1 nat) and a perturbed variant."""
    ref = rng.normal(size=(n_tokens, vocab)) * 2.5  # (T, V)
    ref[:, :5] += rng.uniform(5.0, 25.0, size=(n_tokens, 5))  # (T, 5) the candidates
    variant = ref + noise * rng.normal(size=(n_tokens, vocab))  # (T, V)
    return ref.astype(np.float32), variant.astype(np.float32)


@pytest.mark.parametrize("noise", [0.05, 0.5, 3.0])
def test_token_kld_matches_float64_references(noise: float) -> None:
    rng = np.random.default_rng(0)
    ref, variant = logits_pair(rng, 24, 50_000, noise)
    kld, ref_top1, top1 = token_kld(ref, variant)
    p = special.softmax(ref.astype(np.float64), axis=-1)  # (T, V)
    q = special.softmax(variant.astype(np.float64), axis=-1)  # (T, V)
    expected = special.rel_entr(p, q).sum(axis=-1)  # (T,)
    assert expected.max() > 10 * 1e-6  # the comparison below is not decided by atol alone
    # float32 log-softmax over 50k tokens: absolute error a few 1e-7 nats
    np.testing.assert_allclose(kld, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(kld, stats.entropy(p, q, axis=-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(ref_top1, np.argmax(ref, axis=-1))
    np.testing.assert_array_equal(top1, np.argmax(variant, axis=-1))
    assert kld.dtype == np.float32 and ref_top1.dtype == np.int32


def test_token_kld_identities() -> None:
    rng = np.random.default_rng(1)
    ref, variant = logits_pair(rng, 8, 1000, 1.0)
    kld, _, _ = token_kld(ref, ref)
    np.testing.assert_allclose(kld, 0.0, atol=1e-6)
    shifted, _, _ = token_kld(ref, variant + 7.5)  # softmax is shift-invariant per row
    np.testing.assert_allclose(shifted, token_kld(ref, variant)[0], rtol=1e-4, atol=1e-6)
    # two-token closed form: KL(Bern(a) || Bern(b))
    two = np.array([[0.0, 1.0]], np.float32), np.array([[0.0, -1.0]], np.float32)
    a, b = special.expit(1.0), special.expit(-1.0)
    expected = a * np.log(a / b) + (1 - a) * np.log((1 - a) / (1 - b))
    assert token_kld(*two)[0][0] == pytest.approx(expected, rel=1e-6)


def test_top1_ties_go_to_the_lower_token_id() -> None:
    ref = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)
    _, ref_top1, top1 = token_kld(ref, ref[:, ::-1].copy())
    assert ref_top1[0] == 1 and top1[0] == 1  # reversed: [0, 3, 3, 1] -> index 1


def test_token_kld_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="logits"):
        token_kld(np.zeros((2, 5), np.float32), np.zeros((2, 6), np.float32))
