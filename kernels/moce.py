"""Cache-aware routing and expert-cache hit-rate simulation.

On a device that keeps only `cache_size` experts per layer resident, every
routed expert that is not resident costs a weight fetch. "Mixture of
Cache-Conditional Experts" (Skliar, van Rozendaal et al., arXiv:2412.00099)
trades a little routing fidelity for locality: before top-k, the router logits
of resident experts get a bonus, so a resident expert replaces a non-resident
one when it was nearly as good. This module simulates that policy on a layer's
router logits, token by token in decoding order, and the two baselines a hit
rate is judged against: plain LRU (what the cache does with unmodified routing)
and Belady's offline optimum.

The bonus used here (the paper's cache prior, with one deliberate change):

    range_t  = max_e z[t, e] - min_e z[t, e]
    score_te = z[t, e] + bonus * range_t * resident_t(e)
    experts_t = top_k(score_t)
    weights_t = softmax(z_t)[experts_t]     (renormalised over the k iff norm_topk_prob)

When no expert gets a bonus (bonus 0, or an empty cache) the top-k is taken
of softmax(z_t), exactly as plain routing does; the order is the same as on
z_t up to float rounding ties, which this keeps bit-identical.

The paper scales the bonus by a running average of the logit range; we use each
token's own range, so there is no state to warm up and one `bonus` means the
same on a router whose logits span 2 and on one whose logits span 20. The
modified scores only re-rank: the weights are the ORIGINAL router
probabilities of the chosen experts, so bonus 0 reproduces plain routing
exactly (same experts, same weights, bit for bit).

The cache is LRU per layer and per sequence: the experts a token chooses enter
(or refresh) the cache after the token; when it overflows, the least recently
used experts leave. Within one token the chosen experts are touched from rank
k-1 to rank 0, so the top-ranked expert is the most recent. An expert is a hit
when it was resident BEFORE the token. With stamps `t*k + (k-1-j)` for rank j
of token t, the LRU cache is exactly the `cache_size` experts with the largest
stamps, which is how the scan represents it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels.routing import route_weights

_NEVER_USED = -1  # stamp of an expert no token has chosen yet


def _check_sizes(k: int, cache_size: int, n_expert: int) -> None:
    """Every policy here needs one token's k experts to fit in the cache at once."""
    if not 1 <= k <= n_expert:
        raise ValueError(f"k={k} must be in 1..n_expert={n_expert}")
    if not k <= cache_size:
        raise ValueError(f"cache_size={cache_size} must be >= k={k} (a token's experts must all be resident)")


def _resident_mask(stamps: jax.Array, cache_size: int) -> jax.Array:
    """Experts in the LRU cache: the `cache_size` largest stamps among used experts."""
    n_expert = stamps.shape[0]
    if cache_size >= n_expert:
        return stamps != _NEVER_USED  # (E,)
    threshold = jax.lax.top_k(stamps, cache_size)[0][-1]  # () the cache_size-th largest stamp
    return (stamps >= threshold) & (stamps != _NEVER_USED)  # (E,)


