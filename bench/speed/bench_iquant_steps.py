"""How much of an i-quant's search one step takes, on the device it runs on: blocks per step of the
least-squares search, rows per step of GPTQ's plans.

    python bench/speed/bench_iquant_steps.py --gpu                        # CUDA JAX: a Qwen3-30B-A3B down
                                                                        # tensor, 128 x 2048 x 768
    python bench/speed/bench_iquant_steps.py --gpu --what plan            # GPTQ's plans instead
    python bench/speed/bench_iquant_steps.py --shape 8x256x512 --what plan --counts 64 16 8   # CPU
    python bench/speed/bench_iquant_steps.py --weights demo --counts 8 4 2 --formats iq2_xs iq2_s   # CPU
    python bench/speed/bench_iquant_steps.py --gpu --counts 64 --candidates scan at-once   # the candidate scales

`kernels.iquants_encode` searches a tensor's blocks in steps of `search_blocks()` blocks and
plans GPTQ's block and sub-block scales in steps of `plan_rows()` rows (per expert:
`quantize_experts` vmaps the experts). On a CPU a small step keeps its (groups, grid points)
arrays in cache; on a GPU each step is a few dozen kernels whatever its size, so a 30B's
expert tensor (6,144 blocks) in steps of 8 is 768 sequential rounds of launches (on an H100 that
cost less than supposed: 64 a step was 1.2-1.4x as fast as 8, bench/RESULTS.md). This times
`quantize_experts` (`--what search`: without Hessians, the sensitivity stage's and every
least-squares variant's search; `--what plan`: GPTQ, with Hessians) at each count, the first
count the baseline, in the same run on the same inputs, and prints the ratio, the share of
bytes equal to the baseline's and the count of those that are not (each block and each row is
searched on its own, so in exact arithmetic none moves; in float32 a count can change how XLA
orders a sum, and a near-tie code moves).
`--weights demo` takes the demo model's trained experts (every routed tensor of its GGUF, stacked:
288 x 256 x 256) instead of random ones, with the same synthetic importance: random weights have
almost no near-ties, trained ones a few. `--candidates scan at-once` also sets, per row, whether the
search scores a sub-block's candidate scales one at a time or all at once (`candidates_at_once`; the
accelerator's default is at once). Times exclude compilation (the first call, its
time printed beside), best of ``--repeats``; the bytes come back to the host inside the timing, as the pipeline's do.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.speed.bench_gptq import problem  # noqa: E402
from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402

library_gemms()  # the products as every moeheal command runs them

DEMO_MODEL = Path(__file__).resolve().parents[2] / "demo" / "model" / "demo-q8_0.gguf"
FORMATS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")
SETTINGS = {("search", False): "SEARCH_BLOCKS", ("search", True): "ACCELERATOR_SEARCH_BLOCKS",
            ("plan", False): "PLAN_ROWS", ("plan", True): "ACCELERATOR_PLAN_ROWS"}


def demo_experts() -> np.ndarray:
    """Every routed expert tensor of the demo's model, stacked along the experts: (E, rows, cols)."""
    from moeheal.pipeline.gguf.model import open_model
    from moeheal.pipeline.stages.quantize import expert_weights

    model = open_model(DEMO_MODEL)
    return np.concatenate([np.asarray(w) for layer in model.moe_layers
                           for w in expert_weights(model, layer).values()])  # (E, rows, cols)


def main() -> None:
    """Time the search or GPTQ per format at each count per step; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="time on a CUDA JAX device")
    parser.add_argument("--what", choices=("search", "plan"), default="search")
    parser.add_argument("--shape", default="128x2048x768", help="experts x rows x cols")
    parser.add_argument("--weights", choices=("random", "demo"), default="random",
                        help="demo: the demo model's trained experts (the shape is theirs)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=["iq2_xxs", "iq2_s"])
    parser.add_argument("--counts", nargs="*", type=int, default=[8, 64, 256],
                        help="blocks (search) or rows (plan) per step; the first is the baseline")
    parser.add_argument("--candidates", nargs="*", choices=("default", "scan", "at-once"), default=["default"],
                        help="how the least-squares search scores a sub-block's candidate scales, per row: the "
                             "backend's default (`iquants_encode.candidates_at_once`), one at a time, or all at "
                             "once; GPTQ's plans always scan")
    args = parser.parse_args()

    import jax

    from moeheal.kernels import encode, iquants_encode

    device = jax.devices("gpu")[0] if args.gpu else jax.devices("cpu")[0]
    if args.weights == "demo":
        w = demo_experts()  # (E, rows, cols)
        args.shape = "x".join(map(str, w.shape))
        _, importance, h = problem(w.shape)
    else:
        w, importance, h = problem(tuple(int(v) for v in args.shape.split("x")))
    shape = w.shape
    w, importance, h = (jax.device_put(a, device) for a in (w, importance, h))
    hessians = h if args.what == "plan" else None
    setting = SETTINGS[args.what, args.gpu]
    method = "GPTQ" if hessians is not None else "least squares"
    print(f"device: {device.device_kind}; {args.weights} {args.shape}; {method}; "
          f"best of {args.repeats} after a compiling call; `iquants_encode.{setting}` set per row\n")
    print(f"| format | {setting} | candidates | compiling call s | s | vs first | bytes equal to first "
          "| bytes unlike first | experts per call |")
    print("|---|---|---|---|---|---|---|---|---|")
    backend_default = iquants_encode.candidates_at_once
    with jax.default_device(device):
        for fmt in args.formats:
            first_s, first_bytes = None, None
            for count, candidates in ((c, m) for c in args.counts for m in args.candidates):
                setattr(iquants_encode, setting, count)
                iquants_encode.candidates_at_once = {"default": backend_default, "scan": lambda: False,
                                                     "at-once": lambda: True}[candidates]
                jax.clear_caches()  # the programs read the count when traced
                encode.clear_fitted_batches()

                def run() -> np.ndarray:
                    return encode.quantize_experts(w, fmt, importance, hessians=hessians, devices=[device])

                start = time.perf_counter()
                raw = run()  # compile
                compiling_s = time.perf_counter() - start
                seconds = best_of(run, args.repeats)
                first_s = seconds if first_s is None else first_s
                first_bytes = raw if first_bytes is None else first_bytes
                batch = encode.fitted_batches().get((fmt, shape, hessians is not None), "CPU: by weights")
                print(f"| {fmt} | {count} | {candidates} | {compiling_s:.1f} | {seconds:.3f} "
                      f"| {first_s / seconds:.2f}x "
                      f"| {np.mean(raw == first_bytes):.4f} | {int(np.sum(raw != first_bytes))} | {batch} |",
                      flush=True)


if __name__ == "__main__":
    main()
