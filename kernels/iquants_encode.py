"""ggml codebook i-quants, the writing half: how iq2_xxs, iq2_xs, iq2_s, iq3_xxs blocks are chosen
(the layouts are ``iquants.py``'s; iq1_m's search is ggml's own, ``iq1m_encode.py``).

The layout: per group of 8 (iq3_xxs: 4) weights a point of
gguf-py's grid of magnitudes and the signs, per sub-block a 4-bit scale code l,
per 256 weights an fp16 d. iq2_xxs, iq2_xs and iq3_xxs store 7 sign bits per 8
weights, the eighth making the count of negatives even, so a group of 8 with
an odd count must flip one weight's sign; iq2_s stores all 8.

For a sub-block scale s, a group's weighted error against grid point k is
``sum_i w_i (|x_i| - s g_ki)^2 = A - 2 s B_k + s^2 C_k`` with B = (w |x|) G^T
and C = w (G*G)^T: two small matmuls per group, once, after which every
candidate scale costs three flops per grid point, so the search over the whole
grid is exhaustive. Flipping weight i adds ``4 s w_i |x_i| g_ki``: the best
flip for point k is the smallest of those, which only lowers B, so the flip
is chosen jointly with the point (ggml flips the least important weight
first, whatever the point; iq3_xxs's sign group spans two grid groups, and
which of them takes the flip is settled once, at the scale max|x| / max g).
We minimise the weighted error of the bytes in three vectorised stages, like
the k-quants:

1. per sub-block, a float scale: candidate scales from the largest magnitude,
   the best one refit by weighted least squares on the points it picks;
2. the super-block d by the grid search of ``formats_encode.py`` over those scales,
   each weighted by how fast its error grows off the optimum (sum of C);
3. per sub-block, the scale code nearest to the float scale and its
   neighbours (+-2), each scored by the exact error of the fp16 d and the
   float32 scale the dequantizer computes, the grid points re-chosen for it
   (ggml keeps the points of the float scale).

The weights w are ggml's (``quantize_row_iq*_impl`` with an imatrix):
``qw * sqrt(sigma2 + x^2)``, sigma2 = f * sum(x^2) / 256, f = 1 for iq2_xxs and
iq2_xs, 2 for iq2_s and iq3_xxs; qw = 1 without an importance.

GPTQ (``gptq.py``) rounds one sign group of 8 columns at a time: d is fixed when
the super-block starts and l when its sub-block starts (stages 1-2 and 3 on
the updated weights); the group's point minimises the H-aware error of the
group, ``|| (x - v) U^-1 ||^2`` with U the group's block of the Cholesky factor
of H^-1 (for iq3_xxs, its two grid points one after the other, as GPTQ over
4 columns would).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels.formats_encode import Encoder, search_grid_scale, uniform_importance
from moeheal.kernels.iquants import IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, IQuant, gguf_grid
from moeheal.kernels.kquants import QK_K
from moeheal.kernels.kquants_encode import ggml_weights, safe_div

T = TypeVar("T")
HIGHEST = jax.lax.Precision.HIGHEST  # GPUs would otherwise multiply in TF32
SCALE_LEVELS = tuple(0.5 + l for l in range(16))  # d * (0.5 + l): the 4-bit sub-block scale codes
# Candidate max|x| / (s * max grid value) ratios of stage 1; above 1 the largest weight is clipped.
# 6 come within 0.1% of 12 in the final error (stage 3 re-chooses every scale code).
STAGE1_RATIOS = tuple(float(r) for r in np.geomspace(0.75, 1.5, 6))
# Stage 3's scale codes: the stage-1 scale's nearest code and its neighbours; all 16 gain 0.2-0.4%
# and cost 70% more time.
CODE_MOVES = (0, -1, 1, -2, 2)
# d = max(s / unit) / divisor: 15.5 gives the largest sub-block scale code 15 (ggml's choice).
SUPER_DIVISORS = tuple(float(v) for v in 15.5 * np.geomspace(0.75, 1.1, 16))
# Blocks searched per step (per expert under quantize_experts): the (groups, grid points) arrays
# then stay in cache; 64 took 1.5-2x as long as 8 on CPU. 4 and 2 take 0.6-1.0x of 8's time, but on
# trained weights they move a few near-tie bytes (bench_iquant_steps.py --weights demo), and the
# CPU's bytes are the published ones, so it keeps 8. On an H100, a 30B's expert tensor (6,144
# blocks) at 64 a step took 0.70x (IQ2_XXS) and 0.86x (IQ2_S) of 8's time and 256 only 2-4% less
# than 64: the search is bound by its arithmetic, not by its launches (bench_iquant_steps.py --gpu).
SEARCH_BLOCKS = 8
ACCELERATOR_SEARCH_BLOCKS = 64
# Rows whose GPTQ plans (stages 1-3) are searched per step (per expert under quantize_experts): a
# plan's B and C hold every grid point of every group, (rows, 32, K) floats per block, 34 GB for
# 128 experts' 2,048 rows at iq2_s's K = 1,024 in one step. On a CPU 64 rows took 15-30% less time
# than whole 256-row matrices with the same bytes; 16 and 8 were faster still but moved near-tie
# codes (XLA compiles a small row count's products differently), and the CPU's bytes are the
# published ones. An accelerator takes larger steps for the same reason as above.
PLAN_ROWS = 64
ACCELERATOR_PLAN_ROWS = 128


def search_blocks() -> int:
    """Blocks per step of the least-squares search on the backend a program is traced for. Every block
    is searched on its own, so only float32's order of sums depends on it: random weights keep their
    bytes at 8 and 32 (tests/test_iquants.py), trained ones lose a few near-ties at other counts
    (bench/speed/bench_iquant_steps.py --weights demo reports the share that moves)."""
    return SEARCH_BLOCKS if jax.default_backend() == "cpu" else ACCELERATOR_SEARCH_BLOCKS


def plan_rows() -> int:
    """Rows per step of GPTQ's plans on the backend a program is traced for. Each row is planned on its
    own, so in exact arithmetic the bytes do not depend on it; in float32 they can (see ``PLAN_ROWS``)."""
    return PLAN_ROWS if jax.default_backend() == "cpu" else ACCELERATOR_PLAN_ROWS


def candidates_at_once() -> bool:
    """Whether the least-squares search scores a sub-block's candidate scales all at once
    (``IQuantEncoder._best_candidate``) on the backend a program is traced for: on an accelerator, where
    one at a time re-read the search's (groups, grid points) terms from memory for each (1.6-2.2x at a
    30B expert tensor on an H100, bench/RESULTS.md). The CPU would gain too (1.1-1.4x on the demo's experts)
    but keeps the order of sums its published bytes were made with: the other order moves near-ties.
    GPTQ's plans keep the scan everywhere: inside its column loops the form at once took 2-4x the
    compilation (10-26 s a program on an H100) for 1-2 s a 30B layer of run time."""
    return jax.default_backend() != "cpu"


def first_argmin(e: jax.Array) -> jax.Array:
    """argmin over the last axis, as two plain min reductions: XLA's CPU argmin (a variadic
    reduction) is tens of times slower than a min over the same 256-1024 grid points."""
    k = jnp.arange(e.shape[-1], dtype=jnp.int32)  # (K,)
    return jnp.min(jnp.where(e == jnp.min(e, axis=-1, keepdims=True), k, e.shape[-1]), axis=-1)  # (...,)


def first_smallest(errors: jax.Array, values: jax.Array, default: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What a scan over candidates (the last axis) keeps when it takes each candidate whose error is
    strictly below the best so far, starting from an infinite error and ``default``: the smallest error
    and the value of the first candidate that has it; inf and ``default`` where no error is below inf
    (a NaN never is). errors, values (..., R), default (...) -> (...) x2."""
    finite = jnp.where(errors < jnp.inf, errors, jnp.inf)  # (..., R): NaN as inf
    best = jnp.min(finite, axis=-1)  # (...)
    value = jnp.take_along_axis(values, first_argmin(finite)[..., None], axis=-1)[..., 0]  # (...)
    return best, jnp.where(best < jnp.inf, value, default)


