"""The whole pipeline on a real-shape synthetic model: `moeheal heal`, stage by stage, timed.

    python bench/speed/bench_real_size.py                  # 1 layer, 8 of the real experts, 8,192 tokens of vocabulary:
                                                           # minutes on a 2-core CPU
    python bench/speed/bench_real_size.py --like qwen3-30b-a3b --layers 24 --experts 128 --vocab 151936 \
        --tokens 2048 --no-eval --variants gptq_iq2_xxs   # the real model's shapes, 24 of its layers (a GPU)

Writes `moeheal synth --like ... --layers N` (random, nearly Gaussian weights with the
real tensor shapes: figures for time and memory, never for quality; `--experts` and `--vocab`
shrink the expert count and the vocabulary, never a matrix's width), a config
over the demo's corpus, split and a few of its windows (the synthetic vocabulary starts
with the demo's, so the demo text tokenizes the same), and runs every stage:
corpus, traces, dumps of the calibration and unseen traces, quantize and
calibrate per (variant, layer), assembly, reference logits, evaluation,
comparisons. One variant by default, `ls_q2_k` (Q2_K, importance, least
squares, alpha and ridge); `--variants` picks among it, `gptq_iq2_xxs`
(IQ2_XXS, importance, GPTQ, alpha and ridge; ridge only where the model has a
shared expert) and `ls_tq2_0` (TQ2_0, importance, least squares, alpha and
ridge), the cheapest healed one. `--shards N` first runs N `moeheal heal --shard i/N`
workers at once on the lake (worker i on GPU i mod the GPU count), as a
machine with several GPUs runs a real model; the in-process heal then finds
every unit cached, and the figures add the workers' phase (its wall time,
each worker's, the stages each built).

Printed: each stage invocation's wall time (from its start to the next
stage's start, so a unit's reading of its inputs is in it), the sums per
stage kind, per layer for the per-layer units, the same scaled to the real
model's layer count (labelled as extrapolated: the units of different layers
do the same work on the same shapes), the process's peak host memory
(ru_maxrss), the peaks of its anonymous and file-backed resident memory while
healing (what it allocates, and the read pages of the memory-mapped GGUF and
dumps, which ru_maxrss also counts), and the device's peak memory (JAX's
`peak_bytes_in_use`, where the backend reports it). The baseline in the same run is the synth step
(writing the model), so the ratios say how heal time compares with the cost
of merely producing the file.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

from moeheal.pipeline.config import load_config
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.sources.synth import LIKE, write_synth

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeheal.pipeline.data.documents import read_documents, read_split  # noqa: E402
from moeheal.pipeline.llamacpp import document_kld, run_perplexity  # noqa: E402
from moeheal.pipeline.llamacpp import perplexity_binary  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "demo"
STAGE_LINE = re.compile(r"^\[(?P<label>[^\]]+)\] (?P<what>computing|cache hit) ")


def write_windows(work: Path, per_stratum: int) -> Path:
    """The demo's first `per_stratum` eval windows and first canary window of every stratum: a real
    vocabulary's logits make each window costly, and timing needs few."""
    with open(DEMO / "windows.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    kept, seen = [], defaultdict(int)
    for row in rows:
        key = (row["stratum"], row["set"])
        if seen[key] < (per_stratum if row["set"] == "eval" else 1):
            seen[key] += 1
            kept.append(row)
    path = work / "windows.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(kept)
    return path


# The healed variants this bench can run, as config tables.
VARIANTS = {
    "ls_tq2_0": '[[variant]]\nname = "ls_tq2_0"\nquant = "tq2_0"\nround = "ls"\n',
    "ls_q2_k": '[[variant]]\nname = "ls_q2_k"\nquant = "q2_k"\nround = "ls"\n',
    "gptq_iq2_xxs": '[[variant]]\nname = "gptq_iq2_xxs"\nquant = "iq2_xxs"\nround = "gptq"\n',
    "gptq_q2_k": '[[variant]]\nname = "gptq_q2_k"\nquant = "q2_k"\nround = "gptq"\n',
    # the levers of calibration that scales, each beside GPTQ's unit: healed inputs, learned rounding (its
    # default schedule, one pass over the rows; weighted by the reference's Fisher information, which adds
    # the guidance stage), both, and end-to-end tuning on top
    "healed_gptq_q2_k": '[[variant]]\nname = "healed_gptq_q2_k"\nquant = "q2_k"\nround = "gptq"\ninputs = "healed"\n',
    "learned_q2_k": '[[variant]]\nname = "learned_q2_k"\nquant = "q2_k"\nround = "learned"\n',
    "learned_fisher_q2_k": ('[[variant]]\nname = "learned_fisher_q2_k"\nquant = "q2_k"\nround = "learned"\n'
                            'learned_loss = "fisher"\n'),
    "healed_learned_q2_k": ('[[variant]]\nname = "healed_learned_q2_k"\nquant = "q2_k"\nround = "learned"\n'
                            'inputs = "healed"\n'),
    "healed_learned_e2e_q2_k": ('[[variant]]\nname = "healed_learned_e2e_q2_k"\nquant = "q2_k"\nround = "learned"\n'
                                'inputs = "healed"\ne2e = true\n'),
    # a budget under 2.1 bits: the sensitivity stage (every candidate format of every routed tensor, priced by
    # the guidance stage of the unseen trace) and the allocation before GPTQ's units
    "budget_2p1": ('[[variant]]\nname = "budget_2p1"\nbudget_bpw = 2.1\n'
                   'formats = ["iq1_m", "iq2_xxs", "iq2_xs", "iq2_s"]\nsensitivity_round = "ls"\nround = "gptq"\n'),
}


def write_config(work: Path, model: Path, tokens: int, windows: Path, variants: list[str]) -> Path:
    """A heal.toml over the synthetic model and the demo's corpus and split, healing `variants`."""
    config = work / "heal.toml"
    config.write_text(f"""
[lake]
root = "lake"
[model]
reference = "{model}"
[corpus]
docs = "{DEMO / 'docs.jsonl'}"
split = "{DEMO / 'split.csv'}"
[calibration]
tokens = {tokens}
seq_tokens = 512
mix = {{ ops = 0.3, chat_json = 0.3, ja = 0.2, persona = 0.2 }}
unseen_tokens = {max(512, tokens // 4)}
seed = 0
[eval]
windows = "{windows}"
ngram = 16
bootstrap = 200
seed = 0
{"".join(VARIANTS[name] for name in variants)}[moce]
bonus = [0.0]
cache_experts = 8
""")
    return config


def run_shard_workers(config: Path, shards: int) -> dict[str, object]:
    """`moeheal heal --shard i/N` for i < N, all at once on the config's lake, worker i on GPU i mod
    the GPU count (`CUDA_VISIBLE_DEVICES`) where there are GPUs: the phase's wall time, each worker's
    own time and the units it built (its `computing` lines)."""
    gpus = len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0
    start = time.perf_counter()
    workers = []
    for i in range(shards):
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else {})}
        workers.append((time.perf_counter(), subprocess.Popen(
            [sys.executable, "-m", "moeheal", "heal", "-c", str(config), "--shard", f"{i}/{shards}"],
            stdout=subprocess.PIPE, text=True, env=env)))

    def finish(began: float, worker: subprocess.Popen) -> tuple[float, int]:
        out, _ = worker.communicate()
        if worker.returncode != 0:
            raise SystemExit(f"shard worker exited {worker.returncode}")
        return time.perf_counter() - began, sum(" computing " in line for line in out.splitlines()
                                                 if STAGE_LINE.match(line))

    with ThreadPoolExecutor(shards) as pool:  # each worker's own end, whichever finishes first
        done = list(pool.map(lambda pair: finish(*pair), workers))
    return {"shards": shards, "gpus_used": min(gpus, shards), "shard_phase_s": time.perf_counter() - start,
            "shard_worker_s": [seconds for seconds, _ in done], "shard_stages_built": [n for _, n in done]}


