"""A calibrate unit's residuals: a float64 pass on the host against the device's per-row products.

    python bench/speed/bench_calibrate_stats.py                  # Qwen3-30B-A3B's width at the default data
    python bench/speed/bench_calibrate_stats.py --rows 8192      # the 8,192-token figures

Each calibrate unit reports, per split (the calibration rows and the unseen ones), the relative
residual of the quantized routed output, of the healed one, of the oracle alpha and of the healed
output plus the shared expert's change, all from one Gram matrix of the outputs (`residual_from_gram`).
At 65,536 rows of a 2,048-wide layer the outputs are 0.5 GB each. Times the Gram matrix three ways on
the same arrays, in the same run:
- the baseline: the host in float64, one pass over row chunks copied into a float64 buffer (the way
  before `output_gram` moved to the device; written out here as the reference);
- `output_gram` on outputs already on the device (a calibrate unit's: the routed forward's results);
- `output_gram` on host arrays (their copy to the device included).
On a CPU the "device" is the CPU. Prints the times, their ratios and the largest relative
difference of a residual from the float64 baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.kernels.alpha import oracle_from_gram, output_gram, residual_from_gram  # noqa: E402

GRAM_ROWS = 256  # the baseline's rows per float64 chunk


def float64_gram(*outputs: np.ndarray) -> np.ndarray:
    """The baseline: <outputs[i], outputs[j]> in float64 on the host, row chunks into one buffer."""
    n, width = outputs[0].shape
    gram = np.zeros((len(outputs), len(outputs)))  # (k, k)
    buffer = np.empty((len(outputs), GRAM_ROWS * width))  # (k, rows d)
    for start in range(0, n, GRAM_ROWS):
        m = (min(start + GRAM_ROWS, n) - start) * width
        for i, a in enumerate(outputs):
            buffer[i, :m] = a[start:start + GRAM_ROWS].reshape(-1)  # float32 -> float64
        gram += buffer[:, :m] @ buffer[:, :m].T  # (k, k)
    return gram


def residuals(g: np.ndarray) -> list[float]:
    """The four residuals a calibrate unit reports, from the Gram matrix of (y_ref, y_q, y_healed, shared)."""
    return [residual_from_gram(g, 0, {1: 1.0}), residual_from_gram(g, 0, {2: 1.0}),
            oracle_from_gram(g, 0, 1)[1], residual_from_gram(g, 0, {2: 1.0, 3: 1.0})]


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
    outputs = (y_ref, y_q, y_healed, shared)
    on_device = tuple(jax.device_put(a) for a in outputs)

    exact = residuals(float64_gram(*outputs))
    gap = max(abs(a / b - 1) for a, b in zip(residuals(output_gram(*on_device)), exact))
    base = best_of(lambda: float64_gram(*outputs), args.repeats)
    resident = best_of(lambda: output_gram(*on_device), args.repeats)
    copied = best_of(lambda: output_gram(*outputs), args.repeats)
    print(f"Gram matrix of 4 outputs, {args.rows} x {args.d} float32 each, on {jax.devices()[0].device_kind}; "
          f"best of {args.repeats}")
    print("| Gram matrix | s | vs baseline |\n|---|---:|---:|")
    print(f"| host, float64 (baseline) | {base:.3f} | 1.00x |")
    print(f"| `output_gram`, outputs on the device | {resident:.3f} | {base / resident:.2f}x |")
    print(f"| `output_gram`, outputs copied from the host | {copied:.3f} | {base / copied:.2f}x |")
    print(f"largest relative difference of a residual from the float64 baseline: {gap:.1e}")


if __name__ == "__main__":
    main()
