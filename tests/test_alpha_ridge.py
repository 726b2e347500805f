"""Alpha and ridge kernels against float64 NumPy closed forms and scipy minimisers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import optimize

from moeheal.kernels.alpha import (
    alpha_stats,
    fit_alpha,
    oracle_from_gram,
    output_gram,
    relative_residual,
    residual_from_gram,
)
from moeheal.kernels.ridge import (
    alpha_ridge_cv_sweep,
    cv_folds,
    effective_dof,
    fit_ridge,
    held_out_error,
    held_out_errors,
    matrix_rank,
    ridge_cv,
    ridge_cv_sweep,
    ridge_stats,
    solve_ridge,
)
from moeheal.pipeline.stages.calibrate import ridge_cv_rows


def shrunk_output(rng: np.random.Generator, n: int = 5000, d: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """A reference output and a noisy, shrunk 'quantized' version of it, float32."""
    y_ref = rng.normal(size=(n, d)).astype(np.float32)
    y_q = (0.9 * y_ref + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
    return y_ref, y_q


def test_fit_alpha_matches_float64_and_minimises_residual() -> None:
    rng = np.random.default_rng(0)
    y_ref, y_q = shrunk_output(rng)  # 5000 rows: 5000 float32 partial sums added in float64
    ref64, q64 = y_ref.astype(np.float64), y_q.astype(np.float64)
    alpha = fit_alpha(y_ref, y_q)
    assert alpha == pytest.approx(np.sum(ref64 * q64) / np.sum(q64 * q64), rel=1e-8)
    best = optimize.minimize_scalar(lambda a: np.sum((ref64 - a * q64) ** 2), bracket=(0.5, 1.5), tol=1e-12)
    assert alpha == pytest.approx(best.x, rel=1e-7)
    assert relative_residual(y_ref, y_q, alpha) == pytest.approx(best.fun / np.sum(ref64**2), rel=1e-7)
    assert relative_residual(y_ref, y_q, alpha) < relative_residual(y_ref, y_q)  # alpha = 1 is worse here
    dot, norm_q, norm_ref = alpha_stats(y_ref, y_q)
    assert norm_ref == pytest.approx(np.sum(ref64**2), rel=1e-8) and dot / norm_q == alpha


def test_residuals_from_one_gram_match_float64_passes() -> None:
    """Every residual calibrate reports, from `output_gram` (one pass, 5000 rows: several chunks) against
    float64 NumPy over the whole arrays: plain, scaled, a sum of two outputs, and a ratio of two."""
    rng = np.random.default_rng(3)
    y_ref, y_q = shrunk_output(rng)
    y_h = (1.05 * y_q).astype(np.float32)
    y_s = (0.2 * (y_ref - y_h) + 0.01 * rng.normal(size=y_ref.shape)).astype(np.float32)
    r, q, h, s = (a.astype(np.float64) for a in (y_ref, y_q, y_h, y_s))
    gram = output_gram(y_ref, y_q, y_h, y_s)
    np.testing.assert_allclose(gram, np.array([[np.sum(a * b) for b in (r, q, h, s)] for a in (r, q, h, s)]),
                               rtol=1e-8)
    rr = np.sum(r * r)
    assert residual_from_gram(gram, 0, {1: 1.0}) == pytest.approx(np.sum((r - q) ** 2) / rr, rel=1e-7)
    c = np.sum(r * q) / np.sum(q * q)
    assert residual_from_gram(gram, 0, {1: c}) == pytest.approx(np.sum((r - c * q) ** 2) / rr, rel=1e-7)
    assert residual_from_gram(gram, 0, {2: 1.0, 3: 1.0}) == pytest.approx(np.sum((r - h - s) ** 2) / rr, rel=1e-7)
    gain = residual_from_gram(gram, 0, {2: 1.0, 3: 1.0}) / residual_from_gram(gram, 0, {2: 1.0}) - 1.0
    assert gain == pytest.approx(relative_residual(y_ref - y_h, y_s) - 1.0, rel=1e-6)
    assert residual_from_gram(output_gram(y_ref, y_ref), 0, {1: 1.0}) == 0.0
    with pytest.raises(ValueError, match="shape"):
        output_gram(y_ref, y_q[:-1])


def test_output_gram_keeps_float64_digits_where_one_float32_sum_loses_them() -> None:
    """Two million rows of outputs with a large common offset: one float32 accumulation over every
    product drifts by far more than 1e-6, `output_gram` (float32 per row, float64 over rows) stays within
    1e-9 of float64 NumPy. Its outputs on the device or on the host give the same matrix."""
    rng = np.random.default_rng(7)
    y = (100.0 + rng.normal(size=(2_000_000, 8))).astype(np.float32)  # (N, d)
    exact = float(np.sum(y.astype(np.float64) ** 2))
    naive = float(np.cumsum((y * y).reshape(-1), dtype=np.float32)[-1])  # one float32 running sum
    assert abs(naive / exact - 1) > 1e-6
    gram = output_gram(y, y)
    assert gram[0, 0] == pytest.approx(exact, rel=1e-9) and gram[0, 1] == gram[1, 0] == gram[0, 0]
    np.testing.assert_array_equal(output_gram(jax.device_put(y), y), gram)


def test_relative_residual_matches_float64() -> None:
    rng = np.random.default_rng(1)
    y_ref, y_q = shrunk_output(rng, n=300, d=16)
    ref64, q64 = y_ref.astype(np.float64), y_q.astype(np.float64)
    assert relative_residual(y_ref, y_q) == pytest.approx(np.sum((ref64 - q64) ** 2) / np.sum(ref64**2), rel=1e-7)
    assert relative_residual(y_ref, y_ref) == 0.0
    with pytest.raises(ValueError, match="shape"):
        relative_residual(y_ref, y_q[:-1])


def test_oracle_alpha_beats_a_calibration_alpha_on_its_own_data() -> None:
    rng = np.random.default_rng(2)
    y_cal, y_q_cal = shrunk_output(rng, n=400)
    y_eval = rng.normal(size=(400, 64)).astype(np.float32)
    y_q_eval = (0.8 * y_eval + 0.4 * rng.normal(size=(400, 64))).astype(np.float32)  # a different shrink
    alpha_cal = fit_alpha(y_cal, y_q_cal)
    alpha_orc, resid_orc = oracle_from_gram(output_gram(y_eval, y_q_eval), 0, 1)
    assert alpha_orc == pytest.approx(fit_alpha(y_eval, y_q_eval))
    assert resid_orc == pytest.approx(relative_residual(y_eval, y_q_eval, alpha_orc))
    assert resid_orc < relative_residual(y_eval, y_q_eval, alpha_cal)


def ridge_problem(rng: np.random.Generator, n: int = 600, f: int = 24, d: int = 10, signal: float = 1.0):
    z = (rng.normal(size=(n, f)) * rng.uniform(0.1, 2.0, size=f)).astype(np.float32)
    w_true = rng.normal(size=(d, f)) * signal
    r = (z.astype(np.float64) @ w_true.T * 0.1 + rng.normal(size=(n, d))).astype(np.float32)
    return z, r


def closed_form_ridge(z: np.ndarray, r: np.ndarray, rho: float) -> np.ndarray:
    z64, r64 = z.astype(np.float64), r.astype(np.float64)
    gram = z64.T @ z64
    lam = rho * np.mean(np.diag(gram))
    return np.linalg.solve(gram + lam * np.eye(z.shape[1]), z64.T @ r64).T  # (d, f)


def test_fit_ridge_matches_closed_form_and_objective() -> None:
    rng = np.random.default_rng(3)
    z, r = ridge_problem(rng, n=4500)  # several accumulation chunks
    for rho in (0.0, 0.25, 6.0):
        np.testing.assert_allclose(fit_ridge(z, r, rho), closed_form_ridge(z, r, rho), rtol=1e-9, atol=1e-12)
    # rho = 0 is ordinary least squares
    z64, r64 = z.astype(np.float64), r.astype(np.float64)
    np.testing.assert_allclose(fit_ridge(z, r, 0.0), np.linalg.lstsq(z64, r64, rcond=None)[0].T, rtol=1e-8)
    # the solution is a stationary point of the penalised objective: perturbing it only increases it
    d_w = fit_ridge(z, r, 1.0)
    lam = 1.0 * np.mean(np.sum(z64**2, axis=0))
    objective = lambda w: np.sum((r64 - z64 @ w.T) ** 2) + lam * np.sum(w**2)  # noqa: E731
    base = objective(d_w)
    for _ in range(5):
        assert objective(d_w + 1e-3 * rng.normal(size=d_w.shape)) > base


def test_ridge_stats_are_additive() -> None:
    rng = np.random.default_rng(4)
    z, r = ridge_problem(rng)
    whole = ridge_stats(z, r)
    parts = ridge_stats(z[:250], r[:250]) + ridge_stats(z[250:], r[250:])
    np.testing.assert_allclose(parts.gram, whole.gram, rtol=1e-12)
    np.testing.assert_allclose(parts.cross, whole.cross, rtol=1e-12, atol=1e-9)
    assert parts.n == whole.n == 600 and parts.sum_sq_r == pytest.approx(whole.sum_sq_r, rel=1e-12)
    gram, cross, sum_sq_r, n = whole  # unpacks like a tuple
    assert n == 600 and sum_sq_r == whole.sum_sq_r and gram is whole.gram and cross is whole.cross
    np.testing.assert_allclose(solve_ridge(parts.gram, parts.cross, 2.0), closed_form_ridge(z, r, 2.0), rtol=1e-9)


def test_effective_dof_and_rank() -> None:
    rng = np.random.default_rng(5)
    n, f, rank = 500, 40, 23
    z = (rng.normal(size=(n, rank)) @ rng.normal(size=(rank, f))).astype(np.float32)  # rank 23 up to float32 rounding
    gram = ridge_stats(z, np.zeros((n, 1), np.float32)).gram
    assert matrix_rank(gram, n_rows=n) == np.linalg.matrix_rank(z) == rank
    assert matrix_rank(gram) == rank  # the row count only sets the tolerance
    full = rng.normal(size=(n, f)).astype(np.float32)
    assert matrix_rank(ridge_stats(full, np.zeros((n, 1), np.float32)).gram, n_rows=n) == f
    z64 = z.astype(np.float64)
    g64 = z64.T @ z64
    for rho in (0.01, 1.0, 6.0):
        lam = rho * np.mean(np.diag(g64))
        expected = np.trace(g64 @ np.linalg.inv(g64 + lam * np.eye(f)))
        assert effective_dof(gram, rho) == pytest.approx(expected, rel=1e-8)
        assert 0 < effective_dof(gram, rho) < rank
    assert effective_dof(gram, 0.0) == rank
    assert effective_dof(gram, 0.01) > effective_dof(gram, 1.0) > effective_dof(gram, 6.0)


def direct_cv(z: np.ndarray, r: np.ndarray, rho: float, eta: float, held_out_sets: list[np.ndarray]) -> float:
    """Explicit per-fold refit and residual, float64."""
    err = norm = 0.0
    for held_out in held_out_sets:
        fit_rows = np.setdiff1d(np.arange(len(z)), held_out)
        d_w = closed_form_ridge(z[fit_rows], r[fit_rows], rho)
        r_h = r[held_out].astype(np.float64)
        err += np.sum((r_h - eta * z[held_out].astype(np.float64) @ d_w.T) ** 2)
        norm += np.sum(r_h**2)
    return err / norm - 1.0


@pytest.mark.parametrize("scheme", ["lobo4", "even_odd"])
def test_ridge_cv_matches_explicit_refits(scheme: str) -> None:
    rng = np.random.default_rng(6)
    z, r = ridge_problem(rng, n=601)  # uneven blocks
    for rho, eta in ((0.25, 1.0), (6.0, 0.15)):
        expected = direct_cv(z, r, rho, eta, cv_folds(len(z), scheme))
        assert ridge_cv(z, r, rho, eta, scheme) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    blocks = cv_folds(601, "lobo4")
    assert [len(b) for b in blocks] == [151, 150, 150, 150] and np.all(np.diff(np.concatenate(blocks)) == 1)


def test_ridge_cv_in_sample_matches_direct_fit() -> None:
    rng = np.random.default_rng(7)
    z, r = ridge_problem(rng)
    d_w = closed_form_ridge(z, r, 1.0)
    r64 = r.astype(np.float64)
    expected = np.sum((r64 - 0.5 * z.astype(np.float64) @ d_w.T) ** 2) / np.sum(r64**2) - 1
    assert ridge_cv(z, r, 1.0, 0.5, "in_sample") == pytest.approx(expected, rel=1e-10)
    np.testing.assert_allclose(
        ridge_cv_sweep(z, r, [0.25, 6.0], 0.5, "in_sample"),
        [ridge_cv(z, r, 0.25, 0.5, "in_sample"), ridge_cv(z, r, 6.0, 0.5, "in_sample")],
    )


def test_one_eigendecomposition_gives_every_rhos_held_out_error() -> None:
    """The sweep's rescaled eigendecomposition against a solve per rho, rho = 0 (least squares on a
    rank-deficient fit: the minimum-norm solution) included."""
    rng = np.random.default_rng(11)
    z, r = ridge_problem(rng, n=300)
    z[:, -1] = z[:, 0]  # a repeated feature: G is singular
    held = np.arange(0, 300, 3)
    fit_stats = ridge_stats(np.delete(z, held, 0), np.delete(r, held, 0))
    held_stats = ridge_stats(z[held], r[held])
    rhos, eta = [0.0, 0.25, 6.0, 24.0], 0.7
    expected = [held_out_error(held_stats, solve_ridge(fit_stats.gram, fit_stats.cross, rho), eta) for rho in rhos]
    np.testing.assert_allclose(held_out_errors(fit_stats, held_stats, rhos, eta), expected, rtol=1e-10)


def test_cross_validation_exposes_overfit_on_pure_noise() -> None:
    """The audit's finding: in-sample gain is flattering, held-out gain on noise is ~0 or worse."""
    rng = np.random.default_rng(8)
    n, f, d = 512, 64, 16
    z = (rng.normal(size=(n, f)) * rng.uniform(0.2, 2.0, size=f)).astype(np.float32)
    noise = rng.normal(size=(n, d)).astype(np.float32)  # nothing to explain
    in_sample = ridge_cv(z, noise, 0.05, 1.0, "in_sample")
    lobo4 = ridge_cv(z, noise, 0.05, 1.0, "lobo4")
    even_odd = ridge_cv(z, noise, 0.05, 1.0, "even_odd")
    assert in_sample < -0.05  # fits the noise: about -dof / n
    assert lobo4 > 0.0 and even_odd > 0.0  # and pays for it out of sample
    # with real signal, held-out gain is negative too
    z2, r2 = ridge_problem(rng, n=2000, signal=3.0)
    assert ridge_cv(z2, r2, 0.25, 1.0, "lobo4") < -0.05


