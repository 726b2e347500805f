"""How well each Q2_K file fits the calibration tokens it was made from, against tokens it never saw.

For every variant named (by default the demo's Q2_K files: llama.cpp's, AutoRound's on the same
8,192 calibration tokens and on 65,536, ours healed / learned / + e2e), from a healed lake:

- the model's KL(reference || variant) per token over the whole calibration trace and over the
  unseen trace (`pipeline.model.tuner.Trace` with the reference-topk stage at k = the vocabulary: the full KL); ours and both peers made
  their files from the calibration trace or from text around it, so the first is in-sample;
- per MoE layer, the relative error of the routed output (`kernels.learned.relative_error`, the loss
  learned rounding minimises) with the variant's routed experts, on the calibration dump's rows and
  on the unseen dump's.

A file that fits its calibration tokens much better than unseen ones has learned the sample, not
the model: that gap, not the in-sample error, is what the evaluation windows see. Nothing here
reads the evaluation windows.

    .venv/bin/python bench/experiments/calibration_gap.py [-c demo/heal.toml] [--variants a,b,...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moeheal.kernels.decode import dequantize
from moeheal.kernels.learned import relative_error
from moeheal.pipeline.model import roles
from moeheal.pipeline.config import load_config
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import open_dump, read_layer
from moeheal.pipeline.model.tuner import Trace, Tuner
from moeheal.pipeline.stages.quantize import token_set

DEFAULT = "q2_k_imatrix,q2_k_autoround,q2_k_autoround_65k,q2_k_healed,q2_k_learned,q2_k_learned_e2e"


def routed_weights(model, layer: int) -> dict[str, np.ndarray]:
    """The variant's routed experts of one layer, decoded (E, rows, cols)."""
    out = {}
    for role in roles.ROUTED:
        raw = model.raw(f"blk.{layer}.{role}.weight")
        out[role] = dequantize(np.asarray(raw.data), raw.ggml_type.name.lower(), model.shape(f"blk.{layer}.{role}.weight"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/heal.toml"))
    parser.add_argument("--variants", default=DEFAULT)
    args = parser.parse_args()
    cfg = load_config(args.config)
    run = HealRun(cfg, log=lambda line: None)
    reference = open_model(cfg.reference)
    traces = run.result(run.traces()).path
    whole = run.result(run.reference_topk(reference.hp.vocab_size)).path  # k = the vocabulary: the full KL
    cal, unseen = (Trace(*trace_tokens(traces, name), cfg.seq_tokens, whole, name) for name in ("calibration", "unseen"))
    dumps = {name: open_dump(run.result(run.dump(name)).path) for name in ("calibration", "unseen")}
    layers = reference.moe_layers
    rows = {(name, layer): token_set(reference, layer, read_layer(dumps[name][str(layer)], slice(None)), False)
            for name in dumps for layer in layers}
    by_name = {v.name: v for v in cfg.variants}
    head = ["variant", "KL calibration trace", "KL unseen trace", "unseen / calibration"]
    head += [f"layer {i} error: calibration → unseen" for i in layers]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in args.variants.split(","):
        path = run.variant_gguf(by_name[name])
        model = open_model(path)
        tuner = Tuner(model, reference)
        kl_cal, kl_unseen = tuner.trace_kl(tuner.theta0, cal)[0], tuner.trace_kl(tuner.theta0, unseen)[0]
        cells = [name, f"{kl_cal:.4f}", f"{kl_unseen:.4f}", f"{kl_unseen / kl_cal:.2f}x"]
        for layer in layers:
            w = routed_weights(model, layer)
            e_cal, e_unseen = (relative_error(w, rows[(split, layer)]) for split in ("calibration", "unseen"))
            cells.append(f"{e_cal:.4f} → {e_unseen:.4f}")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
