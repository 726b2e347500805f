"""ggml iq1_m, the writing half: ggml's own search, ported so that our bytes are llama.cpp's (the
layout is ``iquants.IQ1_M``'s), and GPTQ's rounding over the shifted grid.

The search is ``quantize_row_iq1_m_impl`` (llama.cpp ``ggml/src/ggml-quants.c``, tag b11434), with
ggml's search weights ``qw * sqrt(sigma2 + x^2)``, sigma2 = 2 sum(x^2) / 256 per super-block, qw
the importance (1 where none is given, as for the other i-quants: ggml's own fallback without an
imatrix, w = x^2, is not used). Per sub-block of 16 weights:

1. every split of the sorted weights into three runs (levels -1, 0, 1, i.e. L = 0, 1, 2) and every
   choice of delta sign per half (k = 0..3: ++, +-, -+, --; level values ``X_P`` or ``X_M``) is
   scored by sumqx^2 / sumq2 from prefix sums, in ggml's order (i1, i2, k), the first best kept by
   ggml's comparison ``sumqx^2 > best * sumq2``; a negative scale mirrors the levels;
2. a group of 8 whose levels are no grid point takes the neighbour (ggml's table: the grid points
   at the three smallest distances, by distance then index) of least weighted error at that scale,
   and the sub-block's scale is then refit by least squares;

then per super-block d = max scale / 15, each 3-bit code l the nearest to (scale / d - 1) / 2,
d refit by least squares on the chosen points and codes and multiplied by ggml's 1.1125.

Bytes equal to llama.cpp's need ggml's float32 arithmetic operation for operation: every sum in
ggml's order (``ordered_sum``, never a tree reduction), divisions as divisions (XLA turns a
division by a constant into a product with its reciprocal: ``divide_exactly``), and every product
that feeds a sum rounded on its own (``product``): ggml-base, where ggml-quants.c is compiled,
is built for baseline x86-64 (no FMA, so no contraction), while XLA's CPU backend contracts
``a * b + c`` into one fused multiply-add.
tests/test_iquants.py compares the bytes with llama.cpp's ``quantize_iq1_m`` and with a NumPy
reference of the same search, on XLA's CPU backend. On a GPU, XLA's own rules for division, square
roots and contraction apply; equality with llama.cpp's bytes is not checked there (a difference
would show only where ggml's comparisons are near ties, and changes no byte's validity).

The candidate splits are scored all at once per sub-block, and the choice among them, which
depends on the order of the comparisons, is a scan over the 612 candidates; the neighbour search
scores each group's whole neighbour list (at most ``NEIGHBOURS_MAX``) at once.

GPTQ (``gptq.py``) rounds one group of 8 columns at a time over the 4096 shifted grid points
(the point and the delta sign at once, ``IQuantEncoder.gptq_round_group``): d is the search's d of
the super-block as it stands when it starts, and a sub-block's l is ggml's code for the search's
scale of the sub-block as it stands when the sub-block starts.
"""

from __future__ import annotations

from functools import cache, reduce

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels.formats import fp16_round
from moeheal.kernels.formats_encode import uniform_importance
from moeheal.kernels.iquants import IQ1_M, IQ1M_DELTA, IQ1M_GRID_POINTS, gguf_grid
from moeheal.kernels.iquants_encode import IQuantEncoder, first_argmin
from moeheal.kernels.kquants import QK_K

SUB = 16  # weights per sub-block (ggml's IQ1M_BLOCK_SIZE)
X_P = (-1 + IQ1M_DELTA, IQ1M_DELTA, 1 + IQ1M_DELTA)  # the values of L = 0, 1, 2 with delta +1/8
X_M = (-1 - IQ1M_DELTA, -IQ1M_DELTA, 1 - IQ1M_DELTA)  # ... with delta -1/8
GROUP_MAX_EPS = 1e-7  # a sub-block whose largest |x| is below this is left at scale 0 (GROUP_MAX_EPS_IQ1_M)
D_FUDGE = 1.1125  # ggml multiplies the refit super-block scale by this before rounding it to fp16
FLT_MAX = float(np.finfo(np.float32).max)
# The candidate splits (i1, i2), 0 <= i1 <= i2 <= 16, in ggml's order; each takes the 4 delta choices k.
SPLITS = np.array([(i1, i2) for i1 in range(SUB + 1) for i2 in range(i1, SUB + 1)], np.int32)  # (153, 2)
# Super-blocks searched per step (per expert under quantize_experts): the neighbour scores of a step are
# (16 * SEARCH_BLOCKS, 2, NEIGHBOURS_MAX, 8) floats.
SEARCH_BLOCKS = 64
UNROLL = 4  # the candidate scan's unrolling: measured 13% faster than 1 on CPU, 12 slower