@partial(jax.jit, static_argnames=("k", "cache_size"))
def _cache_aware_select(
    router_logits: jax.Array, k: int, cache_size: int, bonus: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scan one sequence of one layer: (T, E) logits -> (experts (T, k), hits (T,))."""
    n_tokens, n_expert = router_logits.shape
    logits = router_logits.astype(jnp.float32)  # (T, E)
    probs = jax.nn.softmax(logits, axis=-1)  # (T, E)
    rank_offsets = jnp.arange(k - 1, -1, -1, dtype=jnp.int32)  # (k,) rank 0 is touched last

    def step(stamps: jax.Array, token: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        t, z, p = token  # (), (E,), (E,)
        resident = _resident_mask(stamps, cache_size)  # (E,)
        boosted = resident & (bonus > 0)  # (E,)
        score = jnp.where(boosted, z + bonus * (jnp.max(z) - jnp.min(z)), z)  # (E,)
        # With nothing boosted (bonus 0, or an empty cache) select exactly as plain
        # routing does, on the probabilities, so even rounding ties agree.
        chosen = jnp.where(jnp.any(boosted), jax.lax.top_k(score, k)[1], jax.lax.top_k(p, k)[1])  # (k,)
        chosen = chosen.astype(jnp.int32)  # (k,)
        hits = jnp.sum(resident[chosen]).astype(jnp.int32)  # ()
        stamps = stamps.at[chosen].set(t * k + rank_offsets)  # (E,)
        return stamps, (chosen, hits)

    stamps0 = jnp.full((n_expert,), _NEVER_USED, dtype=jnp.int32)  # (E,) empty cache
    positions = jnp.arange(n_tokens, dtype=jnp.int32)  # (T,)
    _, (experts, hits) = jax.lax.scan(step, stamps0, (positions, logits, probs))  # (T, k), (T,)
    return experts, hits


def cache_aware_route(
    router_logits: jax.Array, k: int, cache_size: int, bonus: float, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Cache-aware routing of one layer of one sequence, from an empty cache.

    router_logits (T, E), in decoding order. Returns experts (T, k) int32 in
    descending modified score, weights (T, k) float32 (original router
    probabilities, see the module docstring), hits (T,) int32 = how many of
    the token's k experts were resident before it, misses (T,) = k - hits.
    `bonus` is a fraction of each token's logit range; 0 is plain routing.
    """
    n_expert = router_logits.shape[-1]
    _check_sizes(k, cache_size, n_expert)
    experts, hits = _cache_aware_select(router_logits, k, cache_size, jnp.float32(bonus))  # (T, k), (T,)
    weights = route_weights(router_logits, experts, norm_topk_prob)  # (T, k)
    return experts, weights, hits, k - hits


_batched_select = jax.jit(
    jax.vmap(_cache_aware_select, in_axes=(0, None, None, None)), static_argnames=("k", "cache_size")
)


class CacheAwareRoutingHook:
    """`routing_hook` for the runner: cache-aware routing with per-layer hit counts.

    Called eagerly (outside jit) as `hook(layer, router_logits (B, T, E))`; each
    sequence of the batch starts from its own empty cache. After a call,
    `stats[layer] = (hits (B, T), misses (B, T))` numpy int32 arrays of that
    call (a later forward pass overwrites them).
    """

    def __init__(self, cache_size: int, bonus: float, k: int, norm_topk_prob: bool) -> None:
        self.cache_size = cache_size
        self.bonus = bonus
        self.k = k
        self.norm_topk_prob = norm_topk_prob
        self.stats: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, layer: int, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        _check_sizes(self.k, self.cache_size, router_logits.shape[-1])
        experts, hits = _batched_select(router_logits, self.k, self.cache_size, jnp.float32(self.bonus))  # (B, T, k), (B, T)
        weights = route_weights(router_logits, experts, self.norm_topk_prob)  # (B, T, k)
        hits_np = np.asarray(hits, dtype=np.int32)  # (B, T)
        self.stats[layer] = (hits_np, self.k - hits_np)
        return experts, weights


def make_routing_hook(cache_size: int, bonus: float, k: int, norm_topk_prob: bool) -> CacheAwareRoutingHook:
    """A runner `routing_hook` doing cache-aware routing; see `CacheAwareRoutingHook`."""
    return CacheAwareRoutingHook(cache_size, bonus, k, norm_topk_prob)


def _check_trace(experts: np.ndarray, cache_size: int) -> np.ndarray:
    """A routing trace as int64 (T, k) with distinct experts per token."""
    trace = np.asarray(experts, dtype=np.int64)
    if trace.ndim != 2:
        raise ValueError(f"routing trace must be (T, k), got shape {trace.shape}")
    if trace.size and trace.min() < 0:
        raise ValueError("routing trace holds negative expert ids")
    sorted_ids = np.sort(trace, axis=1)  # (T, k)
    if np.any(sorted_ids[:, 1:] == sorted_ids[:, :-1]):
        raise ValueError("routing trace repeats an expert within a token")
    if not trace.shape[1] <= cache_size:
        raise ValueError(f"cache_size={cache_size} must be >= k={trace.shape[1]} (a token's experts must all be resident)")
    return trace


def lru_hits(experts: np.ndarray, cache_size: int) -> np.ndarray:
    """Hits per token of an LRU cache replaying a routing trace (T, k) -> (T,) int32.

    Same cache as the routing scan (stamps t*k + (k-1-j), rank 0 most recent),
    so the routing scan's own hits equal lru_hits of the experts it chose.
    """
    trace = _check_trace(experts, cache_size)
    n_tokens, k = trace.shape
    stamps = np.full(int(trace.max(initial=0)) + 1, _NEVER_USED, dtype=np.int64)  # (E,)
    rank_offsets = np.arange(k - 1, -1, -1)  # (k,)
    hits = np.zeros(n_tokens, dtype=np.int32)  # (T,)
    for t in range(n_tokens):
        used = stamps != _NEVER_USED  # (E,)
        if used.sum() > cache_size:
            threshold = np.partition(stamps, -cache_size)[-cache_size]
            resident = used & (stamps >= threshold)  # (E,)
        else:
            resident = used  # (E,)
        hits[t] = resident[trace[t]].sum()
        stamps[trace[t]] = t * k + rank_offsets
    return hits


def _next_use_after(trace: np.ndarray, n_expert: int) -> np.ndarray:
    """next_use[t, e] = first position > t where expert e is chosen, T when never."""
    n_tokens = trace.shape[0]
    next_use = np.empty((n_tokens, n_expert), dtype=np.int64)  # (T, E)
    upcoming = np.full(n_expert, n_tokens, dtype=np.int64)  # (E,)
    for t in range(n_tokens - 1, -1, -1):
        next_use[t] = upcoming
        upcoming[trace[t]] = t
    return next_use


def belady_hits(experts: np.ndarray, cache_size: int) -> np.ndarray:
    """Hits per token of the optimal offline cache (Belady) on a trace (T, k) -> (T,) int32.

    After each token all its k experts are resident; when that overflows the
    cache, the resident experts the token did not choose whose next use is
    farthest in the future leave (never used again counts as farthest; ties go
    to the lower id, which cannot change the hit count). Farthest-next-use is
    optimal for demand caching with several requests per step too: swapping an
    eviction for a nearer-used expert can only move a miss earlier.
    """
    trace = _check_trace(experts, cache_size)
    n_tokens = trace.shape[0]
    n_expert = int(trace.max(initial=0)) + 1
    next_use = _next_use_after(trace, n_expert)  # (T, E)
    resident = np.zeros(n_expert, dtype=bool)  # (E,)
    hits = np.zeros(n_tokens, dtype=np.int32)  # (T,)
    for t in range(n_tokens):
        chosen = trace[t]  # (k,)
        hits[t] = resident[chosen].sum()
        resident[chosen] = True
        excess = int(resident.sum()) - cache_size
        if excess > 0:
            evictable = resident.copy()  # (E,)
            evictable[chosen] = False
            candidates = np.flatnonzero(evictable)  # (n,)
            farthest_first = np.lexsort((candidates, -next_use[t, candidates]))  # (n,)
            resident[candidates[farthest_first[:excess]]] = False
    return hits


def lru_hit_rate(experts: np.ndarray, cache_size: int) -> float:
    """Fraction of routed (token, expert) slots an LRU cache already held."""
    hits = lru_hits(experts, cache_size)  # (T,)
    return float(hits.sum()) / max(np.asarray(experts).size, 1)


def belady_hit_rate(experts: np.ndarray, cache_size: int) -> float:
    """Fraction of routed (token, expert) slots the optimal offline cache already held."""
    hits = belady_hits(experts, cache_size)  # (T,)
    return float(hits.sum()) / max(np.asarray(experts).size, 1)
