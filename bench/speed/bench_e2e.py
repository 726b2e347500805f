"""End-to-end tuning's cost per calibration token (`pipeline/stages/e2e.py`), on the demo or at a real width.

    python bench/speed/bench_e2e.py [--seq 512] [--batch 1]              # the demo model (2-core CPU: a minute)
    python bench/speed/bench_e2e.py --gguf model.gguf                    # any GGUF
    python bench/speed/bench_e2e.py --like qwen3-30b-a3b [--layers 1 2]  # a real width (a GPU)

The model is the bundled demo's, `--gguf`, or with `--like`, for each layer count, `moeheal synth
--like ... --layers N` (the real model's shapes and vocabulary, random weights). Its routed experts
are quantized to Q2_K with our kernels (the "assembled" file: codes and fp16 scales as the e2e stage
finds them), and the script times, on whatever backend JAX finds:
- one tuning step of the streamed stage (forward layer by layer, KL against the reference's top
  `--topk` tokens plus a bucket, the backward sweep with each layer recomputed, gradient with respect
  to every fp16 scale, norm and router, one Adam update a layer at a time) on `--batch` sequences
  of `--seq` tokens;
- one forward-only KL pass on the same batch (what the curve's measurements cost per token);
- the baseline in the same run: the runner's plain forward (`Runner.forward`, weights cached) on
  the same tokens, so the ratio says what differentiating through the dequantization costs.
With two layer counts the difference is one layer's cost, and a whole-model figure per token is
extrapolated (labelled so): the fixed part (embedding, output projection, KL over the vocabulary)
plus n_layer times the per-layer part. Each model is benched in a process of its own, so the
device's peak memory (`peak_bytes_in_use`, run with XLA_PYTHON_CLIENT_PREALLOCATE=false on a GPU)
is that model's: flat in the layer count, the stage holds one layer at a time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from bench.tools.device_trace import traced  # noqa: E402
from bench.tools.timing import best_of  # noqa: E402
from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402
from moeheal.pipeline.config import E2E_TOPK  # noqa: E402

library_gemms()  # the products as every moeheal command runs them: cuBLAS, not autotuned Triton GEMMs

DEMO_GGUF = ROOT / "demo" / "model" / "demo-q8_0.gguf"


def assembled_q2_k(source: Path, out: Path) -> Path:
    """The source with every routed expert tensor quantized to Q2_K (plain rounding)."""
    from gguf import GGMLQuantizationType

    from moeheal.kernels import encode
    from moeheal.pipeline.gguf.model import GGUFModel
    from moeheal.pipeline.gguf.writer import copy_gguf

    model = GGUFModel(source)
    replace = {}
    for name in model.tensor_names:
        if name.endswith("_exps.weight"):
            replace[name] = (encode.quantize_experts(model.device_tensor(name), "q2_k"), GGMLQuantizationType.Q2_K)
    copy_gguf(model, out, replace)
    return out


def bench_model(reference_path: Path, assembled_path: Path, batch: int, seq: int, reps: int, topk: int,
                trace: Path | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from moeheal.kernels.e2e import top_k_distribution
    from moeheal.pipeline.gguf.model import GGUFModel
    from moeheal.pipeline.model.runner import Runner
    from moeheal.pipeline.model.tuner import Tuner
    from moeheal.pipeline.stages.e2e import E2EParams, adam_by_layer, learning_rates

    # CPU seconds on a CPU backend (a shared machine's wall clock counts other work), else wall seconds
    clock = time.process_time if jax.default_backend() == "cpu" else time.perf_counter
    timed = lambda fn: best_of(fn, reps, clock)  # noqa: E731
    reference, assembled = GGUFModel(reference_path), GGUFModel(assembled_path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, reference.hp.vocab_size, (batch, seq)).astype(np.int32)  # (B, T)
    runner = Runner(reference)
    logits = runner.forward(tokens)  # (B, T, V), compiles
    k = min(topk, reference.hp.vocab_size)
    ids, logp, log_rest = (np.asarray(a) for a in top_k_distribution(jax.nn.log_softmax(jnp.asarray(logits), -1), k))
    plain = timed(lambda: runner.forward(tokens))
    del runner, logits
    tuner = Tuner(assembled, reference)
    data = (tokens, ids, logp, log_rest, np.ones((batch, seq), np.float32))
    lr = learning_rates(tuner.theta0, E2EParams("bench", 1, 1e-3, 1e-3, seq))

    def step() -> None:
        _, grad = tuner.step(tuner.theta0, data)
        jax.block_until_ready(adam_by_layer(tuner.theta0, grad, {}, lr))  # the step is done

    def kl() -> None:
        tuner.mean_kl(tuner.theta0, data)

    start = clock()
    step()
    first = clock() - start
    kl()
    n = batch * seq
    row = {"layers": reference.hp.n_layer, "d_model": reference.hp.d_model, "vocab": reference.hp.vocab_size,
           "tokens": n, "topk": k, "backend": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
           "clock": clock.__name__, "first_step_s": first, "step_s": timed(step), "kl_s": timed(kl),
           "plain_forward_s": plain,
           "tuned_params": sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tuner.theta0))}
    row["step_ms_per_token"] = 1e3 * row["step_s"] / n
    row["step_vs_plain_forward"] = row["step_s"] / plain
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    if trace is not None:  # after the figures: a traced call is slower
        texts = []
        for label, fn in (("step", step), ("KL pass", kl)):
            with traced(trace / f"{row['layers']}l-{label.split()[0].lower()}", f"{row['layers']} layers, {label}") as s:
                fn()
            texts.append(s.text)
        (trace / f"{row['layers']}l-summary.md").write_text("\n\n".join(texts) + "\n")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", help="bench `moeheal synth --like LIKE` files of this real model's shapes")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="with --like: their layer counts")
    parser.add_argument("--gguf", type=Path, default=DEMO_GGUF, help="bench this GGUF (without --like)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=E2E_TOPK, help="the reference's tokens kept per position")
    parser.add_argument("--jobs", type=int, default=8, help="synth's worker processes")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeheal-bench-e2e"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", type=Path, default=None,
                        help="also trace one step and one KL pass per model with jax.profiler into this folder and "
                             "print the summaries (bench/tools/device_trace.py)")
    parser.add_argument("--json-line", action="store_true", help="print the row only (a run of several models)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.like:
        sources = [args.gguf]
    else:
        from moeheal.pipeline.sources.synth import write_synth

        sources = []
        for n in args.layers:
            path = args.work / f"{args.like}-{n}l.gguf"
            if not path.exists():
                write_synth(path, args.like, n_layer=n, jobs=args.jobs)
            sources.append(path)
    for source in sources:
        if len(sources) == 1:
            assembled = assembled_q2_k(source, args.work / f"{source.stem}-q2_k.gguf")
            rows.append(bench_model(source, assembled, args.batch, args.seq, args.reps, args.topk, args.trace))
        else:  # each in a process of its own: its own peak memory
            one = [sys.executable, __file__, "--gguf", str(source), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--reps", str(args.reps), "--topk", str(args.topk), "--work", str(args.work), "--json-line",
                   *(["--trace", str(args.trace)] if args.trace else [])]
            out = subprocess.run(one, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json_line:
        return
    for summary in sorted(args.trace.glob("*l-summary.md")) if args.trace else []:
        print("\n" + summary.read_text(), flush=True)
    print("| layers | d | vocab | tokens | backend | step s | ms/token | KL pass s | plain forward s | step / forward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['d_model']} | {r['vocab']} | {r['tokens']} | {r['backend']} | {r['step_s']:.3f} | "
              f"{r['step_ms_per_token']:.3f} | {r['kl_s']:.3f} | {r['plain_forward_s']:.3f} | "
              f"{r['step_vs_plain_forward']:.1f}x |")
    if len(rows) == 2 and rows[1]["layers"] > rows[0]["layers"]:
        from moeheal.pipeline.sources.synth import LIKE

        a, b = rows
        per_layer = (b["step_s"] - a["step_s"]) / (b["layers"] - a["layers"])
        fixed = a["step_s"] - a["layers"] * per_layer
        n_layer = LIKE[args.like].hp.n_layer
        whole = fixed + n_layer * per_layer
        print(f"per layer {1e3 * per_layer / a['tokens']:.3f} ms/token, fixed {1e3 * fixed / a['tokens']:.3f} ms/token; "
              f"extrapolated to {n_layer} layers: {1e3 * whole / a['tokens']:.2f} ms per calibration token per step")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