# --------------------------------------------------------------------------- ggml's float32 order


def rounded(v: jax.Array) -> jax.Array:
    """v, which XLA cannot fuse into the operation that consumes it: a product passed through here is
    rounded to float32 on its own before it is added, as ggml's C (no FMA contraction) rounds it.
    The select is the identity but for a NaN's payload; XLA's CPU backend fuses a product into a
    sum through a reshape or an optimization barrier, not through a select."""
    return jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v)


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b rounded to float32, never fused into the sum it feeds (``rounded``)."""
    return rounded(a * b)


def ordered_sum(terms: list[jax.Array]) -> jax.Array:
    """((0 + t0) + t1) + ... in this order, as ggml's loops add (0 + -0 is +0)."""
    first = jnp.where(terms[0] == 0, jnp.float32(0), terms[0])
    return reduce(jnp.add, terms[1:], first)


def divide_exactly(a: jax.Array, c: float) -> jax.Array:
    """a / c, correctly rounded: XLA turns a division by a constant into a product with the constant's
    (rounded) reciprocal, which differs in the last bit for most a; c + 0 * a is c for finite a."""
    return a / (jnp.float32(c) + 0 * a)


# --------------------------------------------------------------------------- ggml's tables


@cache
def grid_levels() -> np.ndarray:
    """(2048, 8) int32: each grid point's levels L in {0, 1, 2} (value L - 1)."""
    return (gguf_grid(IQ1_M.quant) + 1).astype(np.int32)