def test_rejects_unknown_scheme() -> None:
    rng = np.random.default_rng(9)
    z, r = ridge_problem(rng, n=40)
    with pytest.raises(ValueError, match="scheme"):
        ridge_cv(z, r, 1.0, 1.0, "loo")


def alpha_ridge_problem(rng: np.random.Generator, n: int = 801, f: int = 12, d: int = 8):
    """Z, y_ref and a shrunk y_q whose error the shared expert's Z can partly explain; the
    shrink drifts along the rows, so alpha fitted with or without a block differs."""
    z = (rng.normal(size=(n, f)) * rng.uniform(0.2, 2.0, size=f)).astype(np.float32)
    y_ref = rng.normal(size=(n, d)).astype(np.float32)
    shrink = np.linspace(0.75, 0.95, n)[:, None]  # (n, 1)
    y_q = (shrink * y_ref + 0.2 * z[:, :d] + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
    return z, y_ref, y_q


def direct_alpha_ridge_cv(z, y_ref, y_q, rho: float, eta: float, folds: list[tuple[np.ndarray, np.ndarray]],
                          refit_alpha: bool = True) -> float:
    """Per fold, in float64: alpha on the training rows, ridge on their residual, score the held-out rows."""
    z64, ref64, q64 = (a.astype(np.float64) for a in (z, y_ref, y_q))
    err = norm = 0.0
    for fit, held in folds:
        alpha = np.sum(ref64[fit] * q64[fit]) / np.sum(q64[fit] ** 2) if refit_alpha else 1.0
        d_w = closed_form_ridge(z64[fit], ref64[fit] - alpha * q64[fit], rho)  # (d, f)
        r_h = ref64[held] - alpha * q64[held]
        err += np.sum((r_h - eta * z64[held] @ d_w.T) ** 2)
        norm += np.sum(r_h**2)
    return err / norm - 1.0


@pytest.mark.parametrize("scheme", ["in_sample", "lobo4", "even_odd"])
def test_alpha_ridge_cv_refits_alpha_in_every_fold(scheme: str) -> None:
    rng = np.random.default_rng(10)
    z, y_ref, y_q = alpha_ridge_problem(rng)
    rows = np.arange(len(z))
    folds = ([(rows, rows)] if scheme == "in_sample"
             else [(np.setdiff1d(rows, held), held) for held in cv_folds(len(z), scheme)])
    rhos, eta = [0.25, 6.0], 0.5
    gains = alpha_ridge_cv_sweep(z, y_ref, y_q, rhos, eta, scheme)
    for rho, gain in zip(rhos, gains):
        assert gain == pytest.approx(direct_alpha_ridge_cv(z, y_ref, y_q, rho, eta, folds), rel=1e-9, abs=1e-12)
    no_alpha = alpha_ridge_cv_sweep(z, y_ref, y_q, rhos, eta, scheme, refit_alpha=False)
    residual = y_ref.astype(np.float64) - y_q.astype(np.float64)  # alpha = 1: the fixed-residual CV
    np.testing.assert_allclose(no_alpha, ridge_cv_sweep(z, residual, rhos, eta, scheme), rtol=1e-9, atol=1e-12)


def test_alpha_fitted_on_all_rows_is_not_what_the_folds_see() -> None:
    """The old CV (alpha from every row, folds included) differs from the honest one on drifting data."""
    rng = np.random.default_rng(11)
    z, y_ref, y_q = alpha_ridge_problem(rng)
    leaky = ridge_cv(z, y_ref - fit_alpha(y_ref, y_q) * y_q, 1.0, 1.0, "lobo4")
    honest = alpha_ridge_cv_sweep(z, y_ref, y_q, [1.0], 1.0, "lobo4")[0]
    assert abs(honest - leaky) > 1e-3


def test_ridge_cv_rows_choose_the_best_held_out_rho_and_apply_the_configured_one() -> None:
    rng = np.random.default_rng(12)
    z, y_ref, y_q = alpha_ridge_problem(rng)
    gram = ridge_stats(z, y_ref).gram
    rows, best, applied = ridge_cv_rows(z, y_ref, y_q, gram, 12, rho=3.0, eta=0.5, refit_alpha=True)
    grid = [0.25, 1.0, 3.0, 6.0, 24.0]  # RHO_GRID and the configured rho
    lobo4 = alpha_ridge_cv_sweep(z, y_ref, y_q, grid, 0.5, "lobo4")
    assert best == grid[int(np.argmin(lobo4))]
    assert applied == (lobo4[2] < 0)
    assert [(r["rho"], r["split"]) for r in rows] == [(p, s) for p in grid for s in ("in_sample", "lobo4", "even_odd")]
    for r in rows:
        assert r["chosen"] == (r["rho"] == best) and r["configured"] == (r["rho"] == 3.0)
        assert r["applied"] == (r["rho"] == 3.0 and applied)
        if r["split"] == "lobo4":
            assert r["rel_gain"] == pytest.approx(lobo4[grid.index(r["rho"])], rel=1e-12)
    assert sum(r["chosen"] for r in rows) == 3  # one rho, three splits
    off, _, off_applied = ridge_cv_rows(z, y_ref, y_q, gram, 12, rho=0.0, eta=0.5, refit_alpha=False)
    assert not off_applied and not any(r["configured"] or r["applied"] for r in off)  # rho 0: ridge off
