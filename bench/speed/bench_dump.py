"""Peak memory and throughput of the streaming dump as the trace grows.

Each trace length runs in a fresh process that reports its own peak RSS, so
the figures are independent. Bounded memory means the 32k-token dump peaks
within 1.5x of the 1k-token one: only one processing chunk of activations is
ever held, whatever the trace length.

Each size also runs with one sequence per forward pass (`dumps.DUMP_BATCH_SEQS` set to 1 in that
process), how every pass ran before the dump ran batches of sequences (`dumps.forward_batches`): the
ratio of the two, measured in the same run, is what the batching gives on this backend.

    python bench/speed/bench_dump.py [--gguf demo/model/demo-q8_0.gguf] [--sizes 1024 8192 32768]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))

from moeheal.pipeline.data.dumps import DUMP_BATCH_SEQS  # noqa: E402

CHILD = """
import json, resource, sys, time
sys.path.append({repo!r})
import numpy as np
from pathlib import Path
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.data import dumps
from moeheal.pipeline.data.dumps import dump_trace
dumps.DUMP_BATCH_SEQS = {batch}
model = GGUFModel({gguf!r})
n, seq_tokens = {n}, 512
tokens = np.random.default_rng(0).integers(0, model.hp.vocab_size, n).astype(np.int32)
seq = (np.arange(n) // seq_tokens).astype(np.int32)
start = time.perf_counter()
dump_trace(Path({out!r}), Runner(model), tokens, seq, "calibration", chunk_tokens=2048, seq_tokens=seq_tokens,
           log=lambda m: None)
elapsed = time.perf_counter() - start
print(json.dumps({{"tokens": n, "seconds": elapsed,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def default_gguf(tmp: Path) -> Path:
    demo = REPO / "demo" / "model" / "demo-q8_0.gguf"
    if demo.exists():
        return demo
    from bench.inputs.ggufs import make_tiny_gguf

    return make_tiny_gguf(tmp / "bench.gguf", n_layer=2, d_model=256, d_expert=256, d_shexp=256, matrix_type="q8_0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf or default_gguf(Path(tmp))
        rows = []
        single = {}
        for n in args.sizes:
            for batch in (DUMP_BATCH_SEQS, 1):  # the dump's batches of sequences per pass, then one
                out = Path(tmp) / f"dump{n}_{batch}.zarr"
                code = CHILD.format(repo=str(REPO), gguf=str(gguf), n=n, out=str(out), batch=batch)
                result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                row = json.loads(result.stdout.strip().splitlines()[-1])
                if batch == 1:
                    single[n] = row["seconds"]
                else:
                    rows.append(row)
    base = rows[0]["peak_rss_mb"]
    print(f"model: {gguf.name}\n")
    print("| trace tokens | seconds | tokens/s | peak RSS (MB) | RSS vs first | one sequence per pass, s "
          "| batched vs one |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:.0f} | "
              f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / base:.2f}x | {single[r['tokens']]:.1f} | "
              f"{single[r['tokens']] / r['seconds']:.2f}x |")


if __name__ == "__main__":
    main()