class StageClock:
    """A log that stamps every line; a stage's time runs from its `computing` line to the next stage's line."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        self.lines.append((now, message))
        print(f"{now - self.start:9.1f} s  {message}", flush=True)  # stamped: a run stopped early still has its times

    def durations(self, end: float) -> list[tuple[str, float]]:
        """(label, seconds) of every stage computed: to the next stage's line, past its own log lines."""
        stages = [(t, STAGE_LINE.match(message)) for t, message in self.lines if STAGE_LINE.match(message)]
        return [(match.group("label"), (stages[i + 1][0] if i + 1 < len(stages) else end) - start)
                for i, (start, match) in enumerate(stages) if match.group("what") == "computing"]


class HostMemory:
    """Peaks of the process's anonymous and file-backed resident memory while running (Linux
    /proc/self/status RssAnon and RssFile, sampled every `period` seconds by a thread).

    ru_maxrss counts both: the pages of a memory-mapped GGUF that a unit has read stay resident
    (and counted) until the kernel needs them back, so it grows with the layers read even when
    what the process allocates does not. RssAnon is what it allocates.
    """

    def __init__(self, period: float = 0.1):
        self.period, self.peaks = period, {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        if key in self.peaks:
                            self.peaks[key] = max(self.peaks[key], int(value.split()[0]) * 1024)
            except OSError:  # not Linux: no figures
                return
            self._stop.wait(self.period)

    def __enter__(self) -> "HostMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def device_peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def llama_cpp_kld(source: Path, healed: dict[str, Path], work: Path) -> dict[str, list[float]]:
    """llama.cpp's own run of every healed GGUF: {variant: [KLD, same top-1 %]} against the source on
    one chunk of the demo's longest held-out document (random weights: proof that llama.cpp loads
    and runs the file, not a quality figure)."""
    binary = perplexity_binary()
    if binary is None:
        raise SystemExit("--llama-kld: $LLAMA_CPP_DIR/bin/llama-perplexity not found")
    eval_ids = {doc_id for doc_id, role in read_split(DEMO / "split.csv") if role == "eval"}
    longest = max((d["text"] for d in read_documents(DEMO / "docs.jsonl") if d["doc_id"] in eval_ids), key=len)
    text = work / "held_out.txt"
    text.write_text(longest, encoding="utf-8")
    base = work / "source.kld"
    run_perplexity(binary, str(source), text, base, kld=False)
    return {name: [kld, 100 * top] for name, (kld, top) in
            ((name, document_kld(binary, str(path), text, base)) for name, path in healed.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", default="qwen3-30b-a3b", choices=sorted(LIKE))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=512, help="calibration tokens")
    parser.add_argument("--experts", type=int, default=8,
                        help="routed experts per layer (default 8 for a CPU; the real model's count, e.g. 128, on a GPU)")
    parser.add_argument("--windows", type=int, default=1, help="eval windows per stratum (and one canary)")
    parser.add_argument("--no-eval", action="store_true", help="stop at the healed GGUFs (no logits)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["ls_q2_k"],
                        help="which variants to heal (default ls_q2_k; the unhealed baseline always runs)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="synth's worker processes")
    parser.add_argument("--vocab", type=int, default=8192,
                        help="vocabulary size (default 8192 for a CPU; the real model's, e.g. 151936, on a GPU)")
    parser.add_argument("--llama-kld", action="store_true",
                        help="also have llama.cpp ($LLAMA_CPP_DIR) run every healed GGUF: its KLD against the "
                             "synthetic source on 2 chunks of the demo's held-out text")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeheal-real-size"))
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--shards", type=int, default=0, metavar="N",
                        help="first build the per-layer units with N `heal --shard` workers at once (one per GPU "
                             "where there are GPUs); the timed heal then finds them cached")
    args = parser.parse_args()
    like = LIKE[args.like]
    args.work.mkdir(parents=True, exist_ok=True)
    shrunk = (f"-{args.experts}e" if args.experts else "") + (f"-{args.vocab}v" if args.vocab else "")
    model = args.work / f"{args.like}-{args.layers}l{shrunk}.gguf"
    start = time.perf_counter()
    synth = write_synth(model, args.like, n_layer=args.layers, n_expert=args.experts, vocab_size=args.vocab,
                        jobs=args.jobs) if not model.exists() else None
    synth_s = time.perf_counter() - start
    clock = StageClock()
    start = time.perf_counter()
    config = write_config(args.work, model, args.tokens, write_windows(args.work, args.windows), args.variants)
    run = HealRun(load_config(config), log=clock)
    sharded = run_shard_workers(config, args.shards) if args.shards else {}
    with HostMemory() as host:
        if args.no_eval:  # up to the healed GGUFs: a real vocabulary makes every evaluated window costly
            run.overlap()
        else:
            run.heal()
        healed = {variant.name: run.final_model(variant)[1] for variant in run.all_quantized_variants()}
    end = time.perf_counter()
    heal_s = end - start

    per_kind: dict[str, float] = defaultdict(float)
    per_layer: dict[str, list[float]] = defaultdict(list)
    for label, seconds in clock.durations(end):
        parts = label.split(":")
        layered = len(parts) > 2 and parts[-1].isdigit()  # quantize:<variant>:<layer>, not reference-topk:k:unseen
        kind = ":".join(parts[:-1]) if layered else parts[0]  # quantize:<variant> over its layers
        per_kind[kind] += seconds
        if layered:
            per_layer[kind].append(seconds)
    figures = {
        "like": args.like, "layers": args.layers, "real_layers": like.hp.n_layer, "calibration_tokens": args.tokens,
        "device": str(jax.devices()[0]), "synth_s": synth_s if synth is not None else None, "heal_s": heal_s,
        "per_stage_s": dict(per_kind),
        "per_layer_s": {k: sum(v) / len(v) for k, v in per_layer.items()},
        "extrapolated_whole_model_s": {k: sum(v) / len(v) * like.hp.n_layer for k, v in per_layer.items()},
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "heal_peak_anon_bytes": host.peaks["RssAnon"] or None,  # allocated by the process while healing
        "heal_peak_file_bytes": host.peaks["RssFile"] or None,  # memory-mapped files' resident pages
        "device_peak_bytes": device_peak_bytes(),
        **sharded,
    }
    if args.llama_kld:
        figures["llama_cpp_kld"] = llama_cpp_kld(model, healed, args.work)
    print(json.dumps(figures, indent=1))
    if figures["synth_s"]:
        print(f"heal / synth wall time: {heal_s / synth_s:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
