"""Plain top-k routing, as qwen2moe / qwen3moe do it: what every model's forward runs.

Kept apart from cache-aware routing (``moce.py``, which reproduces it bit for
bit at bonus 0 through the same compiled ``route_weights``), so that the
runner, and every stage that runs the model, depends on this alone.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@jax.jit
def route_weights(router_logits: jax.Array, experts: jax.Array, norm_topk_prob: bool | jax.Array) -> jax.Array:
    """Router probabilities of the chosen experts, as qwen2moe / qwen3moe compute them.

    softmax over all E experts of the original logits, gathered at the chosen
    experts, renormalised over the k iff `norm_topk_prob`. Both plain and
    cache-aware routing call this one compiled function, so at bonus 0 the
    weights are identical bit for bit.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # (..., E)
    chosen = jnp.take_along_axis(probs, experts, axis=-1)  # (..., k)
    normalised = chosen / jnp.sum(chosen, axis=-1, keepdims=True)  # (..., k)
    return jnp.where(norm_topk_prob, normalised, chosen)  # (..., k)


@partial(jax.jit, static_argnames=("k",))
def topk_experts(router_logits: jax.Array, k: int) -> jax.Array:
    """Plain top-k expert ids of the router probabilities; ties go to the lower expert id."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # (..., E)
    return jax.lax.top_k(probs, k)[1].astype(jnp.int32)  # (..., k)


def topk_route(router_logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Plain routing, as qwen2moe / qwen3moe do it: softmax, top-k of the probabilities.

    router_logits (..., E) -> (experts (..., k) int32, weights (..., k) float32);
    the reference that `cache_aware_route(bonus=0)` reproduces bit for bit.
    """
    experts = topk_experts(router_logits, k)  # (..., k)
    return experts, route_weights(router_logits, experts, norm_topk_prob)
