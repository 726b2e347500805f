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
workers at once on the lake, what `moeheal heal --workers N` runs (worker i on
GPU i mod the GPU count where there are several; on one GPU they share it, one
reading and packing while another computes); the in-process heal then finds
every unit cached, and the figures add the workers' phase (its wall time,
each worker's, the stages each built; the GPU's samples and nvidia-smi's peak
span it, JAX's peak and the host's are this process's only).

Printed: each stage invocation's wall time (from its start to the next
stage's start, so a unit's reading of its inputs is in it), the sums per
stage kind, per layer for the per-layer units, the same scaled to the real
model's layer count (labelled as extrapolated: the units of different layers
do the same work on the same shapes), the process's peak host memory
(ru_maxrss), the peaks of its anonymous and file-backed resident memory while
healing (what it allocates, and the read pages of the memory-mapped GGUF and
dumps, which ru_maxrss also counts), and the device's peak memory (JAX's
`peak_bytes_in_use`, where the backend reports it). XLA's compilation is counted apart
(`compile_s`, `programs_compiled`), and so are the programs the heal found in moeheal's persistent
compilation cache (`compile_cache_hits`: a new cache folder per run unless `$MOEHEAL_XLA_CACHE` names
one: a first heal's figures; `compile_s` includes their loading). The baseline in the same run is the synth step
(writing the model), so the ratios say how heal time compares with the cost
of merely producing the file.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import json
import os
import pstats
import re
import resource
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import jax

from moeheal.pipeline.commands.init import UNSEEN_TOKENS
from moeheal.pipeline.commands.workers import run_shard_workers
from moeheal.pipeline.config import load_config
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.compile_cache import CACHE_ENV, prepare_compilation
from moeheal.pipeline.sources.synth import LIKE, write_synth

sys.path.append(str(Path(__file__).resolve().parents[2]))

from moeheal.pipeline.data.documents import read_documents, read_split  # noqa: E402
from moeheal.pipeline.llamacpp import document_kld, run_perplexity  # noqa: E402
from moeheal.pipeline.llamacpp import perplexity_binary  # noqa: E402
from bench.tools.device_sampler import BUSY_UTIL, DeviceSampler  # noqa: E402
from bench.tools.device_trace import summarise  # noqa: E402
from bench.tools.real_size_record import stage_kind  # noqa: E402
from bench.tools.unit_phases import PHASE_ITEM, PHASE_LINE  # noqa: E402

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
    # the ladder's best files: uniform Q2_K with learned rounding + e2e, and the KL-priced recipe within Q2_K's
    # size with the same levers (`moeheal init`'s budget recipe: its formats, its sensitivity and allocation)
    "learned_e2e_q2_k": '[[variant]]\nname = "learned_e2e_q2_k"\nquant = "q2_k"\nround = "learned"\ne2e = true\n',
    "recipe_learned_e2e": ('[[variant]]\nname = "recipe_learned_e2e"\nbudget_bpw = 2.6\n'
                           'formats = ["iq2_xxs", "iq2_xs", "iq2_s", "q2_k", "iq3_xxs"]\nsensitivity_round = "ls"\n'
                           'round = "learned"\ne2e = true\n'),
    # a budget under 2.1 bits: the sensitivity stage (every candidate format of every routed tensor, priced by
    # the guidance stage of the unseen trace) and the allocation before GPTQ's units
    "budget_2p1": ('[[variant]]\nname = "budget_2p1"\nbudget_bpw = 2.1\n'
                   'formats = ["iq1_m", "iq2_xxs", "iq2_xs", "iq2_s"]\nsensitivity_round = "ls"\nround = "gptq"\n'),
}


def variant_tables(variants: list[str], e2e_batch_seqs: int) -> str:
    """The config tables of `variants`, each e2e variant with `e2e_batch_seqs` sequences per step."""
    extra = f"e2e_batch_seqs = {e2e_batch_seqs}\n" if e2e_batch_seqs != 1 else ""
    return "".join(VARIANTS[name] + (extra if "e2e = true" in VARIANTS[name] else "") for name in variants)


