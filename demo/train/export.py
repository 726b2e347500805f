"""Export the trained demo model to the committed Q8_0 GGUF and check the file.

Reads what ``train.py`` wrote (``config.json``, fp16 ``model-*.safetensors``),
loads it into transformers' ``Qwen2MoeForCausalLM`` (float32, CPU), writes
``demo/model/demo-q8_0.gguf`` with ``pipeline.sources.convert.hf_to_gguf`` and the
demo tokenizer, then verifies the result the way a user would meet it:
gguf-py opens it, it fits the 25 MB budget, and transformers, loading the GGUF
on its own, scores each stratum's held-out sequences with a loss close to the
source model's (Q8_0 is near-lossless, so a large gap means a broken export).
The check is written to ``demo/model/export_check.json``, which the model card
renders.

Run from the repository root:
``.venv/bin/python demo/train/export.py --weights DIR [--data .traindata]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))
from moeheal.pipeline.sources.convert import hf_to_gguf  # noqa: E402  (run as a script from the repository)

MAX_BYTES = 25 * 1024 * 1024


def load_trained(weights: Path) -> Qwen2MoeForCausalLM:
    """The trained model from ``train.py``'s output folder, in float32 on CPU."""
    config = Qwen2MoeConfig.from_pretrained(weights)
    config.name_or_path = "moeheal-demo"
    model = Qwen2MoeForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(weights.glob("model-*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.eval()


@torch.no_grad()
def mean_ce(model, sequences: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over ``sequences`` ``(S, T+1)``."""
    logits = model(input_ids=sequences[:, :-1], use_cache=False).logits.float()  # (S, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sequences[:, 1:].reshape(-1)).item()


def heldout_sequences(data: Path, stratum: str, n_seq: int, seq: int) -> torch.Tensor:
    """``n_seq`` windows spread evenly over one stratum's held-out stream, ``(S, T+1)``."""
    heldout = np.load(data / "tokens.npz")[f"heldout_{stratum}"].astype(np.int64)  # (M,)
    starts = np.linspace(0, heldout.size - seq - 1, n_seq).astype(np.int64)  # (S,)
    return torch.from_numpy(heldout[starts[:, None] + np.arange(seq + 1)[None, :]])  # (S, T+1)


def check_gguf(path: Path) -> dict[str, int]:
    """Open with gguf-py and return the shape keys the demo promises; raise if over budget."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{path}: {size} bytes, over the {MAX_BYTES} byte budget")
    reader = gguf.GGUFReader(str(path))
    keys = ("embedding_length", "block_count", "expert_count", "expert_used_count",
            "expert_feed_forward_length", "expert_shared_feed_forward_length")
    shape = {k: int(reader.fields[f"qwen2moe.{k}"].contents()) for k in keys}
    shape["bytes"] = size
    shape["tensors"] = len(reader.tensors)
    return shape


def main() -> None:
    """Export, then check the GGUF's shape, size and held-out loss against the source model."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=REPO / "demo" / "tokenizer.json")
    parser.add_argument("--out", type=Path, default=REPO / "demo" / "model" / "demo-q8_0.gguf")
    parser.add_argument("--data", type=Path, default=REPO / ".traindata")
    parser.add_argument("--report", type=Path, default=REPO / "demo" / "model" / "export_check.json")
    parser.add_argument("--check-seqs", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()

    model = load_trained(args.weights)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    hf_to_gguf(model, tokenizer, args.out, matrix_type="q8_0")
    report: dict[str, object] = {"gguf": check_gguf(args.out)}
    if (args.data / "tokens.npz").exists():
        # transformers' GGUF reader does not map qwen2moe's expert widths
        # (expert_feed_forward_length, expert_shared_feed_forward_length), so the
        # architecture is passed in; every weight still comes from the GGUF.
        from_gguf = AutoModelForCausalLM.from_pretrained(str(args.out.parent), gguf_file=args.out.name,
                                                         config=model.config, dtype=torch.float32).eval()
        strata = sorted(k.removeprefix("heldout_") for k in np.load(args.data / "tokens.npz").files
                        if k.startswith("heldout_"))
        rows = {}
        for stratum in strata:
            sequences = heldout_sequences(args.data, stratum, args.check_seqs, args.seq)
            rows[stratum] = {"source_fp32": mean_ce(model, sequences), "q8_0_gguf": mean_ce(from_gguf, sequences),
                             "tokens": int(sequences[:, 1:].numel())}
        report["heldout_ce"] = rows
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
