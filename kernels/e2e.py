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

from moeheal.kernels.kld import kl_from_log_probs


def fp16_ste(x: jax.Array) -> jax.Array:
    """x rounded to the nearest fp16 (as float32) in the forward pass; identity in the backward pass."""
    return x + jax.lax.stop_gradient(x.astype(jnp.float16).astype(jnp.float32) - x)  # x's shape


def relative(stored: jax.Array, u: jax.Array) -> jax.Array:
    """stored * (1 + u): a tuned value from the stored one and its relative change (same shape)."""
    return stored * (1.0 + u)


def kl_sum(ref_logp: jax.Array, logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over the tokens `mask` keeps of KL(ref || model) in nats, over the full vocabulary
    (padding positions have mask 0; a mean is this over mask.sum()).

    ref_logp (..., V) the reference's log-softmax, logits (..., V) the model's, mask (...) -> () float32.
    """
    return jnp.sum(kl_from_log_probs(ref_logp, logits) * mask)  # ()
