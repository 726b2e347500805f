"""Per-layer output scale alpha for quantized routed experts.

Quantization shrinks or inflates a layer's routed output y_q relative to the
reference y_ref. One scalar per layer, alpha, rescales W_down of every routed
expert so that alpha * y_q best matches y_ref in least squares:

    alpha = <y_ref, y_q> / ||y_q||^2        (argmin_a ||y_ref - a y_q||^2)

computed over all tokens and all model dimensions. `relative_residual`
measures what is left, ||y_ref - y||^2 / ||y_ref||^2. The "oracle" alpha is the
same formula fitted on the evaluation data itself (`oracle_from_gram`): the best
any single scale could do there, against which the calibration-fitted alpha is
judged.

Every sum is an inner product from `output_gram`: each row's products summed on
the device where the outputs already are (float32, a row at a time), the rows'
partial sums added in float64 on the host. A dump holds tens of millions of
activations, so one float32 sum over all of them would lose digits, and a
float64 pass on the host over (65,536, 2,048) outputs is seconds of one core a
layer (bench/speed/bench_calibrate_stats.py); a row's 2,048 products lose at
most a few float32 ulps. Where several residuals of the same outputs are
wanted, `output_gram` reads the rows once and `residual_from_gram` gives each
from its inner products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike


def alpha_stats(y_ref: ArrayLike, y_q: ArrayLike) -> tuple[float, float, float]:
    """(<y_ref, y_q>, ||y_q||^2, ||y_ref||^2) in float64 (`output_gram`'s entries); additive over token chunks."""
    gram = output_gram(y_ref, y_q)  # (2, 2)
    return float(gram[0, 1]), float(gram[1, 1]), float(gram[0, 0])


def alpha_from_stats(dot: float, norm_q: float) -> float:
    """The least-squares scale <y_ref, y_q> / ||y_q||^2 from accumulated sums."""
    if not norm_q > 0:
        raise ValueError("y_q is zero: alpha is undefined")
    return dot / norm_q


def fit_alpha(y_ref: ArrayLike, y_q: ArrayLike) -> float:
    """argmin_a ||y_ref - a y_q||^2 = <y_ref, y_q> / ||y_q||^2; y_ref, y_q (N, d)."""
    dot, norm_q, _ = alpha_stats(y_ref, y_q)
    return alpha_from_stats(dot, norm_q)


def relative_residual(y_ref: ArrayLike, y: ArrayLike, scale: float = 1.0) -> float:
    """||y_ref - scale * y||^2 / ||y_ref||^2 over all rows and columns; (N, d) each.

    From the inner products (`residual_from_gram`), `scale` applied in float64,
    so the residual of alpha * y_q needs no rounded float32 alpha * y_q.
    """
    return residual_from_gram(output_gram(y_ref, y), 0, {1: scale})


@jax.jit
def _row_products(*outputs: jax.Array) -> jax.Array:
    """P[i, j, n] = <outputs[i][n], outputs[j][n]>, each row's products summed in float32 on the device;
    k outputs (N, ...) -> (k, k, N). P[j, i] is P[i, j] itself, so the gram is exactly symmetric."""
    rows = [o.reshape(o.shape[0], -1).astype(jnp.float32) for o in outputs]  # (N, w) each
    upper = {(i, j): jnp.sum(rows[i] * rows[j], axis=1) for i in range(len(rows)) for j in range(i, len(rows))}
    return jnp.stack([jnp.stack([upper[min(i, j), max(i, j)] for j in range(len(rows))])
                      for i in range(len(rows))])  # (k, k, N)


def output_gram(*outputs: ArrayLike) -> np.ndarray:
    """G[i, j] = <outputs[i], outputs[j]> over all rows and columns, float64: every scale and residual
    among these outputs follows from it (`residual_from_gram`), from one pass over the rows on the
    device that holds them (NumPy inputs are copied there), each row's partial sum added in float64.
    (k, k) for k outputs of the same shape (N, d)."""
    shape = np.shape(outputs[0])
    if any(np.shape(a) != shape for a in outputs):
        raise ValueError(f"shape mismatch: {[np.shape(a) for a in outputs]}")
    partials = np.asarray(_row_products(*(jnp.asarray(a) for a in outputs)), dtype=np.float64)  # (k, k, N)
    return partials.sum(axis=-1)  # (k, k)


def residual_from_gram(gram: np.ndarray, ref: int, terms: dict[int, float]) -> float:
    """||y_ref - sum_i c_i y_i||^2 / ||y_ref||^2 with y_ref the output at `ref` and `terms` {i: c_i},
    from `output_gram`'s matrix: v^T G v / G[ref, ref] for v = e_ref - sum_i c_i e_i."""
    v = np.zeros(len(gram))  # (k,)
    v[ref] = 1.0
    for i, c in terms.items():
        v[i] -= c
    if not gram[ref, ref] > 0:
        raise ValueError("y_ref is zero: the relative residual is undefined")
    return float(max(v @ gram @ v, 0.0) / gram[ref, ref])


def oracle_from_gram(gram: np.ndarray, ref: int, quant: int) -> tuple[float, float]:
    """The best single scale of the output at `quant` on this data itself, and the residual it leaves,
    from `output_gram`'s matrix: (<y_ref, y_q> / ||y_q||^2, its `residual_from_gram`). No scale fitted
    elsewhere can leave a smaller residual on this data, so the gap between a calibration-fitted
    alpha's residual and this one is what the fit loses by not seeing the data."""
    alpha = float(gram[ref, quant] / gram[quant, quant])
    return alpha, residual_from_gram(gram, ref, {quant: alpha})
