"""Float64 NumPy references for the quantization kernels and the routed layer they are scored on.

Written loop-by-loop from the algorithms' descriptions, independently of the
JAX code, so the tests can check the kernels against them (and against ggml's
own iq4_nl search). Importable by any test that wants a reference.
"""

from __future__ import annotations

import numpy as np

TQ2_0_LEVELS = np.array([-1.0, 0.0, 1.0, 2.0])
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64)


def fp16(d: np.ndarray) -> np.ndarray:
    """Round to the nearest fp16 value, as float64."""
    return np.asarray(d, np.float64).astype(np.float16).astype(np.float64)


def nearest_index(y: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the level nearest to each y (levels ascending), by brute force."""
    dist = np.abs(y[..., None] - levels)  # (..., K)
    return np.argmin(dist, axis=-1)


def assign(x: np.ndarray, d: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Nearest level indices for x (n, B) and scales d (n,); d = 0 -> the level nearest 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(d[:, None] == 0, 0.0, x / d[:, None])  # (n, B)
    return nearest_index(y, levels)


def weighted_error(x: np.ndarray, w: np.ndarray, values: np.ndarray) -> np.ndarray:
    """sum_i w_i (x_i - v_i)^2 per row, in float64: (n, B) -> (n,)."""
    r = np.asarray(x, np.float64) - np.asarray(values, np.float64)
    return np.sum(np.asarray(w, np.float64) * r * r, axis=-1)


def grid_search(x: np.ndarray, w: np.ndarray, levels: np.ndarray, divisors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' scale search in float64: per block, for each candidate
    d = x_ext / divisor, assign nearest levels, refit d by weighted least
    squares; score both d's after fp16 rounding and re-assignment; keep the
    best (starting from d = 0). Returns (d (n,), idx (n, B))."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n = x.shape[0]
    x_ext = x[np.arange(n), np.argmax(np.abs(x), axis=1)]  # (n,)
    best_d = np.zeros(n)
    best_idx = assign(x, best_d, levels)
    best_err = weighted_error(x, w, best_d[:, None] * levels[best_idx])
    for divisor in divisors:
        d_cand = x_ext / divisor
        q = levels[assign(x, d_cand, levels)]
        num = np.sum(w * x * q, axis=1)
        den = np.sum(w * q * q, axis=1)
        d_fit = np.where(den > 0, num / np.where(den > 0, den, 1.0), d_cand)
        for d in (d_cand, d_fit):
            d16 = fp16(d)
            idx = assign(x, d16, levels)
            err = weighted_error(x, w, d16[:, None] * levels[idx])
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_d = np.where(better, d16, best_d)
            best_idx = np.where(better[:, None], idx, best_idx)
    return best_d, best_idx


def ggml_iq4_nl_block(x: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    """ggml's quantize_row_iq4_nl_impl for one 32-weight block (ntry = 7), with
    the weights w given directly. Returns (fp16 d, level indices)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    values = KVALUES_IQ4NL
    amax_pos = int(np.argmax(np.abs(x)))
    amax, vmax = abs(x[amax_pos]), x[amax_pos]
    if amax < 1e-15:
        return 0.0, nearest_index(np.zeros_like(x), values)

    def fit(inv_scale: float) -> tuple[float, float]:
        q = values[nearest_index(inv_scale * x, values)]
        return float(np.sum(w * q * x)), float(np.sum(w * q * q))

    sumqx, sumq2 = fit(1.0 / (-vmax / values[0]))
    d = sumqx / sumq2 if sumq2 > 0 else 0.0
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = fit((itry + values[0]) / vmax)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    d16 = float(fp16(np.array(d)))
    inv = 1.0 / d if d else 0.0
    return d16, nearest_index(inv * x, values)


def ggml_iq4_nl(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Dequantized values of ggml's iq4_nl search over blocks: (n, 32) -> (n, 32)."""
    out = np.empty(x.shape, np.float64)
    for i in range(x.shape[0]):
        d16, idx = ggml_iq4_nl_block(x[i], w[i])
        out[i] = d16 * KVALUES_IQ4NL[idx]
    return out


IQ1M_KMAP_SIZE = 43692  # ggml's kmap_size: every 2-bit packed group of 8 levels


def iq1m_tables(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """ggml's ``iq2xs_init_impl`` for IQ1_M from the grid of values in {-1, 0, 1} (2048, 8): each point's
    positions 2 L + 1 (L = value + 1), the map kmap[u] from the 2-bit packed levels u = sum_j L_j << 2j
    to the point (-1 off the grid) and, per off-grid u with levels 0..2, its neighbours: the points at
    the three smallest squared distances of positions, ordered by (distance, index)."""
    levels = (np.asarray(grid) + 1).astype(np.int64)  # (2048, 8)
    pos = 2 * levels + 1  # (2048, 8)
    kmap = np.full(IQ1M_KMAP_SIZE, -1, np.int64)
    kmap[np.sum(levels << (2 * np.arange(8)), axis=1)] = np.arange(levels.shape[0])
    neighbours = {}
    for u in np.flatnonzero(kmap < 0):
        lu = (u >> (2 * np.arange(8))) & 3  # (8,)
        if (lu == 3).any():
            continue
        d2 = np.sum((pos - (2 * lu + 1)) ** 2, axis=1)  # (2048,)
        order = np.lexsort((np.arange(d2.size), d2))
        shells = np.unique(d2)[:3]
        neighbours[int(u)] = order[: np.count_nonzero(d2 <= shells[-1])]
    return pos, kmap, neighbours


def ggml_iq1_m(x: np.ndarray, qw: np.ndarray, grid: np.ndarray, tables=None) -> tuple[np.ndarray, dict]:
    """ggml's ``quantize_row_iq1_m_impl`` (ggml-quants.c, with quant_weights) in float32 NumPy, one
    vector operation per C statement, over all blocks at once: x, qw (n, 256) -> the bytes (n, 56) and
    the intermediates {"scales": (n, 16) sub-block scales, "d": (n,) d before the fp16 rounding}.

    NumPy rounds every product and sum to float32 on its own, as ggml's C (built without FMA
    contraction) does; sums run in C's order; the sort is stable (glibc's qsort merge-sorts)."""
    f32 = np.float32
    x, qw = np.asarray(x, f32), np.asarray(qw, f32)
    n = x.shape[0]
    rows = np.arange(n)
    pos, kmap, neighbours = tables if tables is not None else iq1m_tables(grid)
    delta = f32(0.125)
    x_p = np.array([f32(-1) + delta, delta, f32(1) + delta], f32)
    x_m = np.array([f32(-1) - delta, -delta, f32(1) - delta], f32)
    p2, m2 = x_p[2], x_m[2]
    cp1, cp2 = x_p[0] * x_p[0] - x_p[1] * x_p[1], x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1, cm2 = x_m[0] * x_m[0] - x_m[1] * x_m[1], x_m[1] * x_m[1] - x_m[2] * x_m[2]
    masks = np.array([0x00, 0x80, 0x08, 0x88], np.uint8)
    flt_max = f32(np.finfo(f32).max)
    qs, qh, sc = np.zeros((n, 32), np.uint8), np.zeros((n, 16), np.uint8), np.zeros((n, 4), np.uint16)

    sumx2 = np.zeros(n, f32)
    for i in range(256):
        sumx2 = sumx2 + x[:, i] * x[:, i]
    sigma2 = f32(2) * sumx2 / f32(256)  # (n,)
    weight = qw * np.sqrt(sigma2[:, None] + x * x)  # (n, 256)
    scales, shifts = np.zeros((n, 16), f32), np.zeros((n, 16), np.int64)
    max_scale = np.zeros(n, f32)
    for ib in range(16):
        xb, wb = x[:, 16 * ib:16 * ib + 16], weight[:, 16 * ib:16 * ib + 16]  # (n, 16)
        amax = np.max(np.abs(xb), axis=1)
        order = np.argsort(xb, axis=1, kind="stable")
        px, pw = np.zeros((n, 2, 17), f32), np.zeros((n, 2, 17), f32)
        for j in range(16):
            i = order[:, j]
            h = (i >= 8).astype(np.int64)
            px[:, :, j + 1], pw[:, :, j + 1] = px[:, :, j], pw[:, :, j]
            px[rows, h, j + 1] = px[rows, h, j] + wb[rows, i] * xb[rows, i]
            pw[rows, h, j + 1] = pw[rows, h, j] + wb[rows, i]
        txs, tws = px[:, :, 16], pw[:, :, 16]  # (n, 2)
        best, scale = np.full(n, -flt_max, f32), amax.copy()
        b1, b2, bk = np.full(n, -1), np.full(n, -1), np.full(n, -1)
        for i1 in range(17):
            for i2 in range(i1, 17):
                sx = px[:, :, i1] + px[:, :, i2]  # (n, 2)
                qx_p, qx_m = txs * p2 - sx, txs * m2 - sx
                q2_p = tws * p2 * p2 + pw[:, :, i1] * cp1 + pw[:, :, i2] * cp2
                q2_m = tws * m2 * m2 + pw[:, :, i1] * cm1 + pw[:, :, i2] * cm2
                sumqx = (qx_p[:, 0] + qx_p[:, 1], qx_p[:, 0] + qx_m[:, 1], qx_m[:, 0] + qx_p[:, 1],
                         qx_m[:, 0] + qx_m[:, 1])
                sumq2 = (q2_p[:, 0] + q2_p[:, 1], q2_p[:, 0] + q2_m[:, 1], q2_m[:, 0] + q2_p[:, 1],
                         q2_m[:, 0] + q2_m[:, 1])
                for k in range(4):
                    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                        take = (sumq2[k] > 0) & (sumqx[k] * sumqx[k] > best * sumq2[k])
                        s = sumqx[k] / sumq2[k]
                        best = np.where(take, s * sumqx[k], best)
                    scale = np.where(take, s, scale)
                    b1, b2, bk = np.where(take, i1, b1), np.where(take, i2, b2), np.where(take, k, bk)
        empty = (amax < f32(1e-7)) | (bk < 0)
        L = np.zeros((n, 16), np.int64)
        for j in range(16):
            L[rows, order[:, j]] = np.where(j < b1, 0, np.where(j < b2, 1, 2))
        flip = scale < 0
        L = np.where(flip[:, None], 2 - L, L)
        scale = np.where(flip, -scale, scale)
        bk = np.where(flip, 3 - bk, bk)
        index = np.zeros((n, 2), np.int64)
        off_grid = np.zeros(n, bool)
        for k in range(2):
            minus = bk >= 2 if k == 0 else bk % 2 == 1  # (n,): the group's levels are x_m
            u = np.sum(L[:, 8 * k:8 * k + 8] << (2 * np.arange(8)), axis=1)
            index[:, k] = kmap[u]
            for r in np.flatnonzero((kmap[u] < 0) & ~empty):
                off_grid[r] = True
                xx = x_m if minus[r] else x_p
                cand = neighbours[int(u[r])]
                d2 = np.zeros(cand.size, f32)
                for i in range(8):
                    q = xx[(pos[cand, i] - 1) // 2]
                    diff = scale[r] * q - xb[r, 8 * k + i]
                    d2 = d2 + wb[r, 8 * k + i] * diff * diff
                index[r, k] = cand[np.argmin(np.where(d2 < flt_max, d2, np.inf))]  # the first least
                L[r, 8 * k:8 * k + 8] = (pos[index[r, k]] - 1) // 2
        sqx, sq2 = np.zeros(n, f32), np.zeros(n, f32)
        for k in range(2):
            xx = np.where(((bk >= 2) if k == 0 else (bk % 2 == 1))[:, None], x_m, x_p)  # (n, 3)
            for j in range(8):
                q = xx[rows, L[:, 8 * k + j]]
                sqx = sqx + wb[:, 8 * k + j] * q * xb[:, 8 * k + j]
                sq2 = sq2 + wb[:, 8 * k + j] * q * q
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(off_grid & (sqx > 0) & (sq2 > 0), sqx / sq2, scale)
        scale = np.where(empty, f32(0), scale)
        index = np.where(empty[:, None], 0, index)
        qs[:, 2 * ib], qs[:, 2 * ib + 1] = index[:, 0] & 255, index[:, 1] & 255
        qh[:, ib] = (index[:, 0] >> 8) | ((index[:, 1] >> 8) << 4)
        scales[:, ib], shifts[:, ib] = scale, np.where(empty, 0, bk)
        max_scale = np.where(max_scale > scale, max_scale, scale)

    live = max_scale != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        d = max_scale / f32(15)
        inv = f32(1) / d
    sqx, sq2 = np.zeros(n, f32), np.zeros(n, f32)
    for ib in range(16):
        with np.errstate(invalid="ignore"):
            fval = f32(0.5) * (inv * scales[:, ib] - f32(1))
        val = np.where(live, fval, f32(0)) + f32(12582912)  # ggml's nearest_int
        l = np.clip((val.view(np.int32) & 0x007FFFFF) - 0x00400000, 0, 7)
        sc[:, ib // 4] |= np.where(live, l << (3 * (ib % 4)), 0).astype(np.uint16)
        qh[:, ib] |= np.where(live, masks[shifts[:, ib]], 0).astype(np.uint8)
        for k in range(2):
            xx = np.where(((shifts[:, ib] >= 2) if k == 0 else (shifts[:, ib] % 2 == 1))[:, None], x_m, x_p)
            point = qs[:, 2 * ib + k].astype(np.int64) + ((qh[:, ib].astype(np.int64) << (8 - 4 * k)) & 0x700)
            for j in range(8):
                q = xx[rows, (pos[point, j] - 1) // 2] * (2 * l + 1).astype(f32)
                w = weight[:, 16 * ib + 8 * k + j]
                sqx = sqx + w * q * x[:, 16 * ib + 8 * k + j]
                sq2 = sq2 + w * q * q
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sq2 > 0, sqx / sq2, d)
    bits = (d * f32(1.1125)).astype(np.float16).view(np.uint16)
    for t in range(4):
        sc[:, t] |= np.where(live, (bits >> (4 * t)) & 0xF, 0).astype(np.uint16) << 12
    raw = np.concatenate([qs, qh, sc.astype("<u2").view(np.uint8).reshape(n, 8)], axis=1)
    return raw, {"scales": scales, "d": np.where(live, d, f32(0))}


def gptq(
    w: np.ndarray, hessian: np.ndarray, levels: np.ndarray, divisors: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """Textbook (unblocked) GPTQ in float64 with block scales chosen at each
    group start from the error-updated weights (importance = diag(H)).

    Returns (d (rows, n_groups), dequantized values (rows, cols))."""
    W = np.array(w, np.float64)
    H = np.asarray(hessian, np.float64)
    rows, cols = W.shape
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # H^-1 = U^T U
    importance = np.diag(H)
    Q = np.zeros_like(W)
    d = np.zeros(rows)
    scales = np.zeros((rows, cols // block))
    for i in range(cols):
        if i % block == 0:
            g = i // block
            d, _ = grid_search(W[:, i:i + block], np.broadcast_to(importance[i:i + block], (rows, block)), levels, divisors)
            scales[:, g] = d
        q = d * levels[assign(W[:, i:i + 1], d, levels)[:, 0]]
        Q[:, i] = q
        err = (W[:, i] - q) / U[i, i]
        W[:, i + 1:] -= np.outer(err, U[i, i + 1:])
    return scales, Q


def output_error(w: np.ndarray, q: np.ndarray, hessian: np.ndarray) -> float:
    """tr((W - Q) H (W - Q)^T): the layer's expected squared output error."""
    D = np.asarray(w, np.float64) - np.asarray(q, np.float64)
    return float(np.einsum("ij,jk,ik->", D, np.asarray(hessian, np.float64), D))


def ggml_kquant_weights(x: np.ndarray, qw: np.ndarray, sigma_factor: float | None) -> np.ndarray:
    """ggml's k-quant search weights with an imatrix (quantize_row_q*_K_impl), per 256-weight block:
    qw * sqrt(sigma2 + x^2), sigma2 = sigma_factor * sum(x^2) / 256; qw alone when sigma_factor is None."""
    x = np.asarray(x, np.float64)
    qw = np.broadcast_to(np.asarray(qw, np.float64), x.shape)
    if sigma_factor is None:
        return qw.copy()
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for b in range(0, x.shape[1], 256):
            blk = x[i, b:b + 256]
            sigma2 = sigma_factor * np.sum(blk * blk) / 256
            out[i, b:b + 256] = qw[i, b:b + 256] * np.sqrt(sigma2 + blk * blk)
    return out


def gptq_with_plans(w: np.ndarray, hessian: np.ndarray, importance: np.ndarray, block: int, sub: int,
                    code_range: tuple[int, int], block_plan, sub_plan) -> np.ndarray:
    """Textbook (unblocked) GPTQ in float64 for formats with sub-block scales.

    ``block_plan(W_block, importance_block)`` is called when a block's first
    column starts and ``sub_plan(plan, W_sub, importance_sub) -> (a, b)``
    when a sub-block's does, both on the error-updated weights; a column is
    then rounded to a * q - b, q the nearest integer in ``code_range``.
    Returns the dequantized values (rows, cols)."""
    W = np.array(w, np.float64)
    H = np.asarray(hessian, np.float64)
    rows, cols = W.shape
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # H^-1 = U^T U
    imp = np.broadcast_to(np.asarray(importance, np.float64), (rows, cols))
    Q = np.zeros_like(W)
    plan = a = b = None
    for i in range(cols):
        if i % block == 0:
            plan = block_plan(W[:, i:i + block], imp[:, i:i + block])
        if i % sub == 0:
            a, b = sub_plan(plan, W[:, i:i + sub], imp[:, i:i + sub])
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(a == 0, 0.0, (W[:, i] + b) / a)
        q = np.clip(np.floor(y + 0.5), *code_range)
        Q[:, i] = a * q - b
        err = (W[:, i] - Q[:, i]) / U[i, i]
        W[:, i + 1:] -= np.outer(err, U[i, i + 1:])
    return Q


def best_group_errors(x: np.ndarray, w: np.ndarray, scale: np.ndarray, grid: np.ndarray, parity: bool) -> np.ndarray:
    """Brute force: per group of len(grid[0]) weights, the least sum w (x - sign * scale * g)^2 over every
    grid point g, signs those of x except, with parity, one flipped in each group of 8 with an odd count of
    negatives (every weight tried). x, w, scale (n, 256) -> (n, 256 / group) float64. The flip is placed
    within the grid group (sign groups of 8 hold one grid group here)."""
    x, w, scale = (np.asarray(v, np.float64) for v in (x, w, scale))
    n, g = x.shape[0], grid.shape[1]
    xg, wg, sg = (v.reshape(n, -1, g) for v in (x, w, scale))  # (n, G, g)
    neg = xg < 0
    best = np.full(xg.shape[:2], np.inf)
    flips = [None] + (list(range(g)) if parity else [])
    odd = (neg.sum(-1) % 2 == 1) if parity else np.zeros(xg.shape[:2], bool)  # (n, G)
    for flip in flips:
        s = np.where(neg, -1.0, 1.0)
        if flip is not None:
            s[..., flip] *= -1
        for k in range(grid.shape[0]):
            err = np.sum(wg * (xg - s * sg * grid[k]) ** 2, axis=-1)  # (n, G)
            allowed = odd if flip is not None else ~odd
            best = np.where(allowed & (err < best), err, best)
    return best


def gptq_codebook(w: np.ndarray, hessian: np.ndarray, importance: np.ndarray, block: int, sub: int,
                  grid: np.ndarray, parity: bool, block_plan, sub_plan, signed: bool = True) -> np.ndarray:
    """Textbook (unblocked) GPTQ in float64 for codebook formats.

    Columns go in sign groups of 8: ``block_plan(W_block, importance_block)``
    when a block starts and ``sub_plan(plan, W_sub, importance_sub) -> scale
    (rows,)`` when a sub-block starts, both on the error-updated weights. A
    sign group takes the signs of its weights; with parity, an odd count of
    negatives flips the weight with the least P_ii x_i^2, P the inverse of the
    group's block of H^-1. Then each grid group of the sign group takes the
    point minimising e P_t e^T over the whole grid (P_t the inverse of its
    block of the remaining H^-1, e against its error-updated weights), and
    its columns' errors are fed forward one column at a time. Without ``signed`` (iq1_m) the grid
    carries the signs: every sign is +.
    Returns the dequantized values (rows, cols)."""
    W = np.array(w, np.float64)
    H = np.asarray(hessian, np.float64)
    grid = np.asarray(grid, np.float64)
    rows, cols = W.shape
    g = grid.shape[1]
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # H^-1 = U^T U
    imp = np.broadcast_to(np.asarray(importance, np.float64), (rows, cols))
    Q = np.zeros_like(W)
    plan = scale = None
    for i0 in range(0, cols, 8):
        if i0 % block == 0:
            plan = block_plan(W[:, i0:i0 + block], imp[:, i0:i0 + block])
        if i0 % sub == 0:
            scale = sub_plan(plan, W[:, i0:i0 + sub], imp[:, i0:i0 + sub])
        x = W[:, i0:i0 + 8]
        sign = np.where((x < 0) & signed, -1.0, 1.0)  # (rows, 8)
        if parity:
            u8 = U[i0:i0 + 8, i0:i0 + 8]
            p_diag = np.diag(np.linalg.inv(u8.T @ u8))
            odd = np.sum(x < 0, axis=1) % 2 == 1
            at = np.argmin(p_diag * x * x, axis=1)
            sign[odd, at[odd]] *= -1
        for t in range(8 // g):
            c = i0 + t * g
            u_t = U[c:c + g, c:c + g]
            p_t = np.linalg.inv(u_t.T @ u_t)
            cand = scale[:, None, None] * grid[None] * sign[:, None, t * g:(t + 1) * g]  # (rows, K, g)
            e = W[:, None, c:c + g] - cand
            k = np.argmin(np.einsum("rki,ij,rkj->rk", e, p_t, e), axis=1)  # (rows,)
            Q[:, c:c + g] = cand[np.arange(rows), k]
            for col in range(c, c + g):
                err = (W[:, col] - Q[:, col]) / U[col, col]
                W[:, col + 1:] -= np.outer(err, U[col, col + 1:])
    return Q


def routed_output(w: dict[str, np.ndarray], x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The routed experts' output sum_k weight_k * down_e(silu(gate_e x) * up_e x), float64: (T, d).

    w: ffn_gate_exps / ffn_up_exps (E, f, d), ffn_down_exps (E, d, f); x (T, d); experts and
    weights (T, k), the routing a dump records."""
    x = np.asarray(x, np.float64)  # (T, d)
    y = np.zeros_like(x)  # (T, d)
    for slot in range(experts.shape[1]):
        for e in np.unique(experts[:, slot]):
            rows = experts[:, slot] == e
            g = x[rows] @ np.asarray(w["ffn_gate_exps"][e], np.float64).T  # (n, f)
            u = x[rows] @ np.asarray(w["ffn_up_exps"][e], np.float64).T  # (n, f)
            h = g / (1.0 + np.exp(-g)) * u  # (n, f)
            y[rows] += weights[rows, slot, None] * (h @ np.asarray(w["ffn_down_exps"][e], np.float64).T)  # (n, d)
    return y
