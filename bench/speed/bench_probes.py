"""What recording activation peaks costs a forward pass (`pipeline.model.numerics`).

    python bench/speed/bench_probes.py [--gguf demo/model/demo-q8_0.gguf] [--batch 8] [--seq 128] [--reps 5]

The evaluation records, on its first pass over each batch, the largest
|activation| at every site where llama.cpp narrows activations: one host
callback per site and layer, compiled only into such passes. This times the
same batch through the same runner without and with the probes (each compiled
first, outside the timing) and prints both and their ratio, measured in the same
run; CPU seconds (`time.process_time`) by default, so that other work on a
shared machine does not count. A plain pass compiles the graph it compiled
before the probes existed (tests/test_numerics.py), so only the probing pass
can cost anything.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from bench.tools.timing import best_of  # noqa: E402

from moeheal.pipeline.gguf.model import GGUFModel  # noqa: E402
from moeheal.pipeline.model.numerics import ActivationPeaks  # noqa: E402
from moeheal.pipeline.model.runner import Runner  # noqa: E402

DEFAULT_GGUF = ROOT / "demo" / "model" / "demo-q8_0.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--wall", action="store_true", help="wall-clock seconds instead of CPU seconds")
    args = ap.parse_args()
    clock = time.perf_counter if args.wall else time.process_time

    model = GGUFModel(args.gguf)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.hp.vocab_size, size=(args.batch, args.seq)).astype(np.int32)  # (B, T)
    runner = Runner(model)
    runner.forward(tokens)  # compiles the plain pass
    runner.forward(tokens, peaks=ActivationPeaks())  # compiles the probing pass
    plain = best_of(lambda: runner.forward(tokens), args.reps, clock)
    probed = best_of(lambda: runner.forward(tokens, peaks=ActivationPeaks()), args.reps, clock)
    peaks = ActivationPeaks()
    runner.forward(tokens, peaks=peaks)
    sites = len(peaks.peaks)
    unit = "wall s" if args.wall else "CPU s"
    print(f"{args.gguf.name}: {model.hp.n_layer} layers, batch {args.batch} x {args.seq} tokens, {sites} sites, "
          f"best of {args.reps}")
    print(f"| pass | {unit} |\n|---|---|\n| plain | {plain:.4f} |\n| recording activation peaks | {probed:.4f} |")
    print(f"probing pass / plain pass: {probed / plain:.3f}x (same runner, same run)")


if __name__ == "__main__":
    main()
