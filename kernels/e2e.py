"""Pieces of end-to-end tuning that are arrays in, arrays out (`pipeline/stages/e2e.py` drives them).

Every tuned float is a relative change of what the file stores, ``value = stored * (1 + u)`` with
``u`` starting at 0: one learning rate then means the same relative step for a block scale of
1e-4 and for a norm weight of 3, which plain gradient steps on the values themselves would not.
An fp16 scale goes through ``fp16_ste``: the forward uses the value rounded to fp16, exactly what
the written file decodes to, and the gradient passes straight through the rounding, so that
updates smaller than half an fp16 step still accumulate in ``u`` until they change the stored value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moeheal.kernels.formats import fp16_round


def fp16_ste(x: jax.Array) -> jax.Array:
    """x rounded to the nearest fp16 (as float32) in the forward pass; identity in the backward pass."""
    return x + jax.lax.stop_gradient(fp16_round(x) - x)  # x's shape


def code_ste(x: jax.Array, lo: float, hi: float) -> jax.Array:
    """x rounded to the nearest integer in [lo, hi] in the forward pass (a code the file can hold);
    identity in the backward pass, so offsets below half a step accumulate until a code moves."""
    return x + jax.lax.stop_gradient(jnp.clip(jnp.round(x), lo, hi) - x)  # x's shape


def relative(stored: jax.Array, u: jax.Array) -> jax.Array:
    """stored * (1 + u): a tuned value from the stored one and its relative change (same shape)."""
    return stored * (1.0 + u)


# Stands for log 0 in the bucketed distributions below: finite, so that a sum over nothing (k = V: no
# bucket mass) and its gradient stay 0 instead of NaN, and far below any real log-probability.
LOG_ZERO = -1e30


def _outside(ids: jax.Array, values: jax.Array) -> jax.Array:
    """`values` (..., V) with the entries `ids` (..., k) names set to LOG_ZERO: the bucket's members."""
    flat_ids = ids.reshape(-1, ids.shape[-1])  # (N, k)
    flat = values.reshape(-1, values.shape[-1])  # (N, V)
    rows = jnp.arange(flat.shape[0])[:, None]  # (N, 1)
    return flat.at[rows, flat_ids].set(LOG_ZERO).reshape(values.shape)  # (..., V)


def top_k_distribution(logp: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A distribution kept as its k most likely tokens plus one bucket for the rest of the mass.

    logp (..., V) log-probabilities -> ids (..., k) int32, their log-probabilities (..., k) and the
    bucket's log-mass (...): log of 1 - sum of the kept probabilities, computed as a log-sum-exp of
    the others (no cancellation), LOG_ZERO when k = V."""
    logp_k, ids = jax.lax.top_k(logp, k)  # (..., k) x2
    log_rest = jax.nn.logsumexp(_outside(ids, logp), axis=-1)  # (...)
    return ids.astype(jnp.int32), logp_k, jnp.where(k >= logp.shape[-1], LOG_ZERO, log_rest)


def kl_sum_topk(ids: jax.Array, ref_logp_k: jax.Array, ref_log_rest: jax.Array, logits: jax.Array,
                mask: jax.Array) -> jax.Array:
    """Sum over the tokens `mask` keeps of KL(ref || model) in nats, with the reference kept as
    `top_k_distribution` keeps it and the model's distribution coarsened the same way: its
    probabilities of the reference's k tokens, and its mass on all the others in one bucket.

    By the log-sum inequality this is at most the full-vocabulary KL, equal to it when k = V (the
    bucket is empty and the sum runs over every token); the reference's tail then never has to be
    stored, which is what lets the loss run at a real vocabulary (docs/e2e-tuning.md, Real sizes).

    ids, ref_logp_k (..., k), ref_log_rest (...), logits (..., V) the model's, mask (...) -> () float.
    """
    lse = jax.nn.logsumexp(logits, axis=-1)  # (...)
    logq_k = jnp.take_along_axis(logits, ids, axis=-1) - lse[..., None]  # (..., k)
    logq_rest = jax.nn.logsumexp(_outside(ids, logits), axis=-1) - lse  # (...)
    kept = jnp.sum(jnp.exp(ref_logp_k) * (ref_logp_k - logq_k), axis=-1)  # (...)
    bucket = jnp.exp(ref_log_rest) * (ref_log_rest - logq_rest)  # (...), 0 when the bucket is empty
    return jnp.sum((kept + bucket) * mask)  # ()