def write_config(work: Path, model: Path, tokens: int, windows: Path, variants: list[str],
                 unseen_tokens: int = UNSEEN_TOKENS, e2e_batch_seqs: int = 1) -> Path:
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
unseen_tokens = {unseen_tokens}
seed = 0
[eval]
windows = "{windows}"
ngram = 16
bootstrap = 200
seed = 0
{variant_tables(variants, e2e_batch_seqs)}[moce]
bonus = [0.0]
cache_experts = 8
""")
    return config


def run_shards(config: Path, shards: int) -> dict[str, object]:
    """`moeheal heal --shard i/N` for i < N, all at once on the config's lake (`commands.workers`, what
    `heal --workers N` runs), worker i on GPU i mod the GPU count where there are several: the phase's
    wall time, each worker's own time and the units it built (its `computing` lines)."""
    gpus = len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0
    start = time.perf_counter()
    runs = run_shard_workers(config, shards, devices=gpus if gpus > 1 else 0, echo=lambda line: None)
    if any(run.returncode for run in runs):
        raise SystemExit(f"shard worker exited {[run.returncode for run in runs]}: "
                         + "\n".join(line for run in runs for line in run.lines[-5:]))
    return {"shards": shards, "gpus_used": min(gpus, shards), "shard_phase_s": time.perf_counter() - start,
            "shard_worker_s": [run.seconds for run in runs],
            "shard_stages_built": [sum(" computing " in line for line in run.lines if STAGE_LINE.match(line))
                                   for run in runs]}


def needed_kinds(run: HealRun, variant, names: list[str]) -> list[str]:
    """The stage kinds a variant's GGUF is built from: its final stage and everything upstream of it in the
    heal's DAG (a recipe's guidance and sensitivity; every variant's dumps), so a record sums its heal alone."""
    seen, todo = set(), [run.model_use(variant).node]
    while todo:
        node = todo.pop()
        if node.label not in seen:
            seen.add(node.label)
            todo.extend(node.upstream_nodes())
    return sorted({stage_kind(label, names) for label in seen})


class StageClock:
    """A log that stamps every line (wall and process CPU time); a stage's time runs from its `computing`
    line to the next stage's line. With `trace` (a stage's label and a folder), that one stage runs under
    `jax.profiler`, from its `computing` line to the next stage's line, and its summary
    (`bench/tools/device_trace.py`) is written to `<folder>/summary.txt`."""

    def __init__(self, trace: tuple[str, Path] | None = None) -> None:
        self.lines: list[tuple[float, float, str]] = []
        self.start = time.perf_counter()
        self.trace, self._traced_since = trace, None

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        stage = STAGE_LINE.match(message)
        if stage and self._traced_since is not None:
            self._stop_trace(now)
        self.lines.append((now, time.process_time(), message))
        print(f"{now - self.start:9.1f} s  {message}", flush=True)  # stamped: a run stopped early still has its times
        if stage and self.trace and stage.group("label") == self.trace[0] and stage.group("what") == "computing":
            self.trace[1].mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.trace[1]), create_perfetto_trace=True)
            self._traced_since = time.perf_counter()

    def _stop_trace(self, now: float) -> None:
        jax.effects_barrier()
        jax.profiler.stop_trace()
        label, folder = self.trace
        made = sorted(folder.rglob("perfetto_trace.json.gz"))
        text = summarise(made[-1], now - self._traced_since, label).text if made else f"{label}: no trace written"
        (folder / "summary.txt").write_text(text + "\n", encoding="utf-8")
        print(text, flush=True)
        self._traced_since = None

    def intervals(self, end: float) -> list[tuple[str, float, float, float]]:
        """(label, start, end, CPU seconds) of every stage computed: to the next stage's line, past its own
        log lines."""
        stages = [(t, cpu, STAGE_LINE.match(message)) for t, cpu, message in self.lines if STAGE_LINE.match(message)]
        end_cpu = time.process_time()
        return [(match.group("label"), start, stages[i + 1][0] if i + 1 < len(stages) else end,
                 (stages[i + 1][1] if i + 1 < len(stages) else end_cpu) - cpu)
                for i, (start, cpu, match) in enumerate(stages) if match.group("what") == "computing"]

    def unit_phases(self) -> dict[str, dict[str, float]]:
        """Seconds per step of the layer units, summed over layers, by the unit's stage kind
        (`quantize:<variant>`): the one line each quantize and calibrate unit, and each layer of a
        sensitivity stage, logs (`progress.Phases`), which names its layer but not its variant, so it goes
        to the stage computing when it was logged."""
        phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        kind = None
        for _, _, message in self.lines:
            if (stage := STAGE_LINE.match(message)) and stage.group("what") == "computing":
                label = stage.group("label")  # a per-layer unit's ends in its layer: quantize:<variant>:3
                kind = label.rsplit(":", 1)[0] if label.rsplit(":", 1)[-1].isdigit() else label
            elif (unit := PHASE_LINE.match(message)) and kind is not None:
                for name, seconds in PHASE_ITEM.findall(unit.group("phases")):
                    phases[kind][name] += float(seconds)
        return {k: dict(v) for k, v in phases.items()}