@cache
def neighbour_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ggml's grid map and neighbour lists (``iq2xs_init_impl`` for IQ1_M), indexed by the ternary
    code sum_j L_j 3^j of a group's levels: on_grid (6561,) the grid point or -1; start, count
    (6561,) each off-grid code's slice of ``flat``, its neighbours: every grid point at one of the
    three smallest squared distances, ordered by distance, then index."""
    levels = grid_levels()  # (2048, 8)
    powers = 3 ** np.arange(8)
    codes = np.arange(3 ** 8)
    every = (codes[:, None] // powers) % 3  # (6561, 8)
    on_grid = np.full(codes.size, -1, np.int32)
    on_grid[levels @ powers] = np.arange(levels.shape[0])
    start, count, flat, used = np.zeros(codes.size, np.int32), np.zeros(codes.size, np.int32), [], 0
    for code in np.flatnonzero(on_grid < 0):
        dist = np.sum((every[code] - levels) ** 2, axis=-1)  # (2048,)
        order = np.argsort(dist, kind="stable")  # by distance, then index (ggml's qsort key)
        third = np.unique(dist)[:3][-1]
        start[code], count[code] = used, np.count_nonzero(dist <= third)
        flat.append(order[:count[code]])
        used += count[code]
    return on_grid, start, count, np.concatenate(flat).astype(np.int32)


NEIGHBOURS_MAX = 205  # the longest neighbour list (``neighbour_tables``; checked in tests/test_iquants.py)


# --------------------------------------------------------------------------- the search


def _level_values(negative: jax.Array, levels: jax.Array) -> jax.Array:
    """X_M[levels] where ``negative`` (the group's delta is -1/8), else X_P[levels]."""
    xp = jnp.where(levels == 0, X_P[0], jnp.where(levels == 1, X_P[1], X_P[2]))
    xm = jnp.where(levels == 0, X_M[0], jnp.where(levels == 1, X_M[1], X_M[2]))
    return jnp.where(negative, xm, xp).astype(jnp.float32)


def _best_split(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Step 1 for sub-blocks x, w (m, 16): levels L (m, 16) int32, scale (m,), delta choice k (m,),
    found (m,) (False: no candidate had sumq2 > 0)."""
    m = x.shape[0]
    order = jnp.argsort(x, axis=-1, stable=True)  # (m, 16): ggml's qsort is glibc's merge sort, stable
    xs, ws = jnp.take_along_axis(x, order, axis=-1), jnp.take_along_axis(w, order, axis=-1)  # (m, 16) x2
    wx = product(ws, xs)  # (m, 16)
    px, pw = [[jnp.zeros((m,), jnp.float32)] for _ in range(2)], [[jnp.zeros((m,), jnp.float32)] for _ in range(2)]
    for j in range(SUB):  # prefix sums per half of the sub-block, in sorted order
        in_first = order[:, j] < SUB // 2
        for h, mine in ((0, in_first), (1, ~in_first)):
            for sums, t in ((px[h], wx[:, j]), (pw[h], ws[:, j])):
                sums.append(jnp.where(mine, ordered_sum([t]) if j == 0 else sums[-1] + t, sums[-1]))
    px = jnp.stack([jnp.stack(p, axis=-1) for p in px], axis=1)  # (m, 2, 17)
    pw = jnp.stack([jnp.stack(p, axis=-1) for p in pw], axis=1)  # (m, 2, 17)
    i1, i2 = SPLITS[:, 0], SPLITS[:, 1]
    txs, tws = px[..., SUB:], pw[..., SUB:]  # (m, 2, 1) x2: each half's totals
    sx = px[..., i1] + px[..., i2]  # (m, 2, 153)
    p2, m2 = X_P[2], X_M[2]
    cp1, cp2 = X_P[0] ** 2 - X_P[1] ** 2, X_P[1] ** 2 - X_P[2] ** 2  # exact: 0.75, -1.25
    cm1, cm2 = X_M[0] ** 2 - X_M[1] ** 2, X_M[1] ** 2 - X_M[2] ** 2  # 1.25, -0.75
    qx_p, qx_m = product(txs, p2) - sx, product(txs, m2) - sx  # (m, 2, 153) x2
    q2_p = product(rounded(tws * p2), p2) + product(pw[..., i1], cp1) + product(pw[..., i2], cp2)  # (m, 2, 153)
    q2_m = product(rounded(tws * m2), m2) + product(pw[..., i1], cm1) + product(pw[..., i2], cm2)
    sumqx = jnp.stack([qx_p[:, 0] + qx_p[:, 1], qx_p[:, 0] + qx_m[:, 1], qx_m[:, 0] + qx_p[:, 1],
                       qx_m[:, 0] + qx_m[:, 1]], axis=-1).reshape(m, -1)  # (m, 612): (i1, i2) then k
    sumq2 = jnp.stack([q2_p[:, 0] + q2_p[:, 1], q2_p[:, 0] + q2_m[:, 1], q2_m[:, 0] + q2_p[:, 1],
                       q2_m[:, 0] + q2_m[:, 1]], axis=-1).reshape(m, -1)  # (m, 612)

    def step(carry, cand):
        best, scale, choice = carry
        qx, q2, c = cand  # (m,), (m,), ()
        take = (q2 > 0) & (qx * qx > best * q2)  # ggml's comparison: the first best is kept
        s = qx / q2
        return (jnp.where(take, s * qx, best), jnp.where(take, s, scale), jnp.where(take, c, choice)), None

    init = (jnp.full((m,), -FLT_MAX, jnp.float32), jnp.zeros((m,), jnp.float32), jnp.full((m,), -1, jnp.int32))
    (_, scale, choice), _ = jax.lax.scan(step, init, (sumqx.T, sumq2.T, jnp.arange(sumqx.shape[1], dtype=jnp.int32)),
                                         unroll=UNROLL)
    found = choice >= 0
    split = jnp.asarray(SPLITS)[jnp.maximum(choice, 0) // 4]  # (m, 2)
    pos = jnp.arange(SUB)  # (16,): sorted positions
    sorted_levels = (pos >= split[:, :1]).astype(jnp.int32) + (pos >= split[:, 1:]).astype(jnp.int32)  # (m, 16)
    levels = jnp.take_along_axis(sorted_levels, jnp.argsort(order, axis=-1), axis=-1)  # (m, 16): back in place
    k = jnp.maximum(choice, 0) % 4
    mirror = scale < 0
    return (jnp.where(mirror[:, None], 2 - levels, levels), jnp.where(mirror, -scale, scale),
            jnp.where(mirror, 3 - k, k), found)


def search_sub_blocks(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """ggml's search for sub-blocks x, w (m, 16): scale (m,) (0: left empty), delta choice k (m,) int32
    (bit 1: the first group's delta is -1/8, bit 0: the second's), grid points (m, 2) int32 (0-2047)."""
    m = x.shape[0]
    tiny = jnp.max(jnp.abs(x), axis=-1) < jnp.float32(GROUP_MAX_EPS)  # (m,)
    levels, scale, k, found = _best_split(x, w)
    negative = jnp.stack([k >= 2, k % 2 == 1], axis=-1)  # (m, 2): each group's delta is -1/8
    on_grid, start, count, flat = (jnp.asarray(t) for t in neighbour_tables())
    groups = levels.reshape(m, 2, 8)  # (m, 2, 8)
    code = jnp.sum(groups * jnp.asarray(3 ** np.arange(8), jnp.int32), axis=-1)  # (m, 2)
    point = on_grid[code]  # (m, 2): -1 off the grid
    # the neighbours of an off-grid group, each scored by sum_i w_i (scale * q_i - x_i)^2 in ggml's order
    slot = jnp.arange(NEIGHBOURS_MAX)  # (N,)
    listed = slot < count[code][..., None]  # (m, 2, N)
    nbr = flat[jnp.minimum(start[code][..., None] + slot, flat.shape[0] - 1)]  # (m, 2, N)
    xg, wg = x.reshape(m, 2, 8), w.reshape(m, 2, 8)  # (m, 2, 8) x2
    terms = []  # per level l = 0, 1, 2: each weight's term (m, 2, 8)
    for lev in range(3):
        diff = product(scale[:, None, None], _level_values(negative[..., None], jnp.full((1, 1, 1), lev))) - xg
        terms.append(product(rounded(wg * diff), diff))
    nbr_levels = jnp.asarray(grid_levels())[nbr]  # (m, 2, N, 8)
    per_weight = jnp.where(nbr_levels == 0, terms[0][:, :, None], jnp.where(nbr_levels == 1, terms[1][:, :, None],
                                                                             terms[2][:, :, None]))  # (m, 2, N, 8)
    d2 = ordered_sum([per_weight[..., i] for i in range(8)])  # (m, 2, N)
    d2 = jnp.where(listed & (d2 < FLT_MAX), d2, jnp.inf)
    pick = first_argmin(d2)  # (m, 2): the first of the least, as ggml's strict comparison keeps it
    off = point < 0
    point = jnp.where(off, jnp.take_along_axis(nbr, pick[..., None], axis=-1)[..., 0], point)  # (m, 2)
    levels = jnp.asarray(grid_levels())[point].reshape(m, SUB)  # (m, 16)
    # off the grid anywhere: the scale refit on the points chosen
    q = _level_values(jnp.repeat(negative, 8, axis=1), levels)  # (m, 16)
    wq = rounded(w * q)
    sumqx, sumq2 = ordered_sum(list(product(wq, x).T)), ordered_sum(list(product(wq, q).T))  # (m,) x2
    refit = jnp.any(off, axis=-1) & (sumqx > 0) & (sumq2 > 0)
    scale = jnp.where(refit, sumqx / jnp.where(refit, sumq2, 1.0), scale)
    empty = tiny | ~found
    return (jnp.where(empty, 0.0, scale), jnp.where(empty, 0, k),
            jnp.where(empty[:, None], 0, point))


def search_weights(x: jax.Array, qw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """ggml's search weights qw * sqrt(sigma2 + x^2) (n, 256) and sigma2 = 2 sum(x^2) / 256 (n, 1)."""
    sumx2 = ordered_sum(list(product(x, x).T))  # (n,)
    sigma2 = (2 * sumx2 / QK_K)[:, None]  # (n, 1): both exact scalings
    return qw * jnp.sqrt(sigma2 + product(x, x)), sigma2


def super_block(x: jax.Array, w: jax.Array, scale: jax.Array, k: jax.Array, point: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The super-block's codes and d from the sub-blocks' search: x, w (n, 256), scale, k (n, 16),
    point (n, 16, 2) -> d (n,) fp16 values, l (n, 16), grid indices (n, 32) (0-4095, the delta in
    the index), and id (n,) = 15 / max scale (0 where every scale is 0: the block stays zero)."""
    n = x.shape[0]
    max_scale = jnp.max(scale, axis=-1)  # (n,)
    live = max_scale > 0
    d0 = divide_exactly(max_scale, 15.0)
    inv = 1 / jnp.where(live, d0, 1.0)  # (n,)
    l = jnp.clip(jnp.round(0.5 * (product(inv[:, None], scale) - 1)), 0, 7)  # (n, 16), ties to even as ggml's
    l = jnp.where(live[:, None], l, 0.0)
    negative = jnp.stack([k >= 2, k % 2 == 1], axis=-1) & live[:, None, None]  # (n, 16, 2)
    levels = jnp.asarray(grid_levels())[point].reshape(n, QK_K)  # (n, 256)
    q = rounded(_level_values(jnp.repeat(negative.reshape(n, 32), 8, axis=1), levels)
                * jnp.repeat(2 * l + 1, SUB, axis=1))  # (n, 256)
    wq = rounded(w * q)
    sumqx, sumq2 = ordered_sum(list(product(wq, x).T)), ordered_sum(list(product(wq, q).T))  # (n,) x2
    d = jnp.where(sumq2 > 0, sumqx / jnp.where(sumq2 > 0, sumq2, 1.0), d0)
    d = jnp.where(live, fp16_round(d * jnp.float32(D_FUDGE)), 0.0)  # (n,)
    idx = point.reshape(n, 32) + IQ1M_GRID_POINTS * negative.reshape(n, 32)  # (n, 32)
    return d, l, idx, jnp.where(live, inv, 0.0)


class IQ1_MEncoder(IQuantEncoder, IQ1_M):
    """iq1_m: ggml's search, and GPTQ over the 4096 shifted grid points."""

    sigma_factor = 2.0

    @classmethod
    def _quantize_some(cls, x: jax.Array, qw: jax.Array) -> jax.Array:
        """x, qw (n, 256) -> (n, 56) bytes: ggml's search."""
        n = x.shape[0]
        w, _ = search_weights(x, qw)  # (n, 256)
        scale, k, point = search_sub_blocks(x.reshape(-1, SUB), w.reshape(-1, SUB))
        d, l, idx, _ = super_block(x, w, scale.reshape(n, -1), k.reshape(n, -1), point.reshape(n, -1, 2))
        return cls.pack(d, l, idx, jnp.zeros(x.shape, bool))

    @classmethod
    def quantize_blocks(cls, x: jax.Array, importance: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)  # (n, 256)
        qw = uniform_importance(x, importance)  # (n, 256)
        return jax.lax.map(lambda xq: cls._quantize_some(*xq), (x[:, None], qw[:, None]),
                           batch_size=SEARCH_BLOCKS)[:, 0]  # (n, 56)

    # ------------------------------------------------------------------ GPTQ

    @classmethod
    def gptq_block_plan(cls, x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """The search's d (n,) of the block as it stands, its 15 / max scale ``inv`` and sigma2 (n, 1)."""
        n = x.shape[0]
        w, sigma2 = search_weights(x, importance)
        scale, k, point = search_sub_blocks(x.reshape(-1, SUB), w.reshape(-1, SUB))
        d, _, _, inv = super_block(x, w, scale.reshape(n, -1), k.reshape(n, -1), point.reshape(n, -1, 2))
        return {"d": d, "inv": inv, "sigma2": sigma2}

    @classmethod
    def gptq_sub_plan(cls, plan: dict[str, jax.Array], x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """ggml's code l (n,) for the search's scale of the sub-block x (n, 16) as it stands, and its scale."""
        w = importance * jnp.sqrt(plan["sigma2"] + product(x, x))  # (n, 16)
        scale, _, _ = search_sub_blocks(x, w)  # (n,)
        l = jnp.clip(jnp.round(0.5 * (product(plan["inv"], scale) - 1)), 0, 7)  # (n,)
        l = jnp.where(plan["inv"] > 0, l, 0.0)
        return {"l": l, "s": plan["d"] * (0.5 + l) * jnp.float32(cls.unit)}  # the dequantizer's scale
