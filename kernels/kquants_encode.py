"""ggml k-quants, the writing half: how q2_k, q3_k, q4_k, q5_k, q6_k blocks are chosen (the
layouts are ``kquants.py``'s).

The layout: 256 weights in sub-blocks of 16 or 32, each with
an integer scale code ls (and, for q2_k/q4_k/q5_k, a min code lm), and fp16 d
(and dmin) per super-block; a weight with code q is (d * ls) * q (- dmin * lm).

We choose all of it to minimise the weighted squared error of the bytes we
write, in three vectorised stages (every block and sub-block at once):

1. per sub-block, a float scale (and min) by a scan over candidate scales,
   each refit by weighted least squares: candidates of the form ggml uses
   (``make_qkx3_quants`` / ``make_qx_quants``), spread wider where the grid is
   long, plus a refit from the re-rounded codes (affine) or both orientations
   of the grid (symmetric);
2. the super-block d (and dmin) by the grid search of ``formats_encode.py`` over
   the sub-block values, each sub-block weighted by how much its scale (min)
   matters: sum w q^2 (sum w), where ggml weights both by sum w;
3. per sub-block, the scale and min codes among the neighbours (+-2) of the
   rounded float values, scored by the exact error of the fp16 super-block
   scales and nearest codes: what ggml approximates by ``make_qp_quants``
   on the float values is here measured on the bytes.

The weights w are ggml's when an imatrix is given (``quantize_row_*_impl``):
``qw * sqrt(sigma2 + x^2)`` with sigma2 = sum(x^2)/256 for q2_k and twice
that for q3_k/q4_k/q5_k, ``qw`` alone for q6_k; with no importance, qw = 1.
GPTQ rounding fixes d (dmin) when a super-block starts and the sub-block codes
when a sub-block starts (``gptq_*`` methods, see ``gptq.py``).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from moeheal.kernels.formats_encode import Encoder, round_ties_down, search_grid_scale, uniform_importance
from moeheal.kernels.kquants import KQuant, QK_K, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, 0 where den = 0 (a zero scale represents every weight by its min)."""
    return jnp.where(den == 0, 0.0, num / jnp.where(den == 0, 1.0, den))


def ggml_weights(x: jax.Array, qw: jax.Array, sigma_factor: float | None) -> jax.Array:
    """ggml's search weights from importance: qw * sqrt(sigma2 + x^2), sigma2 = f * mean(x^2) per block.

    x, qw (n, 256) -> (n, 256). The sqrt term leans the search towards large
    weights (ggml's measured choice); ``sigma_factor`` None keeps qw (q6_k).
    """
    if sigma_factor is None:
        return qw
    sigma2 = sigma_factor * jnp.sum(x * x, axis=-1, keepdims=True) / QK_K  # (n, 1)
    return qw * jnp.sqrt(sigma2 + x * x)  # (n, 256)


def weighted_sse(x: jax.Array, w: jax.Array, values: jax.Array) -> jax.Array:
    """sum w (x - values)^2 over the last axis: (..., S) -> (...)."""
    r = x - values  # (..., S)
    return jnp.sum(w * r * r, axis=-1)


# ---------------------------------------------------------------------------
# Stage 1: sub-block scale (and min) in float
# ---------------------------------------------------------------------------