class CompileClock:
    """XLA compilation seconds, stamped when each ends (JAX's `backend_compile` duration events): the
    share of a stage's wall time spent compiling programs rather than running them."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float]] = []
        self.cache_hits = 0  # programs loaded from the persistent compilation cache instead
        jax.monitoring.register_event_duration_secs_listener(self._record)
        jax.monitoring.register_event_listener(self._count)

    def _record(self, event: str, duration: float, **_: object) -> None:
        if event.endswith("backend_compile_duration"):
            self.events.append((time.perf_counter(), duration))

    def _count(self, event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def within(self, start: float, end: float) -> float:
        return sum(d for t, d in self.events if start < t <= end)


def stage_split(label: str, start: float, end: float, cpu: float, compiles: CompileClock,
                device: DeviceSampler) -> dict[str, float]:
    """Where one stage's wall time went: compilation (XLA's own clock); device busy (nvidia-smi's
    utilisation, where sampled); host CPU seconds of the process's threads less compilation (Python, NumPy,
    Zarr decoding, dispatch; several threads can make it exceed the wall time); and the wall time that is
    neither device-busy nor compiling, an upper bound on the time the device waited for the host
    (transfers, reads, Python between programs). With samples, also their counts (`busy_samples` above
    `BUSY_UTIL`%, `samples`), which the real-size record extrapolates to the real depth."""
    wall, compile_s = end - start, compiles.within(start, end)
    if not device.samples:
        return {"wall_s": wall, "compile_s": compile_s, "host_cpu_s": max(0.0, cpu - compile_s)}
    busy = device.busy_seconds(start, end)
    busy_samples, samples = device.busy_samples(start, end)
    return {"wall_s": wall, "compile_s": compile_s, "host_cpu_s": max(0.0, cpu - compile_s), "device_busy_s": busy,
            "device_idle_s": max(0.0, wall - busy - compile_s), "busy_samples": busy_samples, "samples": samples}


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


def write_profile(profiler: cProfile.Profile, out: Path, rows: int = 80) -> None:
    """The profile's `rows` busiest functions by own time, then by cumulative time, as pstats prints them."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(rows)
    out.write_text(text.getvalue(), encoding="utf-8")


