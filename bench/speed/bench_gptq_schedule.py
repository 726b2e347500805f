"""GPTQ's schedule on one device: the factor, the update width and the batch of experts.

    python bench/speed/bench_gptq_schedule.py                         # CPU smoke run, 4 x 64 x 512
    python bench/speed/bench_gptq_schedule.py --shape 128x768x2048    # one Qwen3-30B-A3B ffn_gate_exps (on a GPU)

Times the compiled programs on inputs already on the device (as a quantize
unit's are), results left there. First the factor of every Hessian: the
Cholesky alone (for scale), then U with H^-1 = U^T U by three routes,
each with its distance from NumPy's float64 factor (relative Frobenius norm,
first expert): GPTQ's reference in float32 (H^-1 formed and factored,
`inverse_cholesky_upper`), the reverse route U = J chol(J H J)^-1 J in float32
(timed only, to show why it is not used) and in float64
(`reverse_cholesky_upper`). Then `gptq_quantize` vmapped over experts with
each schedule: update width (None: the whole ggml block every column step,
the CPU's; 32: the two-level lazy update), factor route and batch of experts
per call. The baseline, measured in the same run, is the CPU's schedule at 42
experts per call (the batch before the real-size work). Each row prints the
time, the ratio to the baseline, the share of bytes equal to the baseline's
and the output error tr((W-Q) H (W-Q)^T) over the first 8 experts relative to
the baseline's: a schedule may move near-tie codes, never the quality.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.speed.bench_gptq import problem  # noqa: E402
from moeheal.kernels import decode, encode  # noqa: E402
from moeheal.kernels.gptq import (  # noqa: E402
    GptqSchedule,
    gptq_quantize,
    inverse_cholesky_upper,
    reverse_cholesky_upper,
)

# (schedule, experts per call); the first is the baseline
SCHEDULES = ((GptqSchedule(), 42), (GptqSchedule(), 128), (GptqSchedule(update_width=32), 128),
             (GptqSchedule(update_width=32, float64_factor=True), 128))


def reverse_float32(hessian: jax.Array) -> jax.Array:
    """U = J chol(J H J)^-1 J in float32: the cheap route without float64 (not used: see the docstring)."""
    chol = jnp.linalg.cholesky(hessian[::-1, ::-1])  # (cols, cols) lower
    return jax.scipy.linalg.solve_triangular(chol, jnp.eye(hessian.shape[0]), lower=True)[::-1, ::-1]  # upper


def best_time(fn, repeats: int) -> tuple[object, float]:
    """(result, fastest of `repeats` calls after a compiling one), every call waited for."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return out, min(times)


def output_error(w: np.ndarray, raw: np.ndarray, fmt: str, h: np.ndarray, experts: int = 8) -> float:
    """tr((W - Q) H (W - Q)^T) summed over the first `experts` experts, float64."""
    total = 0.0
    for e in range(min(experts, w.shape[0])):
        diff = w[e].astype(np.float64) - decode.dequantize(raw[e], fmt, w.shape[1:]).astype(np.float64)  # (rows, cols)
        total += float(np.sum((diff @ h[e].astype(np.float64)) * diff))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4x64x512", help="experts x rows x cols")
    parser.add_argument("--formats", nargs="+", default=["tq2_0", "iq2_xxs"])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split("x"))
    n_expert = shape[0]
    w, importance, h = problem(shape)
    on_device = [jax.device_put(a) for a in (w, importance, h)]
    print(f"device: {jax.devices()[0].device_kind}; {args.shape}; best of {args.repeats} after a compiling call\n")
    exact = np.linalg.cholesky(np.linalg.inv(h[0].astype(np.float64))).T  # (cols, cols) first expert's U
    factors = (("Cholesky alone, float32", jnp.linalg.cholesky),
               ("GPTQ's reference route, float32 (`inverse_cholesky_upper`)", inverse_cholesky_upper),
               ("reverse route, float32 (not used)", reverse_float32),
               ("reverse route, float64 (`reverse_cholesky_upper`)", reverse_cholesky_upper))
    print("| factor of the Hessians | s | distance from the float64 factor |\n|---|---|---|")
    for name, fn in factors:
        out, seconds = best_time(partial(jax.jit(jax.vmap(fn)), on_device[2]), args.repeats)
        distance = "" if fn is jnp.linalg.cholesky else f"{np.linalg.norm(np.asarray(out[0]) - exact) / np.linalg.norm(exact):.2e}"
        print(f"| {name} | {seconds:.3f} | {distance} |", flush=True)
    print("\n| format | update width | factor | experts per call | GPTQ s | vs baseline | bytes equal | "
          "output error vs baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        cls = encode.ENCODERS[fmt]
        baseline = None
        for schedule, batch in SCHEDULES:
            batch = min(batch, n_expert)
            program = jax.jit(jax.vmap(partial(gptq_quantize, cls, schedule=schedule)))

            def run(program=program, batch=batch):
                return [program(*(a[s:s + batch] for a in (on_device[0], on_device[2], on_device[1])))
                        for s in range(0, n_expert, batch)]

            out, seconds = best_time(run, args.repeats)
            raw = np.concatenate([np.asarray(o) for o in out])  # (E, rows, bytes)
            err = output_error(w, raw, fmt, h)
            if baseline is None:
                baseline = (raw, err, seconds)
            width = "whole block" if schedule.update_width is None else schedule.update_width
            factor = "float64" if schedule.float64_factor else "float32"
            print(f"| {fmt} | {width} | {factor} | {batch} | {seconds:.3f} | {baseline[2] / seconds:.2f}x | "
                  f"{np.mean(raw == baseline[0]):.4f} | {err / baseline[1]:.4f} |", flush=True)

if __name__ == "__main__":
    main()
