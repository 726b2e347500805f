"""Forward-pass throughput: the JAX layer-major runner vs transformers (torch CPU) vs llama.cpp.

    python bench/speed/bench_forward.py [--gguf demo/model/demo-q8_0.gguf] [--batch 4] [--seq 512] [--scored 128]

Times a batch of `--batch` sequences of `--seq` tokens through each engine on
the same GGUF file and prints a markdown table of tokens/s, each against
transformers' from the same run. The JAX runner
runs on whatever backend JAX finds (CPU or GPU); its first call, which
compiles, is timed separately. With `--scored N` the runner is also timed
asking for the logits at the last N positions only, as the evaluation does
(its baseline: the same runner, every position), and again without keeping the
output matrix between passes (``Runner``'s ``output_cache_bytes = 0``): both pay
at a real vocabulary. Without the demo model a tiny random one is
generated. With LLAMA_CPP_DIR pointing at a llama.cpp build, `llama-perplexity`
is timed on the same number of tokens.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.gguf.model import GGUFModel  # noqa: E402
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402
from moeheal.pipeline.model.runner import Runner  # noqa: E402

library_gemms()  # the products as every moeheal command runs them: cuBLAS, not autotuned Triton GEMMs

DEFAULT_GGUF = ROOT / "demo" / "model" / "demo-q8_0.gguf"
TRANSFORMERS = "transformers (torch)"  # the baseline: tokens/s relative to it


def bench_jax(model: GGUFModel, tokens: np.ndarray, reps: int, scored: int | None) -> list[tuple[str, str, float]]:
    import jax

    runner = Runner(model)
    t0 = time.perf_counter()
    runner.forward(tokens)
    first = time.perf_counter() - t0
    backend = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    rows = [("moeheal JAX, first call (compiles)", backend, first),
            ("moeheal JAX", backend, best_of(lambda: runner.forward(tokens), reps))]
    if scored:
        last = slice(tokens.shape[1] - scored, tokens.shape[1])
        runner.forward(tokens, positions=last)  # compiles the narrower output product
        rows.append((f"moeheal JAX, logits at the last {scored} positions", backend,
                     best_of(lambda: runner.forward(tokens, positions=last), reps)))
        print(f"logits at {scored} of {tokens.shape[1]} positions: {rows[-1][2] / rows[1][2]:.2f}x the time of "
              "every position's (same runner, same run)")
        unkept = Runner(model, output_cache_bytes=0)  # the output matrix dequantized again on every pass
        unkept.forward(tokens, positions=last)
        rows.append(("the same, output matrix not kept", backend,
                     best_of(lambda: unkept.forward(tokens, positions=last), reps)))
        print(f"keeping the output matrix: {rows[-2][2] / rows[-1][2]:.2f}x the time of not keeping it")
    return rows


def bench_transformers(path: Path, model: GGUFModel, tokens: np.ndarray, reps: int) -> list[tuple[str, str, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    widths = {"moe_intermediate_size": model.hp.d_expert}  # not read from GGUF by transformers 5.x
    if model.hp.d_shexp:
        widths["shared_expert_intermediate_size"] = model.hp.d_shexp
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **widths).eval()
    batch = torch.from_numpy(tokens).long()

    def run() -> None:
        with torch.no_grad():
            hf(batch)

    return [(TRANSFORMERS, f"cpu, {torch.get_num_threads()} threads", best_of(run, reps))]


def bench_llama_cpp(path: Path, model: GGUFModel, tokens: np.ndarray) -> list[tuple[str, str, float]]:
    """llama-perplexity over the same token count (text decoded from the tokens), if a build is given."""
    build = os.environ.get("LLAMA_CPP_DIR")
    exe = Path(build) / "bin" / "llama-perplexity" if build else None
    if exe is None or not exe.exists():
        print("llama.cpp: skipped (set LLAMA_CPP_DIR to a build with bin/llama-perplexity)", file=sys.stderr)
        return []
    B, T = tokens.shape
    text = model.tokenizer().decode(tokens.reshape(-1).tolist())
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [str(exe), "-m", str(path), "-f", f.name, "-c", str(T), "-b", str(B * T), "--chunks", str(B)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    os.unlink(f.name)
    if proc.returncode != 0:
        print(f"llama.cpp: failed ({proc.returncode}): {proc.stderr[-500:]}", file=sys.stderr)
        return []
    m = re.search(r"prompt eval time\s*=\s*([\d.]+) ms", proc.stderr)
    seconds = float(m.group(1)) / 1000 if m else wall
    return [("llama.cpp llama-perplexity", "cpu/gpu as built" + ("" if m else ", wall incl. load"), seconds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scored", type=int, help="also time the logits at the last N positions only")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    path = args.gguf
    if not path.exists():
        from bench.inputs.ggufs import make_tiny_gguf

        path = make_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny-qwen2moe-q8_0.gguf", matrix_type="q8_0")
        print(f"{args.gguf} not found; using a generated tiny model", file=sys.stderr)
    model = GGUFModel(path)
    tokens = np.random.default_rng(0).integers(0, model.hp.vocab_size, (args.batch, args.seq)).astype(np.int32)

    rows = bench_jax(model, tokens, args.reps, args.scored)
    if not args.no_transformers:
        rows += bench_transformers(path, model, tokens, args.reps)
    rows += bench_llama_cpp(path, model, tokens)

    hp = model.hp
    n = tokens.size
    print(f"\n{path.name}: {model.arch}, {hp.n_layer} layers, d={hp.d_model}, {hp.n_expert} experts "
          f"(top {hp.n_expert_used}), batch {args.batch} x {args.seq} tokens\n")
    baseline = next((seconds for engine, _, seconds in rows if engine == TRANSFORMERS), None)  # the same run's
    print("| engine | backend | seconds | tokens/s | vs transformers |")
    print("|---|---|---:|---:|---:|")
    for engine, backend, seconds in rows:
        ratio = f"{baseline / seconds:.2f}x" if baseline else ""
        print(f"| {engine} | {backend} | {seconds:.3f} | {n / seconds:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
