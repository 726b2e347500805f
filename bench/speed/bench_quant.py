"""Quantization throughput: our JAX kernels against gguf-py and llama-quantize.

    python bench/speed/bench_quant.py            # CPU, about a minute
    python bench/speed/bench_quant.py --gpu      # CUDA JAX: GB/s of float32 weights vs HBM
    LLAMA_CPP_DIR=~/llama.cpp/build python bench/speed/bench_quant.py --gguf model-f16.gguf
    LLAMA_CPP_DIR=~/llama.cpp/build python bench/speed/bench_quant.py \
        --gguf demo/model/demo-q8_0.gguf --imatrix imatrix.gguf   # + k-quants vs llama-quantize
    LLAMA_CPP_DIR=~/llama.cpp/build python bench/speed/bench_quant.py \
        --gguf demo/model/demo-q8_0.gguf --imatrix imatrix.gguf --iquants   # i-quants instead

Prints markdown tables and writes nothing else (llama-quantize's output goes
to a temporary folder that is removed). Times exclude compilation, which is in
the first call's time: a pipeline run compiles once per tensor shape.

With ``--imatrix``, a second table times q2_k/q3_k/q4_k on the model's routed
expert tensors with the imatrix's importance against llama-quantize making
Q2_K of the same tensors with the same imatrix, both on the same cores
(``--threads``; the process is pinned to them, which also sizes XLA's pool).
llama-quantize always rewrites the whole file, so it is also timed copying
every tensor unchanged (Q8_0 -> Q8_0, same imatrix): the difference is its
quantization time. Wall time is noisy on a shared machine, so CPU time (all
threads) and the load average are printed beside it.

With ``--iquants`` that table is the i-quants instead, each against
llama-quantize making the same format of the same tensors (it refuses them
without an imatrix), with the importance-weighted error of both outputs.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402

library_gemms()  # the products as every moeheal command runs them: cuBLAS, not autotuned Triton GEMMs

H200_HBM_GBPS = 4300.0  # H200 HBM3e bandwidth, GB/s

KQUANTS = ("q2_k", "q3_k", "q4_k")
IQUANTS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")
EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

CPU_SHAPES = [(16, 256, 256), (8, 512, 2048)]
# The k- and i-quants only at the first shape: the --imatrix table times them on the demo's
# 12.6M expert weights, and at 8x512x2048 they would add minutes to the run.
CPU_FORMATS = {CPU_SHAPES[0]: ("tq2_0", "iq4_nl", *KQUANTS, *IQUANTS), CPU_SHAPES[1]: ("tq2_0", "iq4_nl")}
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

    from moeheal.kernels import encode
    from moeheal.kernels.gptq import damp_hessian

    lines = []
    for shape in CPU_SHAPES:
        w = heavy_tailed_experts(shape)
        importance = np.random.default_rng(1).gamma(1.0, 1.0, (shape[0], shape[2])).astype(np.float32)
        t_ref = best_of(lambda: gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ2_0), repeats)
        base = w.size / t_ref
        lines.append(row("gguf-py TQ2_0 (max-scale, numpy)", shape, t_ref, None, base))
        for fmt in CPU_FORMATS[shape]:
            call = lambda: encode.quantize_experts(w, fmt, importance)  # noqa: E731
            compile_s = timed_first_call(call)
            lines.append(row(f"moeheal {fmt} (weighted search, JAX)", shape, best_of(call, repeats), compile_s, base))
    shape = CPU_SHAPES[0]
    w = heavy_tailed_experts(shape)
    x = np.random.default_rng(2).standard_normal((4 * shape[2], shape[2])).astype(np.float32)
    hessians = np.broadcast_to(np.asarray(damp_hessian(x.T @ x / x.shape[0], 0.01)), (shape[0], shape[2], shape[2]))
    call = lambda: encode.quantize_experts(w, "tq2_0", hessians=hessians)  # noqa: E731
    compile_s = timed_first_call(call)
    t_ref = best_of(lambda: gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ2_0), repeats)
    lines.append(row("moeheal tq2_0 GPTQ (JAX)", shape, best_of(call, 1), compile_s, w.size / t_ref))
    return lines


def bench_gpu(repeats: int) -> list[str]:
    """Rows for the GPU run: device-resident jitted kernels, in GB/s of float32 weights."""
    import jax

    from moeheal.kernels.encode import experts_batch_jit, expert_mesh, gptq_schedule

    if jax.default_backend() == "cpu":
        raise SystemExit("--gpu: JAX has no GPU backend here (install jax[cuda12])")
    mesh, schedule = expert_mesh(jax.devices()[:1]), gptq_schedule(jax.devices()[:1])  # one device, no GPTQ here
    lines = []
    for shape in GPU_SHAPES:
        w = jax.device_put(heavy_tailed_experts(shape))
        for fmt in ("tq2_0", "iq4_nl", *KQUANTS, *IQUANTS):
            call = lambda: experts_batch_jit(fmt, schedule, mesh, w, None, None)[0].block_until_ready()  # noqa: E731
            compile_s = timed_first_call(call)
            seconds = best_of(call, repeats)
            gbps = w.size * 4 / seconds / 1e9
            lines.append(row(f"moeheal {fmt} on {jax.devices()[0].device_kind}", shape, seconds, compile_s, None,
                             f" {gbps:.1f} GB/s = {100 * gbps / H200_HBM_GBPS:.2f}% of 4.3 TB/s |"))
    return lines


def llama_quantize_binary() -> Path | None:
    """$LLAMA_CPP_DIR/bin/llama-quantize, or None where it is not built."""
    llama_dir = os.environ.get("LLAMA_CPP_DIR")
    binary = Path(llama_dir, "bin", "llama-quantize") if llama_dir else None
    return binary if binary is not None and binary.exists() else None


def bench_llama_quantize(gguf_path: str | None) -> list[str]:
    """llama-quantize to TQ2_0 on a model GGUF, or a row saying why it was skipped."""
    binary = llama_quantize_binary()
    if binary is None:
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


def pin_threads(threads: int | None) -> int:
    """Pin this process (and so XLA's thread pool and llama-quantize) to its first `threads` cores; return the count.

    Must run before JAX starts: XLA sizes its CPU pool from the schedulable cores.
    """
    cores = sorted(os.sched_getaffinity(0))
    if threads is not None:
        if not 1 <= threads <= len(cores):
            raise SystemExit(f"--threads {threads}: this process may use {len(cores)} cores")
        cores = cores[:threads]
        os.sched_setaffinity(0, cores)
    return len(cores)


def children_cpu_s() -> float:
    """User + system CPU seconds of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def best_wall_and_cpu(fn: Callable[[], object], repeats: int,
                      cpu_clock: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """(fastest wall s, least CPU s) over `repeats` calls: CPU time sums every thread and
    does not count waiting for cores another job holds, so it is the steadier figure here."""
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = cpu_clock(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_clock() - c0)
    return min(walls), min(cpus)


def expert_tensors(gguf_path: str, imatrix_path: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, weights (E, rows, cols), importance (E, cols)) of every routed-expert tensor.

    The importance is what llama-quantize derives from the same imatrix
    (tools/quantize load_imatrix): in_sum2 / count per expert, 1 for an expert
    that saw no token, so both quantizers weight the error the same way.
    """
    import gguf

    from moeheal.pipeline.gguf.model import GGUFModel

    model = GGUFModel(gguf_path)
    stats = {t.name: np.asarray(t.data, np.float32) for t in gguf.GGUFReader(imatrix_path).tensors}
    out = []
    for name in model.tensor_names:
        if not any(name.endswith(f"{role}.weight") for role in EXPERT_ROLES):
            continue
        sums, counts = stats[f"{name}.in_sum2"], stats[f"{name}.counts"]  # (E, cols), (E, 1)
        importance = np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), 1.0)  # (E, cols)
        out.append((name, model.tensor(name), importance.astype(np.float32)))
    if not out:
        raise SystemExit(f"{gguf_path}: no {'/'.join(EXPERT_ROLES)} tensors")
    return out


def run_llama_quantize(binary: Path, args: list[str], out: Path, threads: int) -> None:
    """One llama-quantize run writing `out`; its log is shown only when it fails (its metadata dump
    cuts strings mid-character, hence errors="replace")."""
    done = subprocess.run([str(binary), *args[:-1], str(out), args[-1], str(threads)], capture_output=True, text=True,
                          errors="replace")
    if done.returncode != 0:
        raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def kquant_row(method: str, n_weights: int, wall: float, cpu: float, base: float | None, compile_s: float | None) -> str:
    """One row of the k-quant table: weights/s of wall time and the ratio to llama-quantize's Q2_K."""
    rate = n_weights / wall
    ratio = f"{rate / base:.3g}x" if base else "-"
    comp = f"{compile_s:.2f}" if compile_s is not None else "-"
    return f"| {method} | {n_weights / 1e6:.2f}M | {wall:.3f} | {cpu:.3f} | {rate / 1e6:.2f} | {ratio} | {comp} |"


def llama_comparison_inputs(gguf_path: str, imatrix_path: str) -> tuple[Path, list, int, list[str]]:
    """llama-quantize's binary, the routed-expert tensors with their importance, their weight count,
    and llama-quantize's arguments for the whole-file Q8_0 copy (the I/O baseline)."""
    binary = llama_quantize_binary()
    if binary is None:
        raise SystemExit("--imatrix: LLAMA_CPP_DIR/bin/llama-quantize not found")
    tensors = expert_tensors(gguf_path, imatrix_path)
    return binary, tensors, sum(w.size for _, w, _ in tensors), ["--allow-requantize", "--imatrix", imatrix_path,
                                                                  gguf_path, "Q8_0"]


def bench_kquants_vs_llama(gguf_path: str, imatrix_path: str, threads: int, repeats: int) -> list[str]:
    """k-quant table rows: llama-quantize Q2_K of the routed experts (minus its whole-file
    Q8_0 copy) first, then our q2_k/q3_k/q4_k on the same tensors and importance."""
    import gguf

    from moeheal.kernels import encode
    from moeheal.pipeline.gguf.model import GGUFModel

    binary, tensors, n_weights, copy_args = llama_comparison_inputs(gguf_path, imatrix_path)
    q2k_args = [*copy_args[:3], *(a for role in EXPERT_ROLES for a in ("--tensor-type", f"{role}=q2_k")), *copy_args[3:]]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.gguf")
        llama = {}
        for label, args in (("copy", copy_args), ("q2_k", q2k_args)):
            def quantize_file(args: list[str] = args) -> None:
                run_llama_quantize(binary, args, out, threads)

            quantize_file()  # warms the page cache
            llama[label] = best_wall_and_cpu(quantize_file, max(repeats, 3), children_cpu_s)
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
        wrong = [name for name, _, _ in tensors if types[name] != gguf.GGMLQuantizationType.Q2_K]
        if wrong:
            raise SystemExit(f"llama-quantize left {', '.join(wrong)} unquantized: --tensor-type did not match")
    (copy_wall, copy_cpu), (q2k_wall, q2k_cpu) = llama["copy"], llama["q2_k"]
    quant_wall, quant_cpu = q2k_wall - copy_wall, q2k_cpu - copy_cpu
    base = n_weights / quant_wall
    on = f"{threads} threads"
    lines.append(kquant_row(f"llama-quantize, every tensor Q8_0 -> Q8_0 (I/O baseline, {on})",
                            n_weights, copy_wall, copy_cpu, None, None))
    lines.append(kquant_row(f"llama-quantize, experts -> Q2_K, rest Q8_0 -> Q8_0 ({on})",
                            n_weights, q2k_wall, q2k_cpu, None, None))
    lines.append(kquant_row("llama-quantize Q2_K alone (difference of the two: Q8_0 dequant + quantize)",
                            n_weights, quant_wall, quant_cpu, base, None))

    def dequantize_all() -> None:
        model = GGUFModel(gguf_path)
        for name, _, _ in tensors:
            model.tensor(name)

    lines.append(kquant_row("moeheal Q8_0 dequant, GGUFModel.tensor (gguf-py; not in our rows below)",
                            n_weights, *best_wall_and_cpu(dequantize_all, repeats), None, None))
    for fmt in KQUANTS:
        def quantize_all(fmt: str = fmt) -> None:
            for _, w, importance in tensors:
                encode.quantize_experts(w, fmt, importance)

        _, w0, imp0 = tensors[0]  # every expert tensor of the demo has one shape: one compilation
        compile_s = timed_first_call(lambda: encode.quantize_experts(w0, fmt, imp0))  # noqa: B023
        lines.append(kquant_row(f"moeheal {fmt} with importance (JAX, {on})",
                                n_weights, *best_wall_and_cpu(quantize_all, repeats), base, compile_s))
    return lines


def expert_args(fmt: str) -> list[str]:
    """llama-quantize options making every routed-expert tensor `fmt`."""
    return [a for role in EXPERT_ROLES for a in ("--tensor-type", f"{role}={fmt}")]


def weighted_error(tensors: list[tuple[str, np.ndarray, np.ndarray]], raws: dict[str, np.ndarray], fmt: str) -> float:
    """sum over the tensors of sum_j importance_j (w - deq)^2, deq by gguf-py from the bytes `raws`."""
    import gguf

    from moeheal.kernels.decode import format_of

    cls = format_of(fmt)
    total = 0.0
    for name, w, importance in tensors:
        deq = gguf.quants.dequantize(raws[name].reshape(-1, cls.type_size), cls.ggml_type).reshape(w.shape)
        total += float(np.sum(importance[:, None, :] * (w - deq).astype(np.float64) ** 2))
    return total


def iquant_row(method: str, n_weights: int, wall: float, cpu: float, base: float | None, error: float | None,
               compile_s: float | None) -> str:
    """One row of the i-quant table: weights/s of wall time, the ratios to llama-quantize's same format."""
    rate = n_weights / wall
    ratio = f"{rate / base:.3g}x" if base else "-"
    err = f"{error:.3f}" if error is not None else "-"
    comp = f"{compile_s:.2f}" if compile_s is not None else "-"
    return f"| {method} | {n_weights / 1e6:.2f}M | {wall:.3f} | {cpu:.3f} | {rate / 1e6:.2f} | {ratio} | {err} | {comp} |"


def bench_iquants_vs_llama(gguf_path: str, imatrix_path: str, threads: int, repeats: int) -> list[str]:
    """i-quant table rows: llama-quantize's whole-file Q8_0 copy, then per format llama-quantize making
    it of the routed experts (less the copy) and our kernel on the same tensors and importance."""
    import gguf

    from moeheal.kernels import decode, encode

    binary, tensors, n_weights, copy_args = llama_comparison_inputs(gguf_path, imatrix_path)
    on = f"{threads} threads"
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.gguf")

        def quantize_file(args: list[str]) -> None:
            run_llama_quantize(binary, args, out, threads)

        quantize_file(copy_args)  # warms the page cache
        copy_wall, copy_cpu = best_wall_and_cpu(lambda: quantize_file(copy_args), max(repeats, 3), children_cpu_s)
        lines.append(iquant_row(f"llama-quantize, every tensor Q8_0 -> Q8_0 (I/O baseline, {on})",
                                n_weights, copy_wall, copy_cpu, None, None, None))
        for fmt in IQUANTS:
            args = [*copy_args[:3], *expert_args(fmt), *copy_args[3:]]
            wall, cpu = best_wall_and_cpu(lambda: quantize_file(args), max(repeats, 3), children_cpu_s)  # noqa: B023
            written = {t.name: t for t in gguf.GGUFReader(out).tensors}
            if any(written[name].tensor_type != decode.format_of(fmt).ggml_type for name, _, _ in tensors):
                raise SystemExit(f"llama-quantize did not make the experts {fmt}: --tensor-type did not match")
            err_llama = weighted_error(tensors, {name: np.array(written[name].data) for name, _, _ in tensors}, fmt)
            base = n_weights / (wall - copy_wall)
            lines.append(iquant_row(f"llama-quantize {fmt.upper()} alone (less the baseline)", n_weights,
                                    wall - copy_wall, cpu - copy_cpu, base, 1.0, None))
            ours: dict[str, np.ndarray] = {}

            def quantize_all(fmt: str = fmt, ours: dict[str, np.ndarray] = ours) -> None:
                for name, w, importance in tensors:
                    ours[name] = encode.quantize_experts(w, fmt, importance)

            _, w0, imp0 = tensors[0]  # every expert tensor of the demo has one shape: one compilation
            compile_s = timed_first_call(lambda: encode.quantize_experts(w0, fmt, imp0))  # noqa: B023
            wall, cpu = best_wall_and_cpu(quantize_all, repeats)
            lines.append(iquant_row(f"moeheal {fmt} with importance (JAX, {on})", n_weights, wall, cpu, base,
                                    weighted_error(tensors, ours, fmt) / err_llama, compile_s))
    return lines


def print_table(header: str, lines: list[str]) -> None:
    """A markdown table: header, separator, rows."""
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="time the kernels on a CUDA JAX device")
    parser.add_argument("--gguf", help="model GGUF (F32/F16/BF16, or Q8_0 with --imatrix) for the llama-quantize comparison")
    parser.add_argument("--imatrix", help="imatrix GGUF of --gguf: adds k-quants vs llama-quantize Q2_K on its expert tensors")
    parser.add_argument("--iquants", action="store_true",
                        help="with --imatrix: the i-quants against llama-quantize making the same formats instead")
    parser.add_argument("--threads", type=int, help="cores for both JAX and llama-quantize (default: all schedulable)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.imatrix and (args.gpu or not args.gguf):
        parser.error("--imatrix compares CPU threads with CPU threads: it needs --gguf and no --gpu")
    if args.iquants and not args.imatrix:
        parser.error("--iquants selects the --imatrix table: it needs --imatrix")
    if not args.gpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    threads = pin_threads(args.threads)
    load_before = os.getloadavg()
    lines = bench_gpu(args.repeats) if args.gpu else bench_cpu(args.repeats)
    lines += bench_llama_quantize(args.gguf)
    compare = bench_iquants_vs_llama if args.iquants else bench_kquants_vs_llama
    compare_lines = compare(args.gguf, args.imatrix, threads, args.repeats) if args.imatrix else []
    load_after = os.getloadavg()
    header = "| method | shape (E x rows x cols) | seconds | Mweights/s | vs gguf-py TQ2_0 | first call s |"
    if args.gpu:
        header += " bandwidth |"
    print_table(header, lines)
    if compare_lines and args.iquants:
        print()
        print_table("| method | weights | wall s | CPU s | Mweights/s (wall) | vs llama-quantize, same format "
                    "| weighted error vs llama-quantize | first call s |", compare_lines)
    elif compare_lines:
        print()
        print_table("| method | weights | wall s | CPU s | Mweights/s (wall) | vs llama-quantize Q2_K | first call s |",
                    compare_lines)
    print(f"\n{threads} threads; load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {', '.join(f'{x:.2f}' for x in load_after)}")


if __name__ == "__main__":
    main()
