"""Ask AutoRound's AutoScheme for a mixed-bit GGUF recipe of the demo's routed experts; record its answer.

AutoScheme scores every layer under each candidate scheme with gradients on calibration data and picks
one scheme per layer (or per group of layers that must share one) to meet an average bit width. A
mixed-bit AutoRound file at our recipe's size would be the fair peer for a KL-priced recipe (issue:
"AutoRound's own mixed-bit answer at the same size"). This script asks for it and writes what happened
to `auto_scheme_probe.json` beside it, whichever way it goes:

- the options' average bits in AutoScheme's own accounting (its log: every layer it counts, the ignored
  ones at 16 bits, so not bits per routed weight) and each option's GGUF bits per routed weight;
- the chosen scheme per (layer, role) with the resulting bits per routed weight, or the exception
  AutoScheme raised (type, message, the innermost frames).

Each GGUF routed-expert tensor (`blk.L.ffn_{gate,up,down}_exps`) stores every expert of a layer in one
type, so each (layer, role)'s expert linears are one `shared_layers` group. The data: `nsamples` chunks
of the `cal` documents (`make_autoround_peer.calibration_chunks`, 600 tokens decoded to text, since
AutoScheme takes only a dataset name or a local JSON-lines file of texts; AutoRound cuts each to
`seqlen`). `--iters 0`: the scheme search alone, without the tuning that would follow.

    LLAMA_CPP_ROOT=/path/to/llama.cpp venv/bin/python demo/peers/autoround/probe_auto_scheme.py --avg-bits 8.3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch

import make_autoround_peer as peer

OPTIONS = ("gguf:q2_k_s", "gguf:q3_k_s", "gguf:q4_k_s")  # AutoRound's K-quant GGUF schemes, smallest first
GGUF_BPW = {2: 2.625, 3: 3.4375, 4: 4.5}  # Q2_K, Q3_K, Q4_K bits per weight (ggml's block sizes)


def expert_groups(n_layers: int, n_experts: int) -> list[list[str]]:
    """One `shared_layers` group per GGUF expert tensor: every expert's linear of one (layer, role)."""
    return [[f"model.layers.{layer}.mlp.experts.{e}.{role}_proj" for e in range(n_experts)]
            for layer in range(n_layers) for role in peer.ROLES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--avg-bits", type=float, required=True, help="AutoScheme's target, in its own accounting")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--defaults", action="store_true",
                        help="AutoRound's and AutoScheme's own memory settings (meta tensors, offloading) instead "
                             "of low_cpu_mem_usage=False and low_gpu_mem_usage=False, which keep every weight loaded")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("auto_scheme_probe.json"))
    args = parser.parse_args()
    if not os.environ.get("LLAMA_CPP_ROOT"):
        parser.error("set LLAMA_CPP_ROOT as for make_autoround_peer.py")
    out = args.out.resolve()
    torch.set_num_threads(args.threads)

    from auto_round import AutoRound, AutoScheme
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tap = peer.LogTap()
    peer.logging.getLogger("autoround").addHandler(tap)
    record: dict = {"versions": {m: metadata.version(m) for m in ("auto-round", "torch", "transformers")},
                    "settings": {"avg_bits": args.avg_bits, "options": OPTIONS, "nsamples": args.nsamples,
                                 "seqlen": args.seqlen, "iters": args.iters, "enable_alg_ext": True,
                                 "ignore_layers": peer.IGNORE, "shared_layers": "one group per (layer, role)",
                                 "memory": "AutoRound's defaults" if args.defaults else "every weight loaded"}}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        ckpt, n_layers, n_experts = peer.build_checkpoint(peer.DEMO / "model" / "demo-q8_0.gguf", Path(tmp))
        chunks = peer.calibration_chunks(peer.DEMO / "docs.jsonl", peer.DEMO / "split.csv",
                                         peer.DEMO / "tokenizer.json", args.seqlen + 88, args.nsamples, 0)
        tok = Tokenizer.from_file(str(peer.DEMO / "tokenizer.json"))
        texts = Path(tmp) / "cal.jsonl"
        texts.write_text("".join(json.dumps({"text": tok.decode(c["input_ids"][0].tolist())}) + "\n" for c in chunks))
        memory = {} if args.defaults else {"low_cpu_mem_usage": False}
        scheme = AutoScheme(avg_bits=args.avg_bits, options=OPTIONS, shared_layers=expert_groups(n_layers, n_experts),
                            **memory, **({} if args.defaults else {"low_gpu_mem_usage": False}))
        start = time.perf_counter()
        try:
            ar = AutoRound(str(ckpt), AutoTokenizer.from_pretrained(ckpt), scheme=scheme, iters=args.iters,
                           nsamples=args.nsamples, seqlen=args.seqlen, dataset=str(texts), enable_alg_ext=True,
                           ignore_layers=peer.IGNORE, seed=0, device_map="cpu", **memory)
            _, layer_config = ar.quantize()
            chosen = {f"blk.{layer}.ffn_{role}_exps": int(layer_config[group[0]]["bits"])
                      for (layer, role), group in zip(((la, r) for la in range(n_layers) for r in peer.ROLES),
                                                      expert_groups(n_layers, n_experts))}
            record["outcome"] = {"chosen_bits": chosen, "routed_bpw": sum(GGUF_BPW[b] for b in chosen.values())
                                 / len(chosen)}  # every expert tensor of the demo has the same size
        except Exception as exc:  # the probe records a refusal as its answer
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "auto_round" in f.filename][-3:]
            record["outcome"] = {"error": f"{type(exc).__name__}: {exc}",
                                 "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]}
        record["seconds"] = round(time.perf_counter() - start, 1)
    record["autoscheme_log"] = [line for line in tap.lines if "AutoScheme option" in line or "Average bits" in line]
    record["options_bpw_routed"] = {option: GGUF_BPW[int(option[6])] for option in OPTIONS}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["outcome"], indent=1))


if __name__ == "__main__":
    main()
