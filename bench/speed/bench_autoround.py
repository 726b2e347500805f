"""AutoRound's time per layer at a real model's shape, the peer beside `bench_real_size.py`'s heal.

    venv/bin/python bench/speed/bench_autoround.py --layers 2 --json autoround.json      # a GPU
    venv/bin/python bench/speed/bench_autoround.py --small --iters 2 --nsamples 4 --seqlen 64   # a CPU check

It runs in AutoRound's own environment (demo/peers/autoround/requirements.txt, or a GPU machine's torch
and transformers with auto-round beside them), never moeheal's. Steps:

1. A Qwen3-MoE checkpoint of `--layers` layers with the real Qwen3-30B-A3B shapes (128 experts of
   768 x 2048, the 151,936-token vocabulary), random weights from transformers' own initialisation,
   saved in bfloat16 with the demo's tokenizer: time and memory, never quality.
2. The peer's own settings (`make_autoround_peer.py`: `gguf:q2_k_s`, `enable_alg_ext`, `iters` 200,
   attention, router, lm_head and embeddings left alone) on `nsamples` x `seqlen` tokens (default
   128 x 512 = 65,536, what our real-size heal calibrates on) of the demo's cal documents.
3. Timed: AutoRound's whole `quantize()`, and each block from AutoRound's own per-block log line (the
   first block's interval holds the calibration forward that caches its inputs, so the per-layer
   figure is the mean of the later blocks', and the rest is `fixed_s`), extrapolated to 48 layers
   and labelled so. The log is checked: every block tuned every routed expert layer (its loss is
   printed, not required to fall: on random weights the first iterate may stay the best). GPU
   utilisation (nvidia-smi, one sample a second) and torch's peak memory beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "demo" / "peers" / "autoround")]

from bench.tools.device_sampler import BUSY_UTIL, DeviceSampler  # noqa: E402
from make_autoround_peer import IGNORE, TUNED_LINE, calibration_chunks  # noqa: E402

DEMO = ROOT / "demo"
REAL_LAYERS = 48  # Qwen3-30B-A3B's depth
# Qwen3-30B-A3B's shapes (as `moeheal synth --like qwen3-30b-a3b` writes them); --small shrinks them for a CPU check
SHAPE = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
         "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "vocab_size": 151936, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
         "max_position_embeddings": 40960}
SMALL = {**SHAPE, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


class TimedTap(logging.Handler):
    """AutoRound's log messages with the time each was emitted (perf_counter's clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter(), record.getMessage()))


def write_checkpoint(out: Path, layers: int, shape: dict) -> Path:
    """A random-weight Qwen3-MoE checkpoint (bfloat16) and the demo's tokenizer in `out`."""
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(num_hidden_layers=layers, tie_word_embeddings=False, **shape)
    config.architectures = ["Qwen3MoeForCausalLM"]  # AutoRound's GGUF layer defaults look it up
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_file=str(DEMO / "tokenizer.json"),
                            eos_token="<|endoftext|>").save_pretrained(out)
    return out


def block_times(start: float, lines: list[tuple[float, str]], layers: int, experts: int) -> list[float]:
    """Each block's seconds, from `start` (or the block before) to the block's own tuned line, checked:
    one line per block, each tuning every routed expert layer (a tool that skipped the experts would be
    timed doing nothing). Unlike the peer script it does not ask that the loss fell: on random weights
    the first iterate may be the best one, and the iterations ran all the same."""
    tuned = [(t, TUNED_LINE.search(message)) for t, message in lines if TUNED_LINE.search(message)]
    print("AutoRound log:", *(match.group(0) for _, match in tuned), sep="\n  ")
    assert len(tuned) == layers, f"AutoRound reported {len(tuned)} tuned blocks of {layers}"
    for _, match in tuned:
        assert int(match.group(1)) >= 3 * experts, f"fewer than {3 * experts} layers tuned: {match.group(0)}"
    stamps = [t for t, _ in tuned]
    return [b - a for a, b in zip([start, *stamps], stamps)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="blocks of the synthetic model (at least 2)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--small", action="store_true", help="shrunk widths and 8 experts: a CPU check")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if args.layers < 2:
        parser.error("--layers must be at least 2: the first block's time holds the input caching")
    from auto_round import AutoRound
    from transformers import AutoTokenizer

    json_out = args.json.resolve() if args.json else None  # before the working directory moves
    shape = SMALL if args.small else SHAPE
    tap = TimedTap()
    logging.getLogger("autoround").addHandler(tap)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):  # AutoRound keeps its offload
        # folder (ar_work_space) under the working directory; the caller's comes back before tmp goes
        begin = time.perf_counter()
        ckpt = write_checkpoint(Path(tmp) / "model", args.layers, shape)
        write_s = time.perf_counter() - begin
        dataset = calibration_chunks(DEMO / "docs.jsonl", DEMO / "split.csv", DEMO / "tokenizer.json",
                                     args.seqlen, args.nsamples, args.seed)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with DeviceSampler() as device:
            start = time.perf_counter()
            ar = AutoRound(str(ckpt), AutoTokenizer.from_pretrained(ckpt), scheme="gguf:q2_k_s", iters=args.iters,
                           nsamples=args.nsamples, seqlen=args.seqlen, dataset=dataset, enable_alg_ext=True,
                           ignore_layers=IGNORE, seed=args.seed, **({} if cuda else {"device_map": "cpu"}))
            ar.quantize()
            end = time.perf_counter()
    blocks = block_times(start, tap.lines, args.layers, shape["num_experts"])
    per_layer = sum(blocks[1:]) / len(blocks[1:])
    fixed = (end - start) - per_layer * args.layers
    samples = device.within(start, end)
    figures = {
        "shape": "qwen3-30b-a3b" + (" (small)" if args.small else ""), "layers": args.layers,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "versions": {m: metadata.version(m) for m in ("auto-round", "torch", "transformers")},
        "settings": {k: getattr(args, k) for k in ("iters", "nsamples", "seqlen", "seed")},
        "calibration_tokens": args.nsamples * args.seqlen, "checkpoint_write_s": write_s,
        "quantize_s": end - start, "block_s": blocks, "per_layer_s": per_layer, "fixed_s": fixed,
        "extrapolated_to": REAL_LAYERS, "extrapolated_s": fixed + per_layer * REAL_LAYERS,
        "label": f"extrapolated from blocks 2-{args.layers} of a {args.layers}-layer run to {REAL_LAYERS} layers",
        "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "nvidia_smi_peak_gb": max((m for _, _, m in samples), default=0) * 2**20 / 1e9 or None,
        "gpu_util_mean": sum(u for _, u, _ in samples) / len(samples) if samples else None,
        "gpu_busy_fraction": sum(u > BUSY_UTIL for _, u, _ in samples) / len(samples) if samples else None,
        "command": " ".join(sys.argv),
    }
    print(f"AutoRound {figures['versions']['auto-round']} on {figures['device']}: quantize {end - start:.1f} s "
          f"for {args.layers} layers; blocks {', '.join(f'{b:.1f}' for b in blocks)} s; "
          f"per layer {per_layer:.1f} s; {figures['label']}: {figures['extrapolated_s'] / 60:.1f} min")
    if samples:
        print(f"GPU: utilisation mean {figures['gpu_util_mean']:.0f}%, busy (>{BUSY_UTIL}%) in "
              f"{figures['gpu_busy_fraction']:.0%} of {len(samples)} samples; torch peak "
              f"{figures['gpu_peak_gb']:.1f} GB, nvidia-smi {figures['nvidia_smi_peak_gb']:.1f} GB")
    if json_out:
        json_out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
