"""Per-token KL divergence of a variant's next-token distribution from the reference's.

    kld[t] = KL(ref || variant) = sum_v p_ref[t, v] (log p_ref[t, v] - log p[t, v])   (nats)

over the full vocabulary, from float32 log-softmax of the logits, plus both
models' top-1 tokens (argmax, ties to the lower token id) for top-1 agreement.
Against a float64 computation the absolute error is a few 1e-7 nats at a
152k vocabulary, whatever the KLD's size; so the sum can come out slightly
below zero when the distributions are nearly equal. It is not clamped, so
pooled means stay unbiased.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def kl_from_log_probs(ref_logp: jax.Array, logits: jax.Array) -> jax.Array:
    """KL(ref || model) per position in nats from the reference's log-softmax and the model's
    logits: the evaluation's measure and the e2e stage's loss, so the two cannot drift apart.

    ref_logp (..., V), logits (..., V) -> (...) float32.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (..., V)
    return jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)  # (...)


@jax.jit
def _token_kld(ref_logits: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    ref_logp = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)  # (T, V)
    kld = kl_from_log_probs(ref_logp, logits)  # (T,)
    ref_top1 = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)  # (T,)
    top1 = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (T,)
    return kld, ref_top1, top1


def token_kld(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KL(ref || variant) per token in nats, and both top-1 token ids.

    ref_logits, logits (T, V) -> kld (T,) float32, ref_top1 (T,) int32, top1 (T,) int32.
    """
    if np.shape(ref_logits) != np.shape(logits) or np.ndim(logits) != 2:
        raise ValueError(f"logits must both be (T, V): {np.shape(ref_logits)} vs {np.shape(logits)}")
    kld, ref_top1, top1 = _token_kld(jnp.asarray(ref_logits), jnp.asarray(logits))
    return np.asarray(kld), np.asarray(ref_top1), np.asarray(top1)
