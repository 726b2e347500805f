"""Adam (Kingma & Ba) over pytrees: the optimiser of learned rounding (`kernels.learned`) and of
end-to-end tuning (`pipeline/stages/e2e.py`).

A module of its own so that each of the two holds only the optimiser in its code identity, not the
other's loss: an edit to the e2e loss must not re-quantize every layer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


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
