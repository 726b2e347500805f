"""Quantization throughput: our JAX kernels against gguf-py and llama-quantize.

    python bench/bench_quant.py            # CPU, well under a minute
    python bench/bench_quant.py --gpu      # CUDA JAX: GB/s of float32 weights vs HBM
    LLAMA_CPP_DIR=~/llama.cpp/build python bench/bench_quant.py --gguf model-f16.gguf

Prints one markdown table and writes nothing else (llama-quantize's output
goes to a temporary folder that is removed). Times exclude compilation, which
is in the first call's time: a pipeline run compiles once per tensor shape.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import best_of  # noqa: E402

H200_HBM_GBPS = 4300.0  # H200 HBM3e bandwidth, GB/s

CPU_SHAPES = [(16, 256, 256), (8, 512, 2048)]
GPU_SHAPES = [(16, 256, 256), (128, 768, 2048)]  # the second: one Qwen3-30B-A3B ffn_gate_exps


def heavy_tailed_experts(shape: tuple[int, int, int], seed: int = 0) -> np.ndarray:
    """Expert weights with LLM-like heavy tails, float32 (E, rows, cols)."""
    rng = np.random.default_rng(seed)
    return (0.02 * rng.standard_t(4, shape)).astype(np.float32)


def timed_first_call(fn: Callable[[], object]) -> float:
    """Seconds of one call (the one that compiles)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def row(method: str, shape: tuple[int, ...], seconds: float, compile_s: float | None, base: float | None,
        extra: str = "") -> str:
    """One markdown table row: weights/s and the ratio to the gguf-py baseline."""
    n = int(np.prod(shape))
    rate = n / seconds
    ratio = f"{rate / base:.3g}x" if base else "-"
    comp = f"{compile_s:.2f}" if compile_s is not None else "-"
    return f"| {method} | {'x'.join(map(str, shape))} | {seconds:.3f} | {rate / 1e6:.2f} | {ratio} | {comp} |{extra}"


def bench_cpu(repeats: int) -> list[str]:
    """Rows for the CPU run: gguf-py TQ2_0 first, then our kernels through the public API."""
    import gguf

    from moeheal import kernels

    lines = []
    for shape in CPU_SHAPES:
        w = heavy_tailed_experts(shape)
        importance = np.random.default_rng(1).gamma(1.0, 1.0, (shape[0], shape[2])).astype(np.float32)
        t_ref = best_of(lambda: gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ2_0), repeats)
        base = w.size / t_ref
        lines.append(row("gguf-py TQ2_0 (max-scale, numpy)", shape, t_ref, None, base))
        for fmt in ("tq2_0", "iq4_nl"):
            call = lambda: kernels.quantize_experts(w, fmt, importance)  # noqa: E731
            compile_s = timed_first_call(call)
            lines.append(row(f"moeheal {fmt} (weighted search, JAX)", shape, best_of(call, repeats), compile_s, base))
    shape = CPU_SHAPES[0]
    w = heavy_tailed_experts(shape)
    x = np.random.default_rng(2).standard_normal((4 * shape[2], shape[2])).astype(np.float32)
    hessians = np.broadcast_to(np.asarray(kernels.damp_hessian(x.T @ x / x.shape[0], 0.01)), (shape[0], shape[2], shape[2]))
    call = lambda: kernels.quantize_experts(w, "tq2_0", hessians=hessians)  # noqa: E731
    compile_s = timed_first_call(call)
    t_ref = best_of(lambda: gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ2_0), repeats)
    lines.append(row("moeheal tq2_0 GPTQ (JAX)", shape, best_of(call, 1), compile_s, w.size / t_ref))
    return lines


def bench_gpu(repeats: int) -> list[str]:
    """Rows for the GPU run: device-resident jitted kernels, in GB/s of float32 weights."""
    import jax

    from moeheal.kernels import _quantize_experts_jit

    if jax.default_backend() == "cpu":
        raise SystemExit("--gpu: JAX has no GPU backend here (install jax[cuda12])")
    lines = []
    for shape in GPU_SHAPES:
        w = jax.device_put(heavy_tailed_experts(shape))
        for fmt in ("tq2_0", "iq4_nl"):
            call = lambda: _quantize_experts_jit(fmt, w, None, None).block_until_ready()  # noqa: E731
            compile_s = timed_first_call(call)
            seconds = best_of(call, repeats)
            gbps = w.size * 4 / seconds / 1e9
            lines.append(row(f"moeheal {fmt} on {jax.devices()[0].device_kind}", shape, seconds, compile_s, None,
                             f" {gbps:.1f} GB/s = {100 * gbps / H200_HBM_GBPS:.2f}% of 4.3 TB/s |"))
    return lines


def bench_llama_quantize(gguf_path: str | None) -> list[str]:
    """llama-quantize to TQ2_0 on a model GGUF, or a row saying why it was skipped."""
    llama_dir = os.environ.get("LLAMA_CPP_DIR")
    binary = Path(llama_dir, "bin", "llama-quantize") if llama_dir else None
    if binary is None or not binary.exists():
        return ["| llama-quantize TQ2_0 | - | - | - | - | - | skipped: LLAMA_CPP_DIR/bin/llama-quantize not found"]
    if not gguf_path:
        return ["| llama-quantize TQ2_0 | - | - | - | - | - | skipped: no --gguf model given"]
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    n_weights = sum(int(np.prod(t.shape)) for t in reader.tensors if len(t.shape) >= 2)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([str(binary), "--allow-requantize", "--pure", gguf_path, str(Path(tmp, "out.gguf")), "TQ2_0"],
                       check=True, capture_output=True)
        seconds = time.perf_counter() - t0
    return [f"| llama-quantize TQ2_0 (whole model, all threads) | {n_weights} weights | {seconds:.3f} | "
            f"{n_weights / seconds / 1e6:.2f} | - | - |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="time the kernels on a CUDA JAX device")
    parser.add_argument("--gguf", help="model GGUF (F32/F16/BF16) for the llama-quantize comparison")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not args.gpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    lines = bench_gpu(args.repeats) if args.gpu else bench_cpu(args.repeats)
    lines += bench_llama_quantize(args.gguf)
    header = "| method | shape (E x rows x cols) | seconds | Mweights/s | vs gguf-py TQ2_0 | first call s |"
    if args.gpu:
        header += " bandwidth |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
