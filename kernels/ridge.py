"""Ridge correction of the shared expert's down projection, and its cross-validation.

After the routed experts are quantized, a residual R = y_ref - y_healed (N, d)
is left in the MoE output. The shared expert's down projection sees
Z = sigmoid(shared gate) * h_shexp (N, f), so an additive correction dW (d, f)
to W_down_shexp changes the output by Z dW^T. We fit

    dW = argmin ||R - Z dW^T||^2 + lam ||dW||^2,   lam = rho * mean(diag(Z^T Z))
       = ((G + lam I)^-1 C)^T,                     G = Z^T Z (f, f), C = Z^T R (f, d)

and apply eta * dW (eta <= 1 shrinks further). lam is relative to the mean
diagonal of G so rho is scale-free. Everything is computed from the additive
sufficient statistics (G, C, ||R||^2, n) accumulated in float64, so a dump can
be streamed chunk by chunk, and cross-validation needs one pass: the fit on
the other folds uses total - fold statistics, and the held-out error is a
quadratic form in the fold's own statistics:

    ||R_f - eta Z_f dW^T||^2 = ||R_f||^2 - 2 eta <C_f^T, dW> + eta^2 <dW G_f, dW>.

In the pipeline R itself comes from a fit: R = y_ref - alpha y_q, alpha fitted
on the same calibration rows. Cross-validating the ridge on that R would let
alpha see the held-out rows, so `alpha_ridge_cv_sweep` refits alpha inside
each fold from statistics of (Z, y_ref, y_q), in which R's are linear in alpha.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import scipy.linalg

from moeheal.kernels.alpha import alpha_from_stats

_CHUNK_ROWS = 2048
CV_SCHEMES = ("in_sample", "lobo4", "even_odd")


class RidgeStats(NamedTuple):
    """Sufficient statistics of (Z, R), float64, additive over row chunks.

    gram (f, f) = Z^T Z, cross (f, d) = Z^T R, sum_sq_r = ||R||^2, n = rows.
    Unpacks as a tuple; `+` / `-` add / subtract the statistics (not tuple
    concatenation), for streaming and for leaving a fold out.
    """

    gram: np.ndarray
    cross: np.ndarray
    sum_sq_r: float
    n: int

    def __add__(self, other: RidgeStats) -> RidgeStats:  # type: ignore[override]
        return RidgeStats(self.gram + other.gram, self.cross + other.cross, self.sum_sq_r + other.sum_sq_r, self.n + other.n)

    def __sub__(self, other: RidgeStats) -> RidgeStats:
        return RidgeStats(self.gram - other.gram, self.cross - other.cross, self.sum_sq_r - other.sum_sq_r, self.n - other.n)


def ridge_stats(z: np.ndarray, r: np.ndarray) -> RidgeStats:
    """(G = Z^T Z, C = Z^T R, ||R||^2, n) in float64 from Z (N, f), R (N, d)."""
    if z.shape[0] != r.shape[0]:
        raise ValueError(f"Z has {z.shape[0]} rows, R has {r.shape[0]}")
    gram = np.zeros((z.shape[1], z.shape[1]))  # (f, f)
    cross = np.zeros((z.shape[1], r.shape[1]))  # (f, d)
    sum_sq_r = 0.0
    for start in range(0, z.shape[0], _CHUNK_ROWS):
        zc = np.asarray(z[start : start + _CHUNK_ROWS], dtype=np.float64)  # (n, f)
        rc = np.asarray(r[start : start + _CHUNK_ROWS], dtype=np.float64)  # (n, d)
        gram += zc.T @ zc
        cross += zc.T @ rc
        sum_sq_r += float(np.einsum("nd,nd->", rc, rc))
    return RidgeStats(gram, cross, sum_sq_r, int(z.shape[0]))


def ridge_lambda(gram: np.ndarray, rho: float) -> float:
    """lam = rho * mean(diag(G)): the penalty relative to the average feature energy."""
    return float(rho) * float(np.mean(np.diag(gram)))


def solve_ridge(gram: np.ndarray, cross: np.ndarray, rho: float) -> np.ndarray:
    """dW (d, f) = ((G + lam I)^-1 C)^T, float64.

    lam > 0 makes G + lam I positive definite (Cholesky solve); rho = 0 is
    ordinary least squares, solved by lstsq (minimum-norm when G is singular).
    """
    lam = ridge_lambda(gram, rho)
    if lam > 0:
        regularised = gram + lam * np.eye(gram.shape[0])  # (f, f)
        return scipy.linalg.solve(regularised, cross, assume_a="pos").T  # (d, f)
    return np.linalg.lstsq(gram, cross, rcond=None)[0].T  # (d, f)


def fit_ridge(z: np.ndarray, r: np.ndarray, rho: float) -> np.ndarray:
    """dW (d, f) minimising ||R - Z dW^T||^2 + rho * mean(diag(Z^T Z)) ||dW||^2."""
    stats = ridge_stats(z, r)
    return solve_ridge(stats.gram, stats.cross, rho)


def effective_dof(gram: np.ndarray, rho: float) -> float:
    """Effective degrees of freedom tr(G (G + lam I)^-1) = sum_i s_i / (s_i + lam), s = eig(G).

    Between 0 and rank(Z): how many directions the ridge actually fits.
    """
    eigenvalues = np.clip(np.linalg.eigvalsh(gram), 0.0, None)  # (f,)
    lam = ridge_lambda(gram, rho)
    if lam == 0:
        return float(np.linalg.matrix_rank(gram, hermitian=True))  # tr(G G^+) = rank(G)
    return float(np.sum(eigenvalues / (eigenvalues + lam)))


def matrix_rank(gram: np.ndarray, n_rows: int | None = None, eps: float = float(np.finfo(np.float32).eps)) -> int:
    """Numerical rank of Z (n_rows, f) from G = Z^T Z.

    Z's singular values are sigma_i = sqrt(max(eig_i(G), 0)); we count those
    above sigma_max * max(n_rows, f) * eps, numpy.linalg.matrix_rank's default
    tolerance for Z itself, with eps of float32 because Z is float32 data
    (n_rows defaults to f, i.e. the tolerance sigma_max * f * eps). G
    accumulated in float64 resolves sigma down to ~1e-8 sigma_max, well below
    this tolerance, so going through G loses nothing.
    """
    sigma = np.sqrt(np.clip(np.linalg.eigvalsh(gram), 0.0, None))  # (f,)
    if sigma.size == 0 or sigma.max() == 0:
        return 0
    tolerance = sigma.max() * max(n_rows or 0, gram.shape[0]) * eps
    return int(np.sum(sigma > tolerance))


def cv_folds(n_rows: int, scheme: str) -> list[np.ndarray]:
    """Held-out row sets of a cross-validation scheme; each is fitted on the other rows.

    lobo4: 4 contiguous blocks (np.array_split). even_odd: even rows, odd rows.
    in_sample has no held-out set (fit and evaluate on all rows) and is not a fold list.
    """
    rows = np.arange(n_rows)
    if scheme == "lobo4":
        return np.array_split(rows, 4)
    if scheme == "even_odd":
        return [rows[0::2], rows[1::2]]
    raise ValueError(f"unknown cross-validation scheme {scheme!r}; expected one of {CV_SCHEMES}")


def held_out_error(eval_stats: RidgeStats, d_w: np.ndarray, eta: float) -> float:
    """||R - eta Z dW^T||^2 on the rows of eval_stats, from their statistics alone."""
    explained = np.sum(eval_stats.cross.T * d_w)  # <Z^T R, dW^T> = <R, Z dW^T>
    # ||Z dW^T||^2 = sum (dW G) * dW: one BLAS product; the three-operand einsum ran an unblocked
    # loop, 0.6 s a call at d = 2048, f = 512 (Qwen3-Next), 24 s of every calibrate unit there
    energy = np.sum((d_w @ eval_stats.gram) * d_w)
    return _expand_error(eval_stats.sum_sq_r, explained, energy, eta)


def _expand_error(sum_sq_r: float, explained: float, energy: float, eta: float) -> float:
    """||R - eta Z dW^T||^2 = ||R||^2 - 2 eta <R, Z dW^T> + eta^2 ||Z dW^T||^2."""
    return sum_sq_r - 2.0 * eta * explained + eta**2 * energy


def held_out_errors(fit: RidgeStats, held_out: RidgeStats, rhos: Sequence[float], eta: float) -> np.ndarray:
    """``held_out_error`` of the ridge fitted on ``fit`` for every rho, from one eigendecomposition.

    With fit's G = V diag(s) V^T, (G + lam I)^-1 C = V diag(1 / (s + lam)) V^T C: every rho's
    fit rescales the rows of A = V^T C, and its held-out error needs only A, V^T C_h and
    V^T G_h V, so each rho costs one product where a solve per rho cost three (3.6x faster at
    the Qwen3-Next shared expert's f = 512, d = 2048, bench/RESULTS.md). The same numbers as
    ``solve_ridge`` per rho to float64 rounding; rho = 0 (least squares, minimum-norm when G
    is singular) still goes through ``solve_ridge``.
    """
    eigenvalues, basis = np.linalg.eigh(fit.gram)  # (f,), (f, f)
    fit_cross = basis.T @ fit.cross  # (f, d) = V^T C
    held_cross = basis.T @ held_out.cross  # (f, d) = V^T C_h
    held_gram = basis.T @ held_out.gram @ basis  # (f, f) = V^T G_h V
    errors = np.empty(len(rhos))
    for i, rho in enumerate(rhos):
        lam = ridge_lambda(fit.gram, rho)
        if lam == 0:
            errors[i] = held_out_error(held_out, solve_ridge(fit.gram, fit.cross, rho), eta)
            continue
        fitted = fit_cross / (eigenvalues + lam)[:, None]  # (f, d) = V^T dW^T
        energy = np.sum((held_gram @ fitted) * fitted)  # ||Z_h dW^T||^2
        errors[i] = _expand_error(held_out.sum_sq_r, np.sum(held_cross * fitted), energy, eta)
    return errors


def ridge_cv_sweep(z: np.ndarray, r: np.ndarray, rhos: Sequence[float], eta: float, scheme: str) -> np.ndarray:
    """rel_gain for each rho: sum over folds of ||R_f - eta Z_f dW_f^T||^2 / sum ||R_f||^2 - 1.

    dW_f is fitted on the rows outside fold f (on all rows for "in_sample",
    which evaluates there too). Negative = the correction helps. The statistics
    are accumulated once and shared by every rho.
    """
    if scheme == "in_sample":
        total = ridge_stats(z, r)
        splits = [(total, total)]
    else:
        held = [ridge_stats(z[rows], r[rows]) for rows in cv_folds(z.shape[0], scheme)]
        total = sum(held[1:], held[0])
        splits = [(total - held_out, held_out) for held_out in held]
    return _sweep(splits, rhos, eta)


def _sweep(splits: list[tuple[RidgeStats, RidgeStats]], rhos: Sequence[float], eta: float) -> np.ndarray:
    """rel_gain per rho: sum of held-out errors of the fits / sum of held-out ||R||^2 - 1."""
    norm = sum(held_out.sum_sq_r for _, held_out in splits)
    if not norm > 0:
        raise ValueError("R is zero: the relative gain is undefined")
    return sum(held_out_errors(fit, held_out, rhos, eta) for fit, held_out in splits) / norm - 1.0


class FoldStats(NamedTuple):
    """Sufficient statistics of (Z, y_ref, y_q) for alpha-then-ridge, float64, additive over rows.

    gram (f, f) = Z^T Z, ref_cross (f, d) = Z^T y_ref, q_cross (f, d) = Z^T y_q,
    ref_sq = ||y_ref||^2, ref_q = <y_ref, y_q>, q_sq = ||y_q||^2, n = rows.
    The residual R = y_ref - alpha y_q is linear in alpha, so for any alpha its
    ridge statistics follow without another pass over the rows (`residual`).
    """

    gram: np.ndarray
    ref_cross: np.ndarray
    q_cross: np.ndarray
    ref_sq: float
    ref_q: float
    q_sq: float
    n: int

    def __add__(self, other: FoldStats) -> FoldStats:  # type: ignore[override]
        return FoldStats(*(a + b for a, b in zip(self, other)))

    def __sub__(self, other: FoldStats) -> FoldStats:
        return FoldStats(*(a - b for a, b in zip(self, other)))

    def alpha(self) -> float:
        """The least-squares output scale of these rows, <y_ref, y_q> / ||y_q||^2."""
        return alpha_from_stats(self.ref_q, self.q_sq)

    def residual(self, alpha: float) -> RidgeStats:
        """RidgeStats of (Z, R = y_ref - alpha y_q) on these rows."""
        return RidgeStats(self.gram, self.ref_cross - alpha * self.q_cross,
                          self.ref_sq - 2.0 * alpha * self.ref_q + alpha**2 * self.q_sq, self.n)


def fold_stats(z: np.ndarray, y_ref: np.ndarray, y_q: np.ndarray) -> FoldStats:
    """FoldStats of Z (N, f), y_ref (N, d) and the unscaled quantized output y_q (N, d)."""
    if not z.shape[0] == y_ref.shape[0] == y_q.shape[0] or y_ref.shape != y_q.shape:
        raise ValueError(f"Z {z.shape}, y_ref {y_ref.shape} and y_q {y_q.shape} must share rows (and y's columns)")
    stats = ridge_stats(z, y_ref)
    q_cross = np.zeros_like(stats.cross)  # (f, d)
    ref_q = q_sq = 0.0
    for start in range(0, z.shape[0], _CHUNK_ROWS):
        zc = np.asarray(z[start : start + _CHUNK_ROWS], dtype=np.float64)  # (n, f)
        rc = np.asarray(y_ref[start : start + _CHUNK_ROWS], dtype=np.float64)  # (n, d)
        qc = np.asarray(y_q[start : start + _CHUNK_ROWS], dtype=np.float64)  # (n, d)
        q_cross += zc.T @ qc
        ref_q += float(np.einsum("nd,nd->", rc, qc))
        q_sq += float(np.einsum("nd,nd->", qc, qc))
    return FoldStats(stats.gram, stats.cross, q_cross, stats.sum_sq_r, ref_q, q_sq, stats.n)


def alpha_ridge_cv_sweep(z: np.ndarray, y_ref: np.ndarray, y_q: np.ndarray, rhos: Sequence[float], eta: float,
                         scheme: str, refit_alpha: bool = True) -> np.ndarray:
    """rel_gain for each rho with alpha refitted inside every fold, so no held-out row shapes the fit.

    For each fold f (for "in_sample": all rows, fitted and scored there):
    alpha_f = <y_ref, y_q> / ||y_q||^2 on the fold's training rows (1 when not
    `refit_alpha`: a variant without alpha); R = y_ref - alpha_f y_q on every
    row; dW_f = the ridge fit of R on Z over the training rows; then
    rel_gain = sum_f ||R_h - eta Z_h dW_f^T||^2 / sum_f ||R_h||^2 - 1 over the
    held-out rows h of each fold. An alpha fitted on all rows would have seen
    the held-out rows, and the residual it leaves there would flatter the ridge.
    """
    return _sweep(alpha_residual_splits(z, y_ref, y_q, scheme, refit_alpha), rhos, eta)


def alpha_residual_splits(z: np.ndarray, y_ref: np.ndarray, y_q: np.ndarray, scheme: str,
                          refit_alpha: bool = True) -> list[tuple[RidgeStats, RidgeStats]]:
    """Per fold of ``scheme``, the ridge statistics of R = y_ref - alpha_f y_q on its training and
    its held-out rows, alpha_f fitted on the training rows (1 when not ``refit_alpha``)."""
    if scheme == "in_sample":
        total = fold_stats(z, y_ref, y_q)
        splits = [(total, total)]
    else:
        held = [fold_stats(z[rows], y_ref[rows], y_q[rows]) for rows in cv_folds(z.shape[0], scheme)]
        total = sum(held[1:], held[0])
        splits = [(total - h, h) for h in held]
    residual_splits = []
    for fit, held_out in splits:
        alpha = fit.alpha() if refit_alpha else 1.0
        residual_splits.append((fit.residual(alpha), held_out.residual(alpha)))
    return residual_splits


def ridge_cv(z: np.ndarray, r: np.ndarray, rho: float, eta: float, scheme: str) -> float:
    """rel_gain of the ridge correction under one scheme in CV_SCHEMES; see ridge_cv_sweep."""
    return float(ridge_cv_sweep(z, r, [rho], eta, scheme)[0])