def by_rows(fn: Callable[..., T], *args: Any, rows: int) -> T:
    """``fn`` over the leading (row) axis of ``args`` (pytrees of (n, ...) arrays), ``rows`` rows per
    step: the same result as ``fn(*args)`` for a row-wise fn, its temporaries ``rows / n`` the size."""
    def one(row: tuple) -> T:
        return jax.tree.map(lambda v: v[0], fn(*jax.tree.map(lambda v: v[None], row)))  # a row's (1, ...)
    return jax.lax.map(one, args, batch_size=rows)


class IQuantEncoder(Encoder, IQuant):
    """An i-quant's encoder: ggml's ``sigma_factor`` of the importance weights, the three-stage
    search and GPTQ's rounding of one sign group at a time."""

    supports_gptq = True
    gptq_group = 8  # one sign group: the parity couples its weights
    sigma_factor: ClassVar[float]

    # ------------------------------------------------------------------ plain search

    @classmethod
    def _layout(cls, v: jax.Array) -> jax.Array:
        """(n, J * S, ...) -> (n, J, P, h, group, ...): sub-blocks, sign groups of 8, grid groups."""
        n, m = v.shape[:2]
        return v.reshape(n, m // cls.sub_block, cls.sub_block // 8, 8 // cls.group, cls.group, *v.shape[2:])

    @classmethod
    def _odd(cls, neg: jax.Array) -> jax.Array:
        """(n, J * S) -> (n, J, P): sign groups whose count of negatives the parity cannot store."""
        n, m = neg.shape
        count = jnp.sum(neg.reshape(n, m // cls.sub_block, cls.sub_block // 8, 8), axis=-1)  # (n, J, P)
        return (count % 2 == 1) & cls.parity

    @classmethod
    def _terms(cls, a: jax.Array, w: jax.Array, odd: jax.Array) -> dict[str, jax.Array]:
        """The scale-free parts of every group's error against every grid point.

        a, w (n, J * S) magnitudes and search weights, odd (n, J, P) -> B, C
        (n, J, P, h, K) and ``flip`` (n, J, P, h), the grid groups that hold
        their sign group's flip; an odd group's B includes its best flip. With
        two grid groups per sign group (iq3_xxs) the flip goes where it costs
        least at the scale max|x| / max grid value, before any scale is
        searched: placing it per candidate scale would double every score.
        """
        grid = cls.grid()  # (K, g)
        a5, w5 = cls._layout(a), cls._layout(w)  # (n, J, P, h, g) x2
        wa = w5 * a5
        b = jnp.einsum("njphi,ki->njphk", wa, grid, precision=HIGHEST)  # (n, J, P, h, K)
        c = jnp.einsum("njphi,ki->njphk", w5, grid * grid, precision=HIGHEST)  # (n, J, P, h, K)
        flip = jnp.zeros(b.shape[:-1], bool)  # (n, J, P, h)
        if not cls.parity:
            return {"B": b, "C": c, "flip": flip}
        bf = b - 2 * jnp.min(wa[..., None, :] * grid, axis=-1)  # (n, J, P, h, K)
        flip = jnp.broadcast_to(odd[..., None], flip.shape)
        if cls.group < 8:
            s = jnp.max(a5, axis=(2, 3, 4)) / float(np.max(gguf_grid(cls.quant)))  # (n, J)
            ss = s[:, :, None, None, None]
            gain = jnp.min(ss * (ss * c - 2 * bf), axis=-1) - jnp.min(ss * (ss * c - 2 * b), axis=-1)  # (n, J, P, h)
            flip = flip & (jnp.arange(gain.shape[-1]) == jnp.argmin(gain, axis=-1)[..., None])
        return {"B": jnp.where(flip[..., None], bf, b), "C": c, "flip": flip}

    @classmethod
    def _scores(cls, terms: dict[str, jax.Array], s: jax.Array) -> jax.Array:
        """Errors less their constant part for sub-block scales s (n, J): (n, J, P, h, K)."""
        ss = s[:, :, None, None, None]  # (n, J, 1, 1, 1)
        return ss * (ss * terms["C"] - 2 * terms["B"])

    @classmethod
    def _errors(cls, terms: dict[str, jax.Array], s: jax.Array) -> jax.Array:
        """Weighted error less its constant part (n, J) of the best points for scales s (n, J)."""
        return jnp.sum(jnp.min(cls._scores(terms, s), axis=-1), axis=(2, 3))

    @classmethod
    def _candidate_errors(cls, terms: dict[str, jax.Array], s: jax.Array) -> jax.Array:
        """``_errors`` of R candidate scales per sub-block at once: s (n, J, R) -> (n, J, R).

        Each score is ``_scores``' own expression. The candidates sit next to each other, inside the
        grid points' reduction, so B and C are read once for all of them: scored one at a time, each
        candidate read them again, (blocks, groups, K) floats per pass, which bound the search on a GPU.
        """
        ss = s[:, :, None, None, :, None]  # (n, J, 1, 1, R, 1)
        scores = ss * (ss * terms["C"][..., None, :] - 2 * terms["B"][..., None, :])  # (n, J, P, h, R, K)
        return jnp.sum(jnp.min(scores, axis=-1), axis=(2, 3))  # (n, J, R)

    @classmethod
    def _points(cls, terms: dict[str, jax.Array], s: jax.Array) -> jax.Array:
        """The points of ``_errors``: grid indices (n, J, P, h)."""
        return first_argmin(cls._scores(terms, s))

    @classmethod
    def _best_candidate(cls, terms: dict[str, jax.Array], candidates: jax.Array, default: jax.Array,
                        scale: Callable[[jax.Array], jax.Array], at_once: bool) -> tuple[jax.Array, jax.Array]:
        """The candidate (n, J, R) per sub-block whose scale ``scale(candidate)`` scores the smallest
        ``_errors``, the first on ties, and that error; ``default`` and inf where none scores below inf.

        ``at_once``: all R in one pass (``_candidate_errors``), else one after the other, as a scan, in
        the order of sums the published bytes were made with (the two orders of summing a sub-block's
        groups differ in the last bit, which moves near-ties); see ``candidates_at_once``.
        """
        if at_once:
            return first_smallest(cls._candidate_errors(terms, scale(candidates)), candidates, default)

        def step(best, candidate):
            err_b, c_b = best
            err = cls._errors(terms, scale(candidate))  # (n, J)
            better = err < err_b
            return (jnp.where(better, err, err_b), jnp.where(better, candidate, c_b)), None

        init = (jnp.full(default.shape, jnp.inf, jnp.float32), default)
        (err, chosen), _ = jax.lax.scan(step, init, jnp.moveaxis(candidates, -1, 0))
        return err, chosen

    @classmethod
    def _subblock_scales(cls, a: jax.Array, terms: dict[str, jax.Array], at_once: bool = False
                         ) -> tuple[jax.Array, jax.Array]:
        """Stage 1: float scale s (n, J) per sub-block and the sum C (n, J) of its points (the error's curvature).

        The candidates, max|x| / (ratio * max grid value), are scored with
        their best points; the best one is refit by weighted least squares on
        its points and the refit kept where it scores better.
        """
        n, m = a.shape
        amax = jnp.max(a.reshape(n, m // cls.sub_block, cls.sub_block), axis=-1)  # (n, J)
        s0 = amax / float(np.max(gguf_grid(cls.quant)))  # (n, J)

        candidates = s0[..., None] / jnp.asarray(STAGE1_RATIOS, jnp.float32)  # (n, J, R)
        err, s = cls._best_candidate(terms, candidates, s0, lambda s: s, at_once)  # (n, J) x2
        idx = cls._points(terms, s)[..., None]  # (n, J, P, h, 1)
        b = jnp.sum(jnp.take_along_axis(terms["B"], idx, axis=-1), axis=(2, 3, 4))  # (n, J)
        c = jnp.sum(jnp.take_along_axis(terms["C"], idx, axis=-1), axis=(2, 3, 4))  # (n, J)
        s_fit = jnp.where(c > 0, safe_div(b, c), s)  # (n, J)
        return jnp.where(cls._errors(terms, s_fit) < err, s_fit, s), c

    @classmethod
    def _super_scale(cls, s: jax.Array, c: jax.Array) -> jax.Array:
        """Stage 2: fp16 d (n,) with d * (0.5 + l) * unit close to the scales s (n, J), weighted by c."""
        d, _ = search_grid_scale(s / cls.unit, c, SCALE_LEVELS, jnp.asarray(SUPER_DIVISORS, jnp.float32))
        return d  # (n,)

    @classmethod
    def _scale_codes(cls, terms: dict[str, jax.Array], d: jax.Array, s: jax.Array, at_once: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
        """Stage 3: scale codes l (n, J) for fp16 d (n,) and stage-1 scales s (n, J), and their scales (n, J).

        The code nearest to s and its neighbours are each scored with the
        float32 scale the dequantizer computes, the grid points re-chosen.
        """
        l0 = jnp.clip(jnp.round(safe_div(s / cls.unit, d[:, None]) - 0.5), 0, 15)  # (n, J)

        def scale(l: jax.Array) -> jax.Array:
            return d.reshape(-1, *(1,) * (l.ndim - 1)) * (0.5 + l) * jnp.float32(cls.unit)  # gguf-py's products

        codes = jnp.clip(l0[..., None] + jnp.asarray(CODE_MOVES, jnp.float32), 0, 15)  # (n, J, M)
        _, l = cls._best_candidate(terms, codes, l0, scale, at_once)  # (n, J)
        return l, scale(l)

    @classmethod
    def _flip_signs(cls, a: jax.Array, w: jax.Array, neg: jax.Array, idx: jax.Array, flip: jax.Array) -> jax.Array:
        """Negative flags (n, J * S) with each flip on the weight where it costs least: min_i w_i |x_i| g_i."""
        cost = cls._layout(w * a) * cls.grid()[idx]  # (n, J, P, h, g)
        at = flip[..., None] & (jnp.arange(cls.group) == jnp.argmin(cost, axis=-1)[..., None])  # (n, J, P, h, g)
        return neg ^ at.reshape(neg.shape)

    @classmethod
    def _quantize_some(cls, x: jax.Array, qw: jax.Array) -> jax.Array:
        """Stages 1-3 and packing for x, qw (n, 256) -> (n, type_size)."""
        n = x.shape[0]
        w = ggml_weights(x, qw, cls.sigma_factor)  # (n, 256)
        a, neg = jnp.abs(x), x < 0  # (n, 256) x2
        terms = cls._terms(a, w, cls._odd(neg))
        at_once = candidates_at_once()
        s, c = cls._subblock_scales(a, terms, at_once)  # (n, J) x2
        d = cls._super_scale(s, c)  # (n,)
        l, s = cls._scale_codes(terms, d, s, at_once)  # (n, J) x2
        idx = cls._points(terms, s)  # (n, J, P, h)
        return cls.pack(d, l, idx.reshape(n, -1), cls._flip_signs(a, w, neg, idx, terms["flip"]))

    @classmethod
    def quantize_blocks(cls, x: jax.Array, importance: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)  # (n, 256)
        qw = uniform_importance(x, importance)  # (n, 256)
        return jax.lax.map(lambda xq: cls._quantize_some(*xq), (x[:, None], qw[:, None]),
                           batch_size=search_blocks())[:, 0]  # (n, type_size)


    # ------------------------------------------------------------------ GPTQ

    @classmethod
    def gptq_block_plan(cls, x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """d (n,) by stages 1-2 on the block as it stands, and its sigma2 (n, 1) for the sub-blocks' weights.

        Stage 1, which holds every grid point of every group, runs ``plan_rows()`` rows at a time;
        stage 2 on all rows at once: inside a chunked loop XLA orders its 16-term sums differently,
        and that last bit moved d across fp16 ties on the demo's recipes."""
        sigma2 = cls.sigma_factor * jnp.sum(x * x, axis=-1, keepdims=True) / QK_K  # (n, 1)
        s, c = by_rows(cls.block_subscales, x, importance, sigma2, rows=plan_rows())  # (n, J) x2
        return {"d": cls._super_scale(s, c), "sigma2": sigma2}

    @classmethod
    def block_subscales(cls, x: jax.Array, importance: jax.Array, sigma2: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Stage 1 of ``gptq_block_plan`` for some rows x, importance (n, 256), sigma2 (n, 1): the sub-block
        scales s and their curvatures c (n, J)."""
        a = jnp.abs(x)  # (n, 256)
        terms = cls._terms(a, importance * jnp.sqrt(sigma2 + x * x), cls._odd(x < 0))
        return cls._subblock_scales(a, terms)

    @classmethod
    def gptq_sub_plan(cls, plan: dict[str, jax.Array], x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """Scale code l and scale s (n,) of one sub-block x (n, S) as it stands (stages 1 and 3),
        ``plan_rows()`` rows at a time."""
        return by_rows(cls._sub_plan, plan, x, importance, rows=plan_rows())

    @classmethod
    def _sub_plan(cls, plan: dict[str, jax.Array], x: jax.Array, importance: jax.Array) -> dict[str, jax.Array]:
        """``gptq_sub_plan`` of some rows."""
        a = jnp.abs(x)  # (n, S)
        terms = cls._terms(a, importance * jnp.sqrt(plan["sigma2"] + x * x), cls._odd(x < 0))  # J = 1
        s, _ = cls._subblock_scales(a, terms)  # (n, 1)
        l, s = cls._scale_codes(terms, plan["d"], s)  # (n, 1) x2
        return {"l": l[:, 0], "s": s[:, 0]}

    @classmethod
    def gptq_round_group(cls, sub: dict[str, jax.Array], cols: jax.Array,
                         upper: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One sign group (n, 8): signs from the weights, the parity's flip on the weight with the least
        P_ii x_i^2 (ggml's rule under P = U^-1 U^-T), then each grid group's point minimising
        ``|| e U_t^-1 ||^2`` over the whole grid, its error fed to the rest of the sign group. A grid
        that carries the signs (not ``signed``: iq1_m) takes every sign +.

        Codes (n, 8): grid index << 1 | negative, per column.
        """
        n = cols.shape[0]
        g = cls.group
        grid = cls.grid()  # (K, g)
        outer = (grid[:, :, None] * grid[:, None, :]).reshape(grid.shape[0], g * g)  # (K, g*g)
        inv_u = jax.scipy.linalg.solve_triangular(upper, jnp.eye(8, dtype=upper.dtype))  # (8, 8) upper
        neg = (cols < 0) & cls.signed  # (n, 8)
        if cls.parity:
            cost = jnp.sum(inv_u * inv_u, axis=1) * cols * cols  # (n, 8): P_ii x_i^2
            odd = jnp.sum(neg, axis=-1) % 2 == 1  # (n,)
            neg = neg ^ (odd[:, None] & (jnp.arange(8) == jnp.argmin(cost, axis=-1)[:, None]))
        sign = jnp.where(neg, -1.0, 1.0).astype(jnp.float32)  # (n, 8)
        s = sub["s"][:, None]  # (n, 1)
        codes, values = [], []
        for t in range(8 // g):
            part = slice(t * g, (t + 1) * g)
            v_t = jax.scipy.linalg.solve_triangular(upper[part, part], jnp.eye(g, dtype=upper.dtype))  # (g, g)
            p_t = v_t @ v_t.T  # (g, g): the grid group's metric
            lin = jnp.matmul((cols[:, part] @ p_t) * sign[:, part], grid.T, precision=HIGHEST)  # (n, K)
            quad = jnp.matmul((p_t * sign[:, part, None] * sign[:, None, part]).reshape(n, g * g), outer.T,
                              precision=HIGHEST)  # (n, K)
            idx = first_argmin(s * (s * quad - 2 * lin))  # (n,)
            mag = s * grid[idx]  # (n, g)
            value = jnp.where(neg[:, part], -mag, mag)  # (n, g), the dequantizer's value
            err = jnp.matmul(cols[:, part] - value, v_t, precision=HIGHEST)  # (n, g)
            cols = cols.at[:, part.stop:].add(-jnp.matmul(err, upper[part, part.stop:], precision=HIGHEST))
            codes.append(jnp.broadcast_to((idx << 1)[:, None], (n, g)) | neg[:, part].astype(jnp.int32))
            values.append(value)
        return jnp.concatenate(codes, axis=1), jnp.concatenate(values, axis=1)  # (n, 8) x2

    @classmethod
    def gptq_pack(cls, plan: dict[str, jax.Array], subs: dict[str, jax.Array], codes: jax.Array) -> jax.Array:
        return cls.pack(plan["d"], subs["l"].T, (codes >> 1)[:, ::cls.group], (codes & 1).astype(bool))


class IQ2_XXSEncoder(IQuantEncoder, IQ2_XXS):
    """iq2_xxs's search settings."""

    sigma_factor = 1.0


class IQ2_XSEncoder(IQuantEncoder, IQ2_XS):
    """iq2_xs's search settings."""

    sigma_factor = 1.0


class IQ2_SEncoder(IQuantEncoder, IQ2_S):
    """iq2_s's search settings."""

    sigma_factor = 2.0


class IQ3_XXSEncoder(IQuantEncoder, IQ3_XXS):
    """iq3_xxs's search settings."""

    sigma_factor = 2.0
