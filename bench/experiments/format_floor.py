"""What each registered format costs on weights with nothing to exploit: relative error on Gaussian rows.

Rounding can be made smarter (importance, GPTQ, learned rounding) and the float parameters tuned
(e2e), but the format fixes how many distinct values a block can hold. On i.i.d. Gaussian weights
with uniform importance no search has structure to find, so each format's relative squared error
there, against the Shannon bound for a Gaussian source at the same bits per weight
(D(R) = 2^(-2R), scales and all counted in R), is its floor on weights that look like noise. The
ratio column divides by the baseline format's error from the same run: how much a format must make
up elsewhere to match it.

    .venv/bin/python bench/experiments/format_floor.py [--rows 512] [--baseline q2_k] [--student-t 0]

`--student-t NU` draws from a Student-t with NU degrees of freedom instead (heavy tails; the bound
column stays the Gaussian one, which bounds any source's D(R) / variance from above).
"""

from __future__ import annotations

import argparse

import numpy as np

from moeheal.kernels.decode import bits_per_weight, dequantize
from moeheal.kernels.encode import ENCODERS, quantize

COLS = 256  # one super-block per row: every registered format's block divides it


def weight_error(x: np.ndarray, fmt: str) -> float:
    """sum (Q(x) - x)^2 / sum x^2 of `x` quantized to `fmt` with uniform importance."""
    q = dequantize(quantize(x, fmt), fmt, x.shape)  # (rows, COLS)
    return float(np.sum(np.square(q - x, dtype=np.float64)) / np.sum(np.square(x, dtype=np.float64)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--baseline", default="q2_k")
    parser.add_argument("--student-t", type=float, default=0.0, help="degrees of freedom; 0: Gaussian")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    shape = (args.rows, COLS)
    x = (rng.standard_t(args.student_t, shape) if args.student_t else rng.normal(size=shape)).astype(np.float32)
    errors = {fmt: weight_error(x, fmt) for fmt in sorted(ENCODERS, key=bits_per_weight)}
    base = errors[args.baseline]
    source = f"Student-t, {args.student_t:g} degrees of freedom" if args.student_t else "Gaussian"
    print(f"{source} weights, {args.rows} x {COLS}, uniform importance, seed {args.seed}\n")
    print(f"| format | bits/weight | relative error | Gaussian bound 2^(-2R) | error / bound | error / {args.baseline} |")
    print("|---|---:|---:|---:|---:|---:|")
    for fmt, err in errors.items():
        bpw = bits_per_weight(fmt)
        bound = 2.0 ** (-2 * bpw)
        print(f"| {fmt} | {bpw:.4f} | {err:.4g} | {bound:.4g} | {err / bound:.2f} | {err / base:.3g} |")


if __name__ == "__main__":
    main()
