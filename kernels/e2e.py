"""Pieces of end-to-end tuning that are arrays in, arrays out (`pipeline/stages/e2e.py` drives them).

Every tuned float is a relative change of what the file stores, ``value = stored * (1 + u)`` with
``u`` starting at 0: one learning rate then means the same relative step for a block scale of
1e-4 and for a norm weight of 3, which plain gradient steps on the values themselves would not.
An fp16 scale goes through ``fp16_ste``: the forward uses the value rounded to fp16, exactly what
the written file decodes to, and the gradient passes straight through the rounding, so that
updates smaller than half an fp16 step still accumulate in ``u`` until they change the stored value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


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
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (..., V)
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)  # (...)
    return jnp.sum(kl * mask)  # ()


def adam_init(params: Any) -> tuple[Any, Any, jax.Array]:
    """Adam's state for a pytree: first and second moments (zeros like params) and the step count."""
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return zeros, jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.int32)


def adam_direction(m: Any, v: Any, grads: Any, t: jax.Array, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-12) -> tuple[Any, Any, Any]:
    """Adam's moments updated by `grads` at step t (from 1) and its bias-corrected direction
    m_hat / (sqrt(v_hat) + eps): (direction, m, v), pytrees like `grads`. Shared by the e2e stage's
    update and learned rounding's, which clips its own step."""
    m = jax.tree_util.tree_map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t  # () x2
    direction = jax.tree_util.tree_map(lambda m_, v_: (m_ / c1) / (jnp.sqrt(v_ / c2) + eps), m, v)
    return direction, m, v


@jax.jit
def adam_step(params: Any, grads: Any, state: tuple[Any, Any, jax.Array], lr: Any,
              b1: float = 0.9, b2: float = 0.999, eps: float = 1e-12) -> tuple[Any, tuple[Any, Any, jax.Array]]:
    """One bias-corrected Adam update (Kingma & Ba) of every leaf; returns (params, state).

    Adam rather than plain gradient steps: the gradients of a block scale, a norm weight and a
    router row differ by orders of magnitude, and Adam's per-parameter normalisation gives each
    a step of about `lr` in its relative change (the sign-gradient steps AutoRound takes are the
    limit b2 -> b1 -> 0). eps is tiny because the gradients of rarely-routed experts' scales are.
    `lr` is one learning rate, or a pytree like `params` of one per leaf (the e2e stage gives the
    block scales their own).
    """
    m, v, t = state
    t = t + 1
    direction, m, v = adam_direction(m, v, grads, t.astype(jnp.float32), b1, b2, eps)
    if not isinstance(lr, (dict, list, tuple)):
        lr = jax.tree_util.tree_map(lambda _: lr, params)
    params = jax.tree_util.tree_map(lambda p, d, step: p - step * d, params, direction, lr)
    return params, (m, v, t)
