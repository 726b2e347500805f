"""The dump's host path per layer at a real width: the old sequential writer against `dump_trace`.

On a GPU the dump stage waited on the host: per layer of the Qwen3-30B-A3B shape at 65,536 + 8,192
tokens, 8.8 s of wall time of which the device was busy 0.85 s. This times only the host's part, on
this machine: one real forward pass (4 sequences of 512 tokens) of a one-layer synthetic model of the
chosen shape (`moeheal synth`, 16 experts: the stored arrays do not depend on the count) is captured
once and replayed for every pass of the trace, so the forward costs nothing but an optional sleep of
`--device-ms` per pass and layer standing in for a device pass (sleeping, like waiting on a device,
leaves the host's other thread free). Each repeat runs the old path
(`bench/inputs/dump_reference.py`: every copy, check and write between passes, on the caller's
thread) and the new one in turn, into fresh folders, and checks their files are byte-identical.

    python -P bench/speed/bench_dump_host.py [--like qwen3-30b-a3b] [--tokens 65536] [--device-ms 0 24]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))

from bench.inputs.dump_reference import sequential_dump  # noqa: E402
from moeheal.pipeline.data.dumps import dump_trace  # noqa: E402
from moeheal.pipeline.gguf.model import GGUFModel  # noqa: E402
from moeheal.pipeline.model.runner import Runner  # noqa: E402
from moeheal.pipeline.sources.synth import LIKE, write_synth  # noqa: E402

SEQ_TOKENS = 512
PASS_SEQS = 4
PIPELINE_TOKENS = 65536 + 8192  # the default calibration and unseen traces: what one layer of the stage dumps


class ReplayRunner:
    """A runner whose every pass hands over the same captured layers after `device_s` of sleep per
    layer: the host's work without the forward's."""

    def __init__(self, runner: Runner, captures: dict, device_s: float):
        self.hp, self.model, self._captures, self._device_s = runner.hp, runner.model, captures, device_s
        self._layerwise_tokens = runner.layerwise_tokens()

    def forward(self, tokens: np.ndarray, capture: bool, on_layer, logits: bool) -> None:
        for layer, cap in self._captures.items():
            time.sleep(self._device_s)
            on_layer(layer, cap)

    def layerwise_tokens(self) -> int:
        return self._layerwise_tokens

    def forward_layers(self, batches: list[np.ndarray], on_layer, after_layer=None) -> None:
        for layer, cap in self._captures.items():
            for b in range(len(batches)):
                time.sleep(self._device_s)
                on_layer(layer, b, cap)
            if after_layer is not None:
                after_layer(layer)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", choices=sorted(LIKE), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=65536, help="trace tokens per timed dump")
    parser.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 24.0],
                        help="sleep per pass and layer standing in for the device (24: the H100's 0.85 s "
                             "device-busy per layer over the 36 passes of 73,728 tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, help="where the synthetic model is kept (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        gguf = work / f"{args.like}-1l-16e-8192v.gguf"
        if not gguf.exists():
            write_synth(gguf, args.like, n_layer=1, n_expert=16, vocab_size=8192)
        runner = Runner(GGUFModel(gguf))
        captures: dict = {}
        tokens = np.random.default_rng(0).integers(0, runner.hp.vocab_size, args.tokens).astype(np.int32)
        runner.forward(tokens[:PASS_SEQS * SEQ_TOKENS].reshape(PASS_SEQS, SEQ_TOKENS), capture=True,
                       on_layer=lambda layer, cap: captures.setdefault(layer, cap), logits=False)
        seq = (np.arange(args.tokens) // SEQ_TOKENS).astype(np.int32)
        print(f"{args.like}: d_model {runner.hp.d_model}, k {runner.hp.n_expert_used}, {len(captures)} MoE layer, "
              f"{args.tokens} tokens per dump, chunks of {PASS_SEQS * SEQ_TOKENS} tokens, best and median of "
              f"{args.repeats}\n")
        print("| device per pass, ms | path | wall s | CPU s | MB | wall ms/MB | wall per layer at 73,728 tokens, s |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for device_ms in args.device_ms:
            replay = ReplayRunner(runner, captures, device_ms / 1000)
            times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
            size = 0
            for _ in range(args.repeats):
                outs = {}
                for path in ("old", "new"):
                    out = Path(tmp) / f"{path}.zarr"
                    shutil.rmtree(out, ignore_errors=True)
                    wall, cpu = time.perf_counter(), time.process_time()
                    if path == "old":
                        sequential_dump(out, replay, tokens, seq, "calibration", PASS_SEQS * SEQ_TOKENS, SEQ_TOKENS)
                    else:
                        dump_trace(out, replay, tokens, seq, "calibration", PASS_SEQS * SEQ_TOKENS, SEQ_TOKENS,
                                   log=lambda _: None)
                    times[path].append((time.perf_counter() - wall, time.process_time() - cpu))
                    outs[path] = files(out)
                    size = sum(map(len, outs[path].values()))
                if outs["old"] != outs["new"]:
                    raise SystemExit("the new dump's files differ from the old path's")
                for out in outs:
                    shutil.rmtree(Path(tmp) / f"{out}.zarr")
            for path, runs in times.items():
                wall = min(w for w, _ in runs)
                print(f"| {device_ms:g} | {path} | {wall:.2f} (median {statistics.median(w for w, _ in runs):.2f}) | "
                      f"{min(c for _, c in runs):.2f} | {size / 1e6:.0f} | {wall * 1e3 / (size / 1e6):.2f} | "
                      f"{wall * PIPELINE_TOKENS / args.tokens:.2f} |")


if __name__ == "__main__":
    main()
