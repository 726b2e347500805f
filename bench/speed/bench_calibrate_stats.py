"""A calibrate unit's residuals: one pass per residual against one pass for all of them.

    python bench/speed/bench_calibrate_stats.py                  # Qwen3-30B-A3B's width at the default data
    python bench/speed/bench_calibrate_stats.py --rows 8192      # the 8,192-token figures

Each calibrate unit reports, per split (the calibration rows and the unseen ones), the relative
residual of the quantized routed output, of the healed one, of the oracle alpha and of the healed
output plus the shared expert's change. At 65,536 rows of a 2,048-wide layer each is a pass over
0.5 GB arrays on the host, between the device's passes. Times the metrics two ways on the same
arrays, in the same run: the baseline a float64 pass per residual (`kernels.alpha.relative_residual`,
`fit_alpha` for the oracle), the way in use one pass for a Gram matrix of the outputs (`output_gram`) and every
residual from it (`residual_from_gram`). Prints both, their ratio and the largest relative
difference of a residual.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.kernels.alpha import (  # noqa: E402
    fit_alpha,
    oracle_from_gram,
    output_gram,
    relative_residual,
    residual_from_gram,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536, help="calibration rows of the split")
    parser.add_argument("--d", type=int, default=2048, help="hidden size")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    y_ref = rng.standard_normal((args.rows, args.d), dtype=np.float32)  # (T, d)
    y_q = (0.9 * y_ref + 0.3 * rng.standard_normal((args.rows, args.d), dtype=np.float32))  # (T, d)
    y_healed = (1.04 * y_q).astype(np.float32)  # (T, d)
    shared = (0.05 * (y_ref - y_healed)).astype(np.float32)  # (T, d)

    def a_pass_each() -> list[float]:
        return [relative_residual(y_ref, y_q), relative_residual(y_ref, y_healed),
                relative_residual(y_ref, y_q, fit_alpha(y_ref, y_q)),
                relative_residual(y_ref, y_healed + shared)]

    def one_gram() -> list[float]:
        g = output_gram(y_ref, y_q, y_healed, shared)  # (4, 4)
        return [residual_from_gram(g, 0, {1: 1.0}), residual_from_gram(g, 0, {2: 1.0}),
                oracle_from_gram(g, 0, 1)[1], residual_from_gram(g, 0, {2: 1.0, 3: 1.0})]

    gap = max(abs(a / b - 1) for a, b in zip(one_gram(), a_pass_each()))
    base = best_of(a_pass_each, args.repeats)
    fast = best_of(one_gram, args.repeats)
    print(f"4 residuals of {args.rows} x {args.d} float32 outputs; best of {args.repeats}")
    print("| metrics | s | vs baseline |\n|---|---:|---:|")
    print(f"| a float64 pass per residual (baseline) | {base:.3f} | 1.00x |")
    print(f"| one Gram matrix of the outputs | {fast:.3f} | {base / fast:.2f}x |")
    print(f"largest relative difference of a residual: {gap:.1e}")


if __name__ == "__main__":
    main()