def fit_affine_subblocks(
    x: jax.Array, w: jax.Array, nmax: int, deltas: tuple[float, ...]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per sub-block scale s >= 0 and min m >= 0 with x ~ s * l - m, l in [0, nmax].

    x, w (n, k, S). Candidates have ggml's make_qkx3_quants form: inverse
    scale (nmax + delta) / (max - min) from min(x, 0), codes rounded, then
    (s, m) refit jointly by weighted least squares (m clamped to >= 0 as ggml does);
    we also refit once more from the codes the fit re-rounds to, and score
    every candidate by its exact error with nearest codes. Returns s, m (n, k)
    and the codes of the best fit (n, k, S) as float.
    """
    lo = jnp.minimum(jnp.min(x, axis=-1), 0.0)  # (n, k)
    span = jnp.max(x, axis=-1) - lo  # (n, k)
    sw = jnp.sum(w, axis=-1)  # (n, k)
    sx = jnp.sum(w * x, axis=-1)  # (n, k)

    def codes(scale: jax.Array, offset: jax.Array) -> jax.Array:
        return round_ties_down(safe_div(x - offset[..., None], scale[..., None]), 0, nmax)  # (n, k, S)

    def score(scale: jax.Array, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
        l = codes(scale, offset)  # (n, k, S)
        return weighted_sse(x, w, scale[..., None] * l + offset[..., None]), l  # (n, k), (n, k, S)

    def refit(l: jax.Array, scale: jax.Array, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
        sl = jnp.sum(w * l, axis=-1)  # (n, k)
        sl2 = jnp.sum(w * l * l, axis=-1)  # (n, k)
        sxl = jnp.sum(w * x * l, axis=-1)  # (n, k)
        det = sw * sl2 - sl * sl  # (n, k)
        ok = det > 0  # (n, k)
        fit_scale = safe_div(sw * sxl - sx * sl, jnp.where(ok, det, 0.0))  # (n, k)
        fit_offset = safe_div(sl2 * sx - sl * sxl, jnp.where(ok, det, 0.0))  # (n, k)
        positive = fit_offset > 0  # (n, k): a min above 0 is not representable, refit the scale alone
        fit_scale = jnp.where(positive, safe_div(sxl, sl2), fit_scale)  # (n, k)
        fit_offset = jnp.where(positive, 0.0, fit_offset)  # (n, k)
        return jnp.where(ok, jnp.maximum(fit_scale, 0.0), scale), jnp.where(ok, fit_offset, offset)

    def keep_better(best: tuple[jax.Array, ...], scale: jax.Array, offset: jax.Array) -> tuple[tuple, jax.Array]:
        err_b, scale_b, offset_b, l_b = best
        err, l = score(scale, offset)  # (n, k), (n, k, S)
        better = err < err_b  # (n, k)
        return (jnp.where(better, err, err_b), jnp.where(better, scale, scale_b),
                jnp.where(better, offset, offset_b), jnp.where(better[..., None], l, l_b)), l

    def step(best: tuple[jax.Array, ...], delta: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
        iscale = safe_div(nmax + delta, span)  # (n, k)
        l = round_ties_down(iscale[..., None] * (x - lo[..., None]), 0, nmax)  # (n, k, S)
        scale, offset = refit(l, best[1], best[2])  # (n, k) x2
        best, l_fit = keep_better(best, scale, offset)
        best, _ = keep_better(best, *refit(l_fit, scale, offset))
        return best, None

    scale0 = span / nmax  # (n, k): ggml's starting point, codes spread over [min(x, 0), max(x)]
    err0, l0 = score(scale0, lo)
    (_, scale, offset, l), _ = jax.lax.scan(step, (err0, scale0, lo, l0), jnp.asarray(deltas, jnp.float32))
    return scale, -offset, l


def fit_symmetric_subblocks(
    x: jax.Array, w: jax.Array, code_range: tuple[int, int], divisors: tuple[float, ...]
) -> tuple[jax.Array, jax.Array]:
    """Per sub-block signed scale s with x ~ s * q, q in [lo, hi]: the grid search.

    x, w (n, k, S) -> s (n, k), codes q (n, k, S) as float. The candidates
    have ggml's make_qx_quants form (extreme on the long side) and the mirror
    one (extreme on the short side); s is rounded to fp16 on the way, a
    perturbation far below the 6- or 8-bit sub-block scale codes'.
    """
    n, k, sub = x.shape
    levels = tuple(range(code_range[0], code_range[1] + 1))
    d, idx = search_grid_scale(x.reshape(n * k, sub), w.reshape(n * k, sub), levels,
                               jnp.asarray(divisors, jnp.float32))  # (n*k,), (n*k, S)
    return d.reshape(n, k), (idx + code_range[0]).astype(jnp.float32).reshape(n, k, sub)


# ---------------------------------------------------------------------------
# Stage 3: sub-block codes for fixed super-block scales
# ---------------------------------------------------------------------------


def choose_subblock_codes(
    x: jax.Array,
    w: jax.Array,
    s: jax.Array,
    m: jax.Array,
    d: jax.Array,
    dmin: jax.Array,
    scale_range: tuple[int, int],
    code_range: tuple[int, int],
    has_min: bool,
) -> tuple[jax.Array, jax.Array]:
    """Scale (and min) codes per sub-block minimising the exact weighted error.

    x, w (n, k, S); s, m (n, k) float targets; d, dmin (n,) fp16 values. The
    candidates are the rounded targets and their neighbours (+-2 each, 5 or
    25 pairs; +-1 alone gives up about 1% on q2_k); each is scored with
    nearest weight codes and the products the dequantizer computes. Returns
    ls, lm (n, k) float (lm = 0 without a min).
    """
    s_lo, s_hi = scale_range
    ls0 = round_ties_down(safe_div(s, d[:, None]), s_lo, s_hi)  # (n, k)
    lm0 = round_ties_down(safe_div(m, dmin[:, None]), 0, s_hi) if has_min else jnp.zeros_like(s)  # (n, k)
    moves = (0, -1, 1, -2, 2)  # 0 first: on a tie the rounded code stays
    steps = [(i, j) for i in moves for j in (moves if has_min else (0,))]

    def step(best: tuple[jax.Array, ...], step_ij: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
        err_b, ls_b, lm_b = best
        ls = jnp.clip(ls0 + step_ij[0], s_lo, s_hi)  # (n, k)
        lm = jnp.clip(lm0 + step_ij[1], 0, s_hi)  # (n, k)
        a = d[:, None] * ls  # (n, k)
        b = dmin[:, None] * lm  # (n, k)
        q = round_ties_down(safe_div(x + b[..., None], a[..., None]), *code_range)  # (n, k, S)
        err = weighted_sse(x, w, a[..., None] * q - b[..., None])  # (n, k)
        better = err < err_b  # (n, k)
        return (jnp.where(better, err, err_b), jnp.where(better, ls, ls_b), jnp.where(better, lm, lm_b)), None

    init = (jnp.full(s.shape, jnp.inf, jnp.float32), ls0, lm0)
    (_, ls, lm), _ = jax.lax.scan(step, init, jnp.asarray(steps, jnp.float32))
    return ls, lm


def _affine_deltas(step: float) -> tuple[float, ...]:
    """Sub-block candidates nmax + delta, delta = -18 .. 18 steps.

    Step 0.05 is ggml's make_qkx3_quants set (q2_k keeps it); q4_k and q5_k
    have 16 and 32 codes, where +-0.9 barely moves the scale: steps of 0.3 and
    0.5 cut their weighted error by a further 2-3% on t- and normal-distributed
    weights (against ggml's bytes: 0.94-0.95 and 0.86-0.88 instead of 0.96-0.97
    and 0.90-0.93).
    """
    return tuple(step * i for i in range(-18, 19))


def _signed_divisors(n: int, step: float) -> tuple[float, ...]:
    """x_ext / scale ratios for a grid [-n, n-1], i = -9..9: -(n + step i) puts the extreme on the long side
    (ggml's make_qx_quants for step 0.1), n - 1 + step i on the short side.

    Wider steps than ggml's pay where the grid is long: q3_k's sub-blocks at
    0.2 and q6_k's at 1.0 cut the weighted error by 1-2% and 7-10% over 0.1.
    """
    return tuple([-(n + step * i) for i in range(-9, 10)] + [n - 1 + step * i for i in range(-9, 10)])


def _unsigned_divisors(n: int) -> tuple[float, ...]:
    """Super-block scale ratios for codes [0, n]: ggml's make_qp_quants n + 0.1 i (i = -4..4), widened to +-1."""
    return tuple(n + 0.1 * i for i in range(-10, 11))


class KQuantEncoder(Encoder, KQuant):
    """A k-quant's encoder: ggml's ``sigma_factor`` of the importance weights and the candidate sets
    of the two searches (``sub_candidates`` per sub-block, ``super_divisors`` for d and dmin)."""

    supports_gptq = True
    sigma_factor: ClassVar[float | None]
    sub_candidates: ClassVar[tuple[float, ...]]
    super_divisors: ClassVar[tuple[float, ...]]

    @classmethod
    def _fit_subblocks(cls, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stage 1: x, w (n, k, S) -> float scale s, min m (0 without mins) (n, k), codes (n, k, S)."""
        if cls.has_min:
            return fit_affine_subblocks(x, w, cls.code_range[1], cls.sub_candidates)
        s, q = fit_symmetric_subblocks(x, w, cls.code_range, cls.sub_candidates)
        return s, jnp.zeros_like(s), q

    @classmethod
    def _super_scales(cls, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Stages 1-2 on whole blocks x, w (n, k, S) -> d, dmin (n,), float s, m (n, k)."""
        s, m, q = cls._fit_subblocks(x, w)  # (n, k) x2, (n, k, S)
        levels = tuple(range(cls.scale_range[0], cls.scale_range[1] + 1))
        divisors = jnp.asarray(cls.super_divisors, jnp.float32)  # (C,)
        d, _ = search_grid_scale(s, jnp.sum(w * q * q, axis=-1), levels, divisors)  # (n,); a scale error costs sum w q^2
        if not cls.has_min:
            return d, jnp.zeros_like(d), s, m
        dmin, _ = search_grid_scale(m, jnp.sum(w, axis=-1), levels, divisors)  # (n,): a min error costs sum w
        return d, dmin, s, m

    @classmethod
    def _sub_codes(cls, x: jax.Array, w: jax.Array, s: jax.Array, m: jax.Array, d: jax.Array,
                   dmin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stage 3 and the weight codes: -> ls, lm (n, k), q (n, k, S)."""
        ls, lm = choose_subblock_codes(x, w, s, m, d, dmin, cls.scale_range, cls.code_range, cls.has_min)
        a = d[:, None] * ls  # (n, k)
        b = dmin[:, None] * lm  # (n, k)
        q = round_ties_down(safe_div(x + b[..., None], a[..., None]), *cls.code_range)  # (n, k, S)
        return ls, lm, q

    @classmethod
    def quantize_blocks(cls, x: jax.Array, importance: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)  # (n, 256)
        n = x.shape[0]
        k = QK_K // cls.sub_block
        w = ggml_weights(x, uniform_importance(x, importance), cls.sigma_factor)  # (n, 256)
        x3, w3 = x.reshape(n, k, cls.sub_block), w.reshape(n, k, cls.sub_block)  # (n, k, S) x2
        d, dmin, s, m = cls._super_scales(x3, w3)
        ls, lm, q = cls._sub_codes(x3, w3, s, m, d, dmin)  # (n, k) x2, (n, k, S)
        return cls.pack(d, dmin, ls, lm, q.reshape(n, QK_K))  # (n, type_size)

    @classmethod
    def gptq_block_plan(cls, x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """d, dmin (n,) from the block as it stands, and its sigma2 (n, 1) for the sub-blocks' weights."""
        n = x.shape[0]
        k = QK_K // cls.sub_block
        sigma2 = (cls.sigma_factor or 0.0) * jnp.sum(x * x, axis=-1, keepdims=True) / QK_K  # (n, 1)
        w = ggml_weights(x, importance, cls.sigma_factor)  # (n, 256)
        d, dmin, _, _ = cls._super_scales(x.reshape(n, k, cls.sub_block), w.reshape(n, k, cls.sub_block))
        return {"d": d, "dmin": dmin, "sigma2": sigma2}

    @classmethod
    def gptq_sub_plan(cls, plan: dict[str, jax.Array], x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """Scale and min codes (n,) of one sub-block x (n, S) as it stands, and their products a, b (n,)."""
        w = importance if cls.sigma_factor is None else importance * jnp.sqrt(plan["sigma2"] + x * x)  # (n, S)
        x3, w3 = x[:, None, :], w[:, None, :]  # (n, 1, S) x2
        s, m, _ = cls._fit_subblocks(x3, w3)  # (n, 1) x2
        ls, lm = choose_subblock_codes(x3, w3, s, m, plan["d"], plan["dmin"], cls.scale_range, cls.code_range,
                                       cls.has_min)  # (n, 1) x2
        return {"ls": ls[:, 0], "lm": lm[:, 0], "a": plan["d"] * ls[:, 0], "b": plan["dmin"] * lm[:, 0]}

    @classmethod
    def gptq_round(cls, sub: dict[str, jax.Array], col: jax.Array) -> tuple[jax.Array, jax.Array]:
        q = round_ties_down(safe_div(col + sub["b"], sub["a"]), *cls.code_range)  # (n,)
        return q.astype(jnp.int32), sub["a"] * q - sub["b"]  # (n,) x2

    @classmethod
    def gptq_pack(cls, plan: dict[str, jax.Array], subs: dict[str, jax.Array], codes: jax.Array) -> jax.Array:
        return cls.pack(plan["d"], plan["dmin"], subs["ls"].T, subs["lm"].T, codes.astype(jnp.float32))


class Q2_KEncoder(KQuantEncoder, Q2_K):
    """q2_k's search settings."""

    sigma_factor = 1.0
    sub_candidates = _affine_deltas(0.05)
    super_divisors = _unsigned_divisors(15)


class Q3_KEncoder(KQuantEncoder, Q3_K):
    """q3_k's search settings."""

    sigma_factor = 2.0
    sub_candidates = _signed_divisors(4, 0.2)
    super_divisors = _signed_divisors(32, 0.1)


class Q4_KEncoder(KQuantEncoder, Q4_K):
    """q4_k's search settings."""

    sigma_factor = 2.0
    sub_candidates = _affine_deltas(0.3)
    super_divisors = _unsigned_divisors(63)


class Q5_KEncoder(KQuantEncoder, Q5_K):
    """q5_k's search settings."""

    sigma_factor = 2.0
    sub_candidates = _affine_deltas(0.5)
    super_divisors = _unsigned_divisors(63)


class Q6_KEncoder(KQuantEncoder, Q6_K):
    """q6_k's search settings."""

    sigma_factor = None
    sub_candidates = _signed_divisors(32, 1.0)
    super_divisors = _signed_divisors(128, 0.4)