def stop_run(*_: object) -> None:
    """SIGTERM as an interrupt, so a run stopped by its time limit still prints the stages it finished
    (labelled `stopped`; the stage in progress is then counted to the stop)."""
    raise KeyboardInterrupt


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
    parser.add_argument("--unseen-tokens", type=int, default=UNSEEN_TOKENS,
                        help=f"the unseen trace's tokens (default {UNSEEN_TOKENS}, what `moeheal init` writes)")
    parser.add_argument("--e2e-batch-seqs", type=int, default=1,
                        help="calibration sequences per e2e step of the e2e variants (their `e2e_batch_seqs`)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeheal-real-size"))
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--profile", type=Path, metavar="TXT",
                        help="run the heal under cProfile and write its busiest functions here (by own time and "
                             "by cumulative time): where the host's time goes; the profiler slows Python, so a "
                             "profiled run's timings are not figures")
    parser.add_argument("--trace", nargs=2, metavar=("STAGE", "DIR"),
                        help="run the stage labelled STAGE (as the log names it, e.g. quantize:learned_e2e_q2_k:2) "
                             "under jax.profiler into DIR and print the trace's summary (DIR/summary.txt): where "
                             "its device and host time go; the profiler slows the stage, so its timings are not figures")
    parser.add_argument("--shards", type=int, default=0, metavar="N",
                        help="first build the per-layer units with N `heal --shard` workers at once (one per GPU "
                             "where there are GPUs); the timed heal then finds them cached")
    args = parser.parse_args()
    # as `moeheal heal` does, before anything compiles; in a new folder unless $MOEHEAL_XLA_CACHE names one
    # (empty: off), so the figures are a first heal's: programs compiled again within it are the only hits
    os.environ.setdefault(CACHE_ENV, tempfile.mkdtemp(prefix="moeheal-xla-"))
    cache = prepare_compilation()
    like = LIKE[args.like]
    args.work.mkdir(parents=True, exist_ok=True)
    shrunk = (f"-{args.experts}e" if args.experts else "") + (f"-{args.vocab}v" if args.vocab else "")
    model = args.work / f"{args.like}-{args.layers}l{shrunk}.gguf"
    start = time.perf_counter()
    synth = write_synth(model, args.like, n_layer=args.layers, n_expert=args.experts, vocab_size=args.vocab,
                        jobs=args.jobs) if not model.exists() else None
    synth_s = time.perf_counter() - start
    clock, compiles = StageClock((args.trace[0], Path(args.trace[1])) if args.trace else None), CompileClock()
    start = time.perf_counter()
    config = write_config(args.work, model, args.tokens, write_windows(args.work, args.windows), args.variants,
                          args.unseen_tokens, args.e2e_batch_seqs)
    run = HealRun(load_config(config), log=clock)
    signal.signal(signal.SIGTERM, stop_run)  # `timeout`'s signal: the stages finished so far are still reported
    stopped, healed, sharded = False, {}, {}
    profiler = cProfile.Profile() if args.profile else None
    with HostMemory() as host, DeviceSampler() as device:  # the GPU's samples span the workers' phase too
        try:
            if args.shards:
                sharded = run_shards(config, args.shards)
            if profiler is not None:
                profiler.enable()
            if args.no_eval:  # up to the healed GGUFs: a real vocabulary makes every evaluated window costly
                run.overlap()
            else:
                run.heal()
            healed = {variant.name: run.final_model(variant)[1] for variant in run.all_quantized_variants()}
        except KeyboardInterrupt:
            stopped = True
        finally:
            if profiler is not None:
                profiler.disable()
    end = time.perf_counter()
    if profiler is not None:
        write_profile(profiler, args.profile)
    heal_s = end - start

    names = [variant.name for variant in run.all_quantized_variants()]  # the baseline's too
    per_kind: dict[str, float] = defaultdict(float)
    per_layer: dict[str, list[float]] = defaultdict(list)
    split: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for label, began, ended, cpu in clock.intervals(end):
        seconds = ended - began
        parts = label.split(":")
        layered = len(parts) > 2 and parts[-1].isdigit()  # quantize:<variant>:<layer>, not reference-topk:k:unseen
        kind = stage_kind(label, names)  # quantize:<variant> over its layers, e2e:<variant>, dump
        per_kind[kind] += seconds
        for key, value in stage_split(label, began, ended, cpu, compiles, device).items():
            split[kind][key] += value
        if layered:
            per_layer[kind].append(seconds)
    heal_samples = device.within(start, end)
    figures = {
        "like": args.like, "layers": args.layers, "real_layers": like.hp.n_layer, "calibration_tokens": args.tokens,
        "stopped": stopped, "unseen_tokens": args.unseen_tokens, "e2e_batch_seqs": args.e2e_batch_seqs, "variants": args.variants,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
        "synth_s": synth_s if synth is not None else None, "heal_s": heal_s,
        "per_stage_s": dict(per_kind),
        "per_stage_split": {k: dict(v) for k, v in split.items()},
        "needs": {variant.name: needed_kinds(run, variant, names) for variant in run.all_quantized_variants()},
        "compile_s": compiles.within(start, end),
        # JAX's compile event spans a cache hit's load too: programs compiled are the events less the hits
        "programs_compiled": sum(start < t <= end for t, _ in compiles.events) - compiles.cache_hits,
        "compile_cache_hits": compiles.cache_hits,
        "compile_cache": str(cache) if cache else None,
        "unit_phases_s": clock.unit_phases(),
        "per_layer_s": {k: sum(v) / len(v) for k, v in per_layer.items()},
        "extrapolated_whole_model_s": {k: sum(v) / len(v) * like.hp.n_layer for k, v in per_layer.items()},
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "heal_peak_anon_bytes": host.peaks["RssAnon"] or None,  # allocated by the process while healing
        "heal_peak_file_bytes": host.peaks["RssFile"] or None,  # memory-mapped files' resident pages
        "device_peak_bytes": device_peak_bytes(),
        # nvidia-smi over the heal: its memory peak (the process's whole footprint, the CUDA context included),
        # the mean utilisation and the share of 1-second samples above 50%
        **({"nvidia_smi_peak_mib": max(m for _, _, m in heal_samples),
            "gpu_util_mean": sum(u for _, u, _ in heal_samples) / len(heal_samples),
            "gpu_busy_fraction": sum(u > BUSY_UTIL for _, u, _ in heal_samples) / len(heal_samples)}
           if heal_samples else {}),
        **sharded,
    }
    if args.llama_kld and not stopped:
        figures["llama_cpp_kld"] = llama_cpp_kld(model, healed, args.work)
    print(json.dumps(figures, indent=1))
    if figures["synth_s"]:
        print(f"heal / synth wall time: {heal_s / synth_s:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
