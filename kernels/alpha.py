"""Per-layer output scale alpha for quantized routed experts.

Quantization shrinks or inflates a layer's routed output y_q relative to the
reference y_ref. One scalar per layer, alpha, rescales W_down of every routed
expert so that alpha * y_q best matches y_ref in least squares:

    alpha = <y_ref, y_q> / ||y_q||^2        (argmin_a ||y_ref - a y_q||^2)

computed over all tokens and all model dimensions. `relative_residual`
measures what is left, ||y_ref - y||^2 / ||y_ref||^2. The "oracle" alpha is the
same formula fitted on the evaluation data itself: the best any single scale
could do there, against which the calibration-fitted alpha is judged.

Sums are accumulated in float64 over row chunks: activations are float32 and a
dump holds tens of millions of them, so float32 sums would lose digits.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

_CHUNK_ROWS = 4096


def _row_chunks(*arrays: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """Equal row slices of same-shape arrays, cast to float64 one chunk at a time."""
    shape = np.shape(arrays[0])
    if any(np.shape(a) != shape for a in arrays):
        raise ValueError(f"shape mismatch: {[np.shape(a) for a in arrays]}")
    for start in range(0, shape[0], _CHUNK_ROWS):
        yield tuple(np.asarray(a[start : start + _CHUNK_ROWS], dtype=np.float64) for a in arrays)


def alpha_stats(y_ref: np.ndarray, y_q: np.ndarray) -> tuple[float, float, float]:
    """(<y_ref, y_q>, ||y_q||^2, ||y_ref||^2) in float64; additive over token chunks."""
    dot = norm_q = norm_ref = 0.0
    for ref, q in _row_chunks(y_ref, y_q):  # (n, d) each
        dot += float(np.einsum("nd,nd->", ref, q))
        norm_q += float(np.einsum("nd,nd->", q, q))
        norm_ref += float(np.einsum("nd,nd->", ref, ref))
    return dot, norm_q, norm_ref


def alpha_from_stats(dot: float, norm_q: float) -> float:
    """The least-squares scale <y_ref, y_q> / ||y_q||^2 from accumulated sums."""
    if not norm_q > 0:
        raise ValueError("y_q is zero: alpha is undefined")
    return dot / norm_q


def fit_alpha(y_ref: np.ndarray, y_q: np.ndarray) -> float:
    """argmin_a ||y_ref - a y_q||^2 = <y_ref, y_q> / ||y_q||^2; y_ref, y_q (N, d)."""
    dot, norm_q, _ = alpha_stats(y_ref, y_q)
    return alpha_from_stats(dot, norm_q)


def relative_residual(y_ref: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
    """||y_ref - scale * y||^2 / ||y_ref||^2 over all rows and columns, float64; (N, d) each.

    `scale` is applied in float64 inside the sum, so the residual of alpha * y_q
    is exact without materialising a rounded float32 alpha * y_q.
    """
    err = norm_ref = 0.0
    for ref, approx in _row_chunks(y_ref, y):  # (n, d) each
        diff = ref - scale * approx  # (n, d)
        err += float(np.einsum("nd,nd->", diff, diff))
        norm_ref += float(np.einsum("nd,nd->", ref, ref))
    if not norm_ref > 0:
        raise ValueError("y_ref is zero: the relative residual is undefined")
    return err / norm_ref


def oracle_alpha(y_ref_eval: np.ndarray, y_q_eval: np.ndarray) -> tuple[float, float]:
    """The best single scale on the evaluation data itself, and the residual it leaves.

    Returns (alpha_oracle, relative_residual(y_ref_eval, y_q_eval, alpha_oracle)).
    No scale fitted elsewhere can leave a smaller residual on this data, so the
    gap between a calibration-fitted alpha's residual and this one is what the
    fit loses by not seeing the evaluation data.
    """
    alpha = fit_alpha(y_ref_eval, y_q_eval)
    return alpha, relative_residual(y_ref_eval, y_q_eval, alpha)
