"""GPTQ error-feedback rounding for every format with per-block scales.

Rounding every weight to its nearest level ignores that the layer's output
error is ``tr((W - Q) H (W - Q)^T)`` with ``H = E[x x^T]``: correlated inputs let
the error of one column be compensated by the columns after it. GPTQ
(Frantar et al., 2022) quantizes columns in order and pushes each column's
rounding error onto the remaining ones through the upper Cholesky factor U of
H^-1 (``H^-1 = U^T U``), which is the optimal update for that error.

ggml blocks run along a row, so what a block shares is fixed when its first
column starts: the scale of a grid block (tq2_0, iq4_nl); the super-block
scales d (and dmin) of a k-quant, and each k-quant sub-block's scale (and min)
code when the sub-block's first column starts. Both are chosen by the same
importance-weighted searches as plain rounding (importance given, else diag(H)),
on the weights as already updated by the errors so far. Within a block columns
are rounded one by one with the error applied inside the block; the block's
accumulated error is then applied to all later columns as one matrix product
(GPTQ's lazy batch update, with the batch = the ggml block). The format
supplies the plans, the rounding of a column and the packing (its ``Encoder``'s
``gptq_*`` methods).

Codebook formats (the i-quants) round ``gptq_group`` columns at once, since a
grid point covers several weights: the group's error e costs
``|| e U_gg^-1 ||^2`` (U_gg its diagonal block of U), and ``e U_gg^-1`` travels
to the later columns as one column's scaled error would, which is what
feeding the group's columns one by one would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from moeheal.kernels.formats_encode import Encoder


def damp_hessian(hessian: jax.Array, damp: float) -> jax.Array:
    """H + damp * mean(diag(H)) * I: makes H safely positive definite.

    Columns that never saw an input have a zero row and column in H; damping
    relative to the mean diagonal keeps the Cholesky factorisation defined and
    the update scale-free.
    """
    hessian = jnp.asarray(hessian, jnp.float32)  # (cols, cols)
    return hessian + damp * jnp.mean(jnp.diag(hessian)) * jnp.eye(hessian.shape[0], dtype=jnp.float32)  # (cols, cols)


@dataclass(frozen=True)
class GptqSchedule:
    """How GPTQ orders and carries its arithmetic on a device; never what it computes.

    ``update_width``: the columns each rounding step pushes its error onto at
    once (``gptq_quantize``). ``float64_factor``: U from one float64 Cholesky and
    a triangular inverse (``reverse_cholesky_upper``) instead of float32 H^-1
    formed and factored (``inverse_cholesky_upper``, GPTQ's reference): the
    same matrix in exact arithmetic, half the arithmetic, and closer to the
    float64 factor than either float32 route. The CPU keeps the default, whose
    bytes the demo's published figures were made with; ``kernels.gptq_schedule``
    picks per device.
    """

    update_width: int | None = None
    float64_factor: bool = False


# The CPU's schedule, every function's default: the whole ggml block per step, the float32 factor.
CPU_SCHEDULE = GptqSchedule()


def _reversed(matrix: jax.Array) -> jax.Array:
    """J M J, J the exchange matrix: rows and columns in reverse order."""
    return matrix[::-1, ::-1]  # (cols, cols)


def factor_is_finite(upper: jax.Array) -> jax.Array:
    """Whether GPTQ's factor came out finite, i.e. H was positive definite in its precision: () bool.

    Checked on the factor the rounding uses, on the device that rounds: a
    float32 H that the host's float64 factors may not factor here, and the
    reference route's second Cholesky (of H^-1) can fail where the first did
    not. Read from the factor itself, the check costs no factorisation of its own.
    """
    return jnp.all(jnp.isfinite(upper))  # ()


def inverse_cholesky_upper(hessian: jax.Array) -> jax.Array:
    """Upper-triangular U with H^-1 = U^T U (GPTQ's factor), float32; NaN if H is not PD.

    H^-1 is formed and factored as GPTQ's reference does (two Cholesky
    factorisations and two triangular solves against the identity). The
    cheaper U = J chol(J H J)^-1 J in float32 rounds differently, and moved
    q5_k's result away from the float64 reference by 7% on tests/test_gptq.py's
    matrices; ``reverse_cholesky_upper`` takes that route in float64.
    """
    n = hessian.shape[0]
    chol = jnp.linalg.cholesky(hessian)  # (cols, cols) lower, H = L L^T
    h_inv = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(n, dtype=hessian.dtype))  # (cols, cols)
    h_inv = 0.5 * (h_inv + h_inv.T)  # (cols, cols) symmetric up to rounding
    return jnp.linalg.cholesky(h_inv).T  # (cols, cols) upper


def reverse_cholesky_upper(hessian: jax.Array) -> jax.Array:
    """The same U (H^-1 = U^T U) as J L^-1 J with J H J = L L^T, computed in float64; float32 out.

    J H J = L L^T gives H^-1 = (J L^-1 J)^T (J L^-1 J), and J L^-1 J is upper
    triangular: one Cholesky and one triangular inverse, where
    ``inverse_cholesky_upper`` needs two of each and squares H's condition
    number by forming H^-1. float64 keeps the route exact enough for every
    format (float32 was not, see there); on GPUs whose float64 matrix units run
    at float32's speed (the H100 and H200) it costs less than the float32
    reference. NaN if H is not PD.
    """
    n = hessian.shape[0]
    with jax.enable_x64(True):
        chol = jnp.linalg.cholesky(_reversed(hessian).astype(jnp.float64))  # (cols, cols) lower, J H J = L L^T
        chol_inv = jax.scipy.linalg.solve_triangular(chol, jnp.eye(n, dtype=jnp.float64), lower=True)  # (cols, cols)
        return _reversed(chol_inv).astype(jnp.float32)  # (cols, cols) upper


def gptq_factor(hessian: jax.Array, schedule: GptqSchedule = CPU_SCHEDULE) -> jax.Array:
    """GPTQ's U (H^-1 = U^T U) by ``schedule``'s route: (cols, cols) float32 upper, NaN if H is not PD."""
    return reverse_cholesky_upper(hessian) if schedule.float64_factor else inverse_cholesky_upper(hessian)


def gptq_quantize(
    fmt: type[Encoder], w: jax.Array, hessian: jax.Array, importance: jax.Array | None = None,
    schedule: GptqSchedule = CPU_SCHEDULE,
) -> jax.Array:
    """GPTQ-rounded ggml bytes of one matrix: (rows, cols) -> (rows, n_blocks * type_size) uint8.

    hessian (cols, cols) positive definite (already damped); importance (cols,)
    weights the block and sub-block scale searches (diag(H) when None), so a
    variant's tempered activation importance still decides the scales while H
    decides the error feedback. ``gptq_round`` with the factor of ``hessian``.
    """
    hessian = jnp.asarray(hessian, jnp.float32)  # (cols, cols)
    importance = jnp.diag(hessian) if importance is None else importance  # (cols,)
    return gptq_round(fmt, w, gptq_factor(hessian, schedule), importance, schedule)  # (rows, bytes)


def gptq_round(
    fmt: type[Encoder], w: jax.Array, upper: jax.Array, importance: jax.Array,
    schedule: GptqSchedule = CPU_SCHEDULE,
) -> jax.Array:
    """GPTQ-rounded ggml bytes of one matrix from H's factor: (rows, cols) -> (rows, n_blocks * type_size) uint8.

    upper (cols, cols): ``gptq_factor`` of the Hessian, taken as an input so
    that a matrix rounded in row chunks, and the finiteness check, share one
    factorisation; importance (cols,) weights the scale searches.

    ``schedule`` orders the arithmetic, never changes the method (its factor
    route is ``gptq_factor``'s). Its ``update_width``: the columns each
    rounding step pushes its error onto at once. None: the rest of the ggml
    block, every step. A width w (a divisor of the sub-block, or one larger
    than it: then the sub-block) rounds w columns with their errors applied
    among themselves, then pushes the w errors onto the rest of the block as one
    matrix product, a second level of GPTQ's lazy batch update. Exact arithmetic
    is the same; float32 rounds the sums in another order, so a few near-tie
    codes differ. On a GPU the narrow step moves an eighth of the memory per
    column (measured 1.45x faster at the Qwen3-30B-A3B shape, bench/RESULTS.md).
    """
    rows, cols = w.shape
    block, sub, group = fmt.block_size, fmt.sub_block, fmt.gptq_group
    update_width = schedule.update_width
    lazy = update_width is not None
    width = min(update_width, sub) if lazy else sub  # columns rounded per step of the chunk loop
    if sub % width or width % group:
        raise ValueError(f"update_width {update_width}: {fmt.name} needs a divisor of its sub-block of {sub} "
                         f"that is a multiple of its GPTQ group of {group}")
    n_blocks, n_sub, n_chunk = cols // block, block // sub, sub // width
    importance = jnp.asarray(importance, jnp.float32)  # (cols,)
    col_ids = jnp.arange(cols)  # (cols,)

    def block_step(w_cur: jax.Array, b: jax.Array):
        start = b * block
        w_blk = jax.lax.dynamic_slice(w_cur, (0, start), (rows, block))  # (rows, B)
        imp_blk = jnp.broadcast_to(jax.lax.dynamic_slice(importance, (start,), (block,)), (rows, block))  # (rows, B)
        u_blk = jax.lax.dynamic_slice(upper, (start, start), (block, block))  # (B, B)
        plan = fmt.gptq_block_plan(w_blk, imp_blk)

        def sub_step(carry, s):
            w_blk, err = carry
            x_sub = jax.lax.dynamic_slice(w_blk, (0, s * sub), (rows, sub))  # (rows, S)
            imp_sub = jax.lax.dynamic_slice(imp_blk, (0, s * sub), (rows, sub))  # (rows, S)
            sub_plan = fmt.gptq_sub_plan(plan, x_sub, imp_sub)

            def chunk_step(j, carry):
                w_blk, codes, err = carry
                c0 = s * sub + j * width  # the chunk's first column in the block
                if lazy:  # round within the chunk's own columns
                    work, u_work, base = (jax.lax.dynamic_slice_in_dim(w_blk, c0, width, axis=1),  # (rows, w)
                                          jax.lax.dynamic_slice(u_blk, (c0, c0), (width, width)), 0)  # (w, w)
                else:  # every step updates the whole block
                    work, u_work, base = w_blk, u_blk, c0  # (rows, B), (B, B)

                def group_step(i, carry):
                    work, chunk_codes, chunk_err = carry
                    c = base + i * group
                    cols = jax.lax.dynamic_slice_in_dim(work, c, group, axis=1)  # (rows, g)
                    u_gg = jax.lax.dynamic_slice(u_work, (c, c), (group, group))  # (g, g)
                    code, values = fmt.gptq_round_group(sub_plan, cols, u_gg)  # (rows, g) x2
                    if group == 1:
                        g_err = (cols - values) / u_gg[0, 0]  # (rows, 1)
                    else:  # e U_gg^-1: the same as feeding each column's error to the next within the group
                        g_err = jax.scipy.linalg.solve_triangular(u_gg, (cols - values).T, trans="T").T  # (rows, g)
                    u_rows = jax.lax.dynamic_slice_in_dim(u_work, c, group, axis=0)  # (g, width of work)
                    # U upper: only columns >= c move; one column's update is an outer product, which fuses
                    # into the subtraction where a k = 1 matrix product would be a kernel of its own
                    if group == 1:
                        work = work - g_err * u_rows  # (rows, width of work)
                    else:
                        work = work - jnp.matmul(g_err, u_rows, precision=jax.lax.Precision.HIGHEST)
                    return (work, jax.lax.dynamic_update_slice_in_dim(chunk_codes, code, i * group, axis=1),
                            jax.lax.dynamic_update_slice_in_dim(chunk_err, g_err, i * group, axis=1))

                init = (work, jnp.zeros((rows, width), jnp.int32), jnp.zeros((rows, width), jnp.float32))
                work, chunk_codes, chunk_err = jax.lax.fori_loop(0, width // group, group_step, init)  # (rows, w) x2
                if lazy:  # the chunk's errors onto the rest of the block, as one product
                    u_rows = jax.lax.dynamic_slice(u_blk, (c0, 0), (width, block))  # (w, B)
                    w_blk = w_blk - jnp.matmul(chunk_err, u_rows, precision=jax.lax.Precision.HIGHEST)  # (rows, B)
                else:
                    w_blk = work
                return (w_blk, jax.lax.dynamic_update_slice_in_dim(codes, chunk_codes, j * width, axis=1),
                        jax.lax.dynamic_update_slice_in_dim(err, chunk_err, c0, axis=1))

            init = (w_blk, jnp.zeros((rows, sub), jnp.int32), err)
            w_blk, codes, err = jax.lax.fori_loop(0, n_chunk, chunk_step, init)  # (rows, B), (rows, S), (rows, B)
            return (w_blk, err), (sub_plan, codes)

        init = (w_blk, jnp.zeros((rows, block), jnp.float32))
        (_, err), (subs, codes) = jax.lax.scan(sub_step, init, jnp.arange(n_sub))  # codes (n_sub, rows, S)
        codes = jnp.transpose(codes, (1, 0, 2)).reshape(rows, block)  # (rows, B)
        u_rows = jax.lax.dynamic_slice(upper, (start, 0), (block, cols))  # (B, cols)
        later = (col_ids >= start + block).astype(jnp.float32)  # (cols,)
        w_cur = w_cur - jnp.matmul(err, u_rows, precision=jax.lax.Precision.HIGHEST) * later[None, :]  # (rows, cols)
        # HIGHEST: GPUs would otherwise multiply in TF32 and the error feedback would drift
        return w_cur, fmt.gptq_pack(plan, subs, codes)  # (rows, type_size)

    _, blocks = jax.lax.scan(block_step, jnp.asarray(w, jnp.float32), jnp.arange(n_blocks))  # (G, rows, type_size)
    return jnp.transpose(blocks, (1, 0, 2)).reshape(rows, n_blocks * fmt.type_size)  # (rows, bytes)
