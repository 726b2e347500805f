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

Sums are accumulated in float64 over row chunks: activations are float32 and a
dump holds tens of millions of them, so float32 sums would lose digits. Where
several residuals of the same outputs are wanted, `output_gram` reads the rows
once and `residual_from_gram` gives each from its inner products.
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
    """(<y_ref, y_q>, ||y_q||^2, ||y_ref||^2) in float64 (`output_gram`'s entries); additive over token chunks."""
    gram = output_gram(y_ref, y_q)  # (2, 2)
    return float(gram[0, 1]), float(gram[1, 1]), float(gram[0, 0])


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


_GRAM_ROWS = 256  # rows per chunk of `output_gram`: a float64 buffer of k x 256 x d (16 MB at k = 4, d = 2,048)


def output_gram(*outputs: np.ndarray) -> np.ndarray:
    """G[i, j] = <outputs[i], outputs[j]> over all rows and columns, float64, from one pass over row
    chunks (each copied into one float64 buffer, then a matrix product): every scale and residual
    among these outputs follows from it (`residual_from_gram`), where a pass per residual would read
    the rows again each time, seconds of host time per pass at 65,536 rows of a 2,048-wide layer
    (bench/speed/bench_calibrate_stats.py). (k, k) for k outputs of the same shape (N, d)."""
    shape = np.shape(outputs[0])
    if any(np.shape(a) != shape for a in outputs):
        raise ValueError(f"shape mismatch: {[np.shape(a) for a in outputs]}")
    width = int(np.prod(shape[1:], dtype=np.int64))
    gram = np.zeros((len(outputs), len(outputs)))  # (k, k)
    buffer = np.empty((len(outputs), _GRAM_ROWS * width))  # (k, rows d)
    for start in range(0, shape[0], _GRAM_ROWS):
        n = (min(start + _GRAM_ROWS, shape[0]) - start) * width
        for i, a in enumerate(outputs):
            buffer[i, :n] = np.asarray(a[start : start + _GRAM_ROWS]).reshape(-1)  # float32 -> float64
        gram += buffer[:, :n] @ buffer[:, :n].T  # (k, k)
    return gram


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
