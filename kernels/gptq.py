"""GPTQ error-feedback rounding for the scaled-grid formats (tq2_0, iq4_nl).

Rounding every weight to its nearest level ignores that the layer's output
error is ``tr((W - Q) H (W - Q)^T)`` with ``H = E[x x^T]``: correlated inputs let
the error of one column be compensated by the columns after it. GPTQ
(Frantar et al., 2022) quantizes columns in order and pushes each column's
rounding error onto the remaining ones through the upper Cholesky factor U of
H^-1 (``H^-1 = U^T U``), which is the optimal update for that error.

ggml blocks run along a row, so the block scale of a group of ``block_size``
columns is fixed when the group starts: it is chosen by the same
importance-weighted scale search as plain rounding (importance = diag(H)), on
the weights as already updated by the earlier groups' errors. Within a group
columns are rounded one by one with the error applied inside the group; the
group's accumulated error is then applied to all later columns as one matrix
product (GPTQ's lazy batch update, with the batch = the ggml block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moeheal.kernels.formats import GridFormat, nearest_level, nearest_level_value, scaled, search_grid_scale


def damp_hessian(hessian: jax.Array, damp: float) -> jax.Array:
    """H + damp * mean(diag(H)) * I: makes H safely positive definite.

    Columns that never saw an input have a zero row and column in H; damping
    relative to the mean diagonal keeps the Cholesky factorisation defined and
    the update scale-free.
    """
    hessian = jnp.asarray(hessian, jnp.float32)  # (cols, cols)
    return hessian + damp * jnp.mean(jnp.diag(hessian)) * jnp.eye(hessian.shape[0], dtype=jnp.float32)  # (cols, cols)


def inverse_cholesky_upper(hessian: jax.Array) -> jax.Array:
    """Upper-triangular U with H^-1 = U^T U (GPTQ's factor); NaN if H is not PD."""
    n = hessian.shape[0]
    chol = jnp.linalg.cholesky(hessian)  # (cols, cols) lower, H = L L^T
    h_inv = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(n, dtype=hessian.dtype))  # (cols, cols)
    h_inv = 0.5 * (h_inv + h_inv.T)  # (cols, cols) symmetric up to rounding
    return jnp.linalg.cholesky(h_inv).T  # (cols, cols) upper


def gptq_levels(
    fmt: type[GridFormat], w: jax.Array, hessian: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """GPTQ rounding of one matrix to a grid format.

    w (rows, cols) float32, hessian (cols, cols) positive definite (already
    damped). Returns fp16-valued scales (rows, n_groups) and level indices
    (rows, cols).
    """
    rows, cols = w.shape
    block = fmt.block_size
    n_groups = cols // block
    grid = tuple(float(v) for v in fmt.levels)
    divisors = jnp.asarray(fmt.divisors, jnp.float32)  # (C,)
    importance = jnp.diag(hessian)  # (cols,)
    upper = inverse_cholesky_upper(hessian)  # (cols, cols)
    col_ids = jnp.arange(cols)  # (cols,)

    def group_step(w_cur: jax.Array, g: jax.Array):
        start = g * block
        w_grp = jax.lax.dynamic_slice(w_cur, (0, start), (rows, block))  # (rows, B)
        imp_grp = jax.lax.dynamic_slice(importance, (start,), (block,))  # (B,)
        d, _ = search_grid_scale(w_grp, jnp.broadcast_to(imp_grp, w_grp.shape), grid, divisors)  # (rows,)
        u_grp = jax.lax.dynamic_slice(upper, (start, start), (block, block))  # (B, B)

        def col_step(j, carry):
            w_grp, idx, err = carry
            col = w_grp[:, j]  # (rows,)
            col_y = scaled(col[:, None], d)  # (rows, 1)
            col_idx = nearest_level(col_y, grid)[:, 0]  # (rows,)
            col_err = (col - d * nearest_level_value(col_y, grid)[:, 0]) / u_grp[j, j]  # (rows,)
            w_grp = w_grp - col_err[:, None] * u_grp[j][None, :]  # (rows, B); U upper: only columns >= j move
            return w_grp, idx.at[:, j].set(col_idx), err.at[:, j].set(col_err)

        init = (w_grp, jnp.zeros((rows, block), jnp.int32), jnp.zeros((rows, block), jnp.float32))
        _, idx, err = jax.lax.fori_loop(0, block, col_step, init)  # (rows, B) x2
        u_rows = jax.lax.dynamic_slice(upper, (start, 0), (block, cols))  # (B, cols)
        later = (col_ids >= start + block).astype(jnp.float32)  # (cols,)
        w_cur = w_cur - jnp.matmul(err, u_rows, precision=jax.lax.Precision.HIGHEST) * later[None, :]  # (rows, cols)
        # HIGHEST: GPUs would otherwise multiply in TF32 and the error feedback would drift
        return w_cur, (d, idx)

    _, (d, idx) = jax.lax.scan(group_step, jnp.asarray(w, jnp.float32), jnp.arange(n_groups))
    # d (G, rows), idx (G, rows, B)
    return d.T, jnp.transpose(idx, (1, 0, 2)).reshape(rows, cols)  # (rows, G), (rows, cols)


def gptq_quantize(fmt: type[GridFormat], w: jax.Array, hessian: jax.Array) -> jax.Array:
    """GPTQ-rounded ggml bytes of one matrix: (rows, cols) -> (rows, G * type_size) uint8."""
    rows, cols = w.shape
    d, idx = gptq_levels(fmt, w, hessian)  # (rows, G), (rows, cols)
    n_groups = cols // fmt.block_size
    blocks = fmt.pack(d.reshape(-1), idx.reshape(rows * n_groups, fmt.block_size))  # (rows*G, type_size)
    return blocks.reshape(rows, n_groups * fmt.type_size)  # (rows, bytes)
