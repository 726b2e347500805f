"""How many blocks an i-quant's least-squares search takes per step, on the device it runs on.

    python bench/speed/bench_search_blocks.py --gpu                 # CUDA JAX: a Qwen3-30B-A3B down tensor,
                                                                  # 128 x 2048 x 768, iq2_xxs iq2_xs iq2_s iq3_xxs
    python bench/speed/bench_search_blocks.py --shape 4x256x512     # CPU

`kernels.iquants_encode` searches the blocks of a tensor in steps of `search_blocks()` blocks
(per expert: `quantize_experts` vmaps the experts). On a CPU a small step keeps its (groups, grid
points) arrays in cache; on a GPU each step is a few dozen kernels whatever its size, so a
30B's expert tensor (6,144 blocks) in steps of 8 is 768 sequential rounds of launches. This
times `quantize_experts` without Hessians (the sensitivity stage's and every least-squares
variant's search) at each candidate count, the baseline `SEARCH_BLOCKS` (8) first, in the same
run on the same inputs, and prints the ratio and the share of bytes equal to the baseline's
(every block is searched on its own, so it should be 1). Times exclude compilation (first
call), best of ``--repeats``; the bytes come back to the host inside the timing, as the
pipeline's do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402

library_gemms()  # the products as every moeheal command runs them

FORMATS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")
CANDIDATES = (8, 32, 64, 128, 256)


def main() -> None:
    """Time the least-squares search per format at each blocks-per-step count; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="time on a CUDA JAX device")
    parser.add_argument("--shape", default="128x2048x768", help="experts x rows x cols")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--blocks", nargs="*", type=int, default=list(CANDIDATES),
                        help="blocks per step to time; the first is the baseline")
    args = parser.parse_args()

    import jax

    from moeheal.kernels import encode, iquants_encode

    shape = tuple(int(v) for v in args.shape.split("x"))
    device = jax.devices("gpu")[0] if args.gpu else jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    w = jax.device_put((rng.standard_t(4, size=shape) * 0.02).astype(np.float32), device)  # (E, rows, cols)
    importance = jax.device_put(rng.gamma(1.0, 1.0, (shape[0], shape[2])).astype(np.float32), device)  # (E, cols)
    setting = "ACCELERATOR_SEARCH_BLOCKS" if args.gpu else "SEARCH_BLOCKS"
    print(f"device: {device.device_kind}; {args.shape}; best of {args.repeats} after a compiling call; "
          f"`iquants_encode.{setting}` set per row\n")
    print("| format | blocks per step | least squares s | vs first | bytes equal to first | experts per call |")
    print("|---|---|---|---|---|---|")
    with jax.default_device(device):
        for fmt in args.formats:
            first_s, first_bytes = None, None
            for blocks in args.blocks:
                setattr(iquants_encode, setting, blocks)
                jax.clear_caches()  # the programs read the count when traced
                encode.clear_fitted_batches()

                def ls() -> np.ndarray:
                    return encode.quantize_experts(w, fmt, importance, devices=[device])

                raw = ls()  # compile
                seconds = best_of(ls, args.repeats)
                first_s = seconds if first_s is None else first_s
                first_bytes = raw if first_bytes is None else first_bytes
                batch = encode.fitted_batches().get((fmt, shape, False), "CPU: by weights")
                print(f"| {fmt} | {blocks} | {seconds:.3f} | {first_s / seconds:.2f}x "
                      f"| {np.mean(raw == first_bytes):.4f} | {batch} |", flush=True)


if __name__ == "__main__":
    main()
