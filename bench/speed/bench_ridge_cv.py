"""The ridge cross-validation sweep: one eigendecomposition per fold against a solve per rho.

    python bench/speed/bench_ridge_cv.py                      # the Qwen3-Next shared expert: f = 512, d = 2048
    python bench/speed/bench_ridge_cv.py --f 128 --d 512      # a smaller one

Every calibrate unit of a variant with a shared expert scores the demo's rho
grid on three splits (in sample, lobo4, even/odd: 7 fits), alpha refitted
inside each fold (`kernels.ridge.alpha_ridge_cv_sweep`). Times the held-out
errors of those fits two ways on the same statistics, in the same run: the
baseline solves (G + lam I) dW^T = C per rho (`solve_ridge` then
`held_out_error`), the sweep in use rescales one eigendecomposition of G per
fold (`held_out_errors`). Prints both, their ratio and the largest difference
of the relative gains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.kernels.ridge import alpha_residual_splits, held_out_error, held_out_errors, solve_ridge  # noqa: E402
from moeheal.pipeline.stages.calibrate import CV_SPLITS, RHO_GRID  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="calibration tokens")
    parser.add_argument("--f", type=int, default=512, help="shared expert width")
    parser.add_argument("--d", type=int, default=2048, help="hidden size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((args.rows, args.f)) * rng.uniform(0.2, 2.0, args.f)).astype(np.float32)  # (T, f)
    y_ref = rng.standard_normal((args.rows, args.d)).astype(np.float32)  # (T, d)
    y_q = (0.9 * y_ref + 0.1 * z[:, : min(args.f, args.d)].sum(1, keepdims=True)).astype(np.float32)  # (T, d)
    pairs = [pair for scheme in CV_SPLITS for pair in alpha_residual_splits(z, y_ref, y_q, scheme)]
    rhos, eta = list(RHO_GRID), 0.15

    def per_rho_solve() -> np.ndarray:
        return np.array([[held_out_error(h, solve_ridge(fit.gram, fit.cross, rho), eta) for rho in rhos]
                         for fit, h in pairs])

    def eigen_sweep() -> np.ndarray:
        return np.array([held_out_errors(fit, h, rhos, eta) for fit, h in pairs])

    norms = np.array([h.sum_sq_r for _, h in pairs])[:, None]
    gap = np.max(np.abs(per_rho_solve() / norms - eigen_sweep() / norms))
    base = best_of(per_rho_solve, args.repeats)
    fast = best_of(eigen_sweep, args.repeats)
    print(f"{len(pairs)} fits x {len(rhos)} rhos, Z {args.rows} x {args.f}, d = {args.d}; best of {args.repeats}")
    print("| sweep | s | vs baseline |\n|---|---:|---:|")
    print(f"| a solve per rho (baseline) | {base:.3f} | 1.00x |")
    print(f"| one eigendecomposition per fold | {fast:.3f} | {base / fast:.2f}x |")
    print(f"largest difference of a relative held-out error: {gap:.1e}")


if __name__ == "__main__":
    main()
