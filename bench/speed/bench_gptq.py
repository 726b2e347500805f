"""GPTQ rounding cost per format: `kernels.quantize_experts` with Hessians against without.

    python bench/speed/bench_gptq.py                          # CPU: the demo's expert shape, 32 x 256 x 256,
                                                              # its formats (tq2_0 q2_k iq2_xxs; --formats for more)
    python bench/speed/bench_gptq.py --shape small            # CPU smoke run, 4 x 64 x 256
    python bench/speed/bench_gptq.py --gpu --shape 30b        # CUDA JAX: Qwen3-30B-A3B expert tensors,
                                                              # 128 x 768 x 2048 (gate, up) and 128 x 2048 x 768 (down)

On an accelerator each row also says how many experts one GPTQ call took: the batch cut to the device's
memory (`encode.fitted_batches`), all of them where the program fits.

GPTQ quantizes column groups in order and pushes each group's error onto the
remaining columns through the Cholesky factor of H^-1; for the codebook
i-quants a group is 8 columns searched against the whole grid, so the search
is the cost. Each row times the same experts with importance-weighted
least-squares rounding (the baseline, measured in the same run) and with GPTQ
(damped Hessians of correlated synthetic activations), per tensor (the whole
expert stack), and prints the ratio and the GPTQ throughput. Times exclude
compilation (first call), best of ``--repeats``. The inputs are on the
device before the clock starts, as the pipeline's are (a quantize unit
dequantizes the layer and sums its Hessians there); the bytes come back to
the host inside the timing.

GFLOP/s counts GPTQ's dense arithmetic per expert: the factor (Cholesky,
cols^3 / 3, and the triangular inverse, cols^3) and the error feedback (the
lazy update of the later columns after every ggml block, 2 rows cols^2, and
the updates inside a block, 2 rows cols block). The roofs are NVIDIA's H200
SXM figures: FP32 67 TFLOPS (CUDA cores; what HIGHEST precision runs on) and
TF32 tensor 494.7 TFLOPS dense (the datasheet's 989 TFLOPS is with 2:4
sparsity, which a dense product cannot use). The least-squares scale search
is set against the memory roof, HBM3e 4.8 TB/s: the bytes it must move (the
float32 weights and importance read, the block bytes written) over its time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402

library_gemms()  # the products as every moeheal command runs them: cuBLAS, not autotuned Triton GEMMs

FORMATS = ("tq2_0", "q2_k", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")  # every format GPTQ rounds
DEFAULT_FORMATS = ("tq2_0", "q2_k", "iq2_xxs")  # the demo's: about a minute on a 2-core CPU
SHAPES = {
    "small": [(4, 64, 256)],
    "demo": [(32, 256, 256)],
    "30b": [(128, 768, 2048), (128, 2048, 768)],  # Qwen3-30B-A3B: ffn_gate_exps / ffn_up_exps, ffn_down_exps
    "30b-down": [(128, 2048, 768)],  # its ffn_down_exps alone: the tensor whose i-quant batch ran out of memory
    "next": [(512, 512, 2048), (512, 2048, 512)],  # Qwen3-Next-80B-A3B: ffn_gate_exps / ffn_up_exps, ffn_down_exps
}
H200_FP32_TFLOPS = 67.0
H200_TF32_DENSE_TFLOPS = 494.7
H200_HBM_TB_PER_S = 4.8


def least_squares_bytes(shape: tuple[int, int, int], fmt: str) -> float:
    """Bytes the least-squares search must move: float32 weights and importance in, block bytes out."""
    from moeheal.kernels import encode

    n_expert, rows, cols = shape
    cls = encode.ENCODERS[fmt]
    return 4.0 * n_expert * (rows * cols + cols) + n_expert * rows * cols / cls.block_size * cls.type_size


def gptq_flops(shape: tuple[int, int, int], block: int) -> float:
    """Dense floating-point operations of GPTQ on an expert stack: factor plus error feedback."""
    n_expert, rows, cols = shape
    factor = cols**3 / 3 + cols**3  # Cholesky of J H J, then its triangular inverse
    feedback = 2 * rows * cols * cols + 2 * rows * cols * block  # lazy updates after each block, updates inside it
    return n_expert * (factor + feedback)


def problem(shape: tuple[int, int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Heavy-tailed experts (E, rows, cols), their importance (E, cols) and damped Hessians (E, cols, cols)."""
    n_expert, rows, cols = shape
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=shape) * 0.02).astype(np.float32)  # (E, rows, cols)
    mix = rng.normal(size=(cols, cols)).astype(np.float32) / np.sqrt(cols)  # correlated input directions
    x = rng.normal(size=(n_expert, 256, cols)).astype(np.float32) @ mix  # (E, N, cols)
    h = np.swapaxes(x, 1, 2) @ x / x.shape[1]  # (E, cols, cols); a BLAS product, einsum's loop takes minutes at 30b
    h += np.eye(cols, dtype=np.float32)[None] * (0.01 * np.trace(h, axis1=1, axis2=2)[:, None, None] / cols)
    importance = np.einsum("ecc->ec", h).astype(np.float32)  # (E, cols): diag(H)
    return w, importance, h.astype(np.float32)


def main() -> None:
    """Time least-squares and GPTQ rounding for each format and shape; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="time on a CUDA JAX device")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo", help="expert stacks to time")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=list(DEFAULT_FORMATS))
    args = parser.parse_args()

    import jax

    from moeheal.kernels import encode

    device = jax.devices("gpu")[0] if args.gpu else jax.devices("cpu")[0]
    print(f"device: {device.device_kind}; best of {args.repeats} after a compiling call; roofs: H200 SXM FP32 "
          f"{H200_FP32_TFLOPS:g} TFLOPS, TF32 tensor {H200_TF32_DENSE_TFLOPS:g} TFLOPS dense\n")
    print("| format | experts x rows x cols | least squares s | least squares GB/s | % of HBM roof | GPTQ s "
          "| GPTQ / least squares | GPTQ M weights/s | GPTQ GFLOP/s | % of FP32 roof | % of TF32 roof "
          "| GPTQ experts per call |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with jax.default_device(device):
        for shape in SHAPES[args.shape]:
            w, importance, h = (jax.device_put(a, device) for a in problem(shape))
            for fmt in args.formats:
                def ls() -> None:
                    encode.quantize_experts(w, fmt, importance, devices=[device])

                def gptq() -> None:
                    encode.quantize_experts(w, fmt, importance, hessians=h, devices=[device])

                ls(), gptq()  # compile
                t_ls, t_gptq = best_of(ls, args.repeats), best_of(gptq, args.repeats)
                gflops = gptq_flops(shape, encode.ENCODERS[fmt].block_size) / t_gptq / 1e9
                ls_gb = least_squares_bytes(shape, fmt) / t_ls / 1e9
                print(f"| {fmt} | {'x'.join(map(str, shape))} | {t_ls:.3f} | {ls_gb:.3g} "
                      f"| {100 * ls_gb / 1e3 / H200_HBM_TB_PER_S:.3g} | {t_gptq:.3f} | {t_gptq / t_ls:.1f}x "
                      f"| {w.size / t_gptq / 1e6:.2f} | {gflops:.3g} | {100 * gflops / 1e3 / H200_FP32_TFLOPS:.3g} "
                      f"| {100 * gflops / 1e3 / H200_TF32_DENSE_TFLOPS:.3g} "
                      f"| {encode.fitted_batches().get((fmt, shape, True), 'CPU: by weights')} |", flush=True)


if __name__ == "__main__":
    main()
