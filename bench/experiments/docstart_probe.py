"""Where AutoRound's advantage on the first tokens of a document comes from: four probes.

`evaluator_gap.py` found that every other file is relatively worse against AutoRound's on a
document's first 256 tokens (llama.cpp's chunk) than 256 tokens in. This script narrows where that
lives, on the same chunks (the scored positions 128-254 of each eval document's tokens 0-255, and
of tokens 256-511), with our forward pass and the files of a healed lake:

1. **routing**: do the starts route differently? The reference's expert use over the scored
   positions against the calibration trace's first `--cal-tokens` rows (KL(use || calibration) and
   the share of assignments to experts the calibration under-samples, below half the uniform share);
2. **one layer alone**: each MoE layer's routed-output relative error (`kernels.learned.
   relative_error`, on the reference's inputs) of each file, at the starts and inside;
3. **the shared expert's ridge**: a file with its shared down projection taken from a peer that
   has none (`--plain-shared`), against AutoRound's;
4. **one layer's experts swapped**: `--file` with one layer's routed experts replaced by
   AutoRound's, against AutoRound's whole file.

Reads the published tables and the files they name; tunes nothing.

    .venv/bin/python -P bench/experiments/docstart_probe.py -c demo/ablations/data-curve.toml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from moeheal.kernels.learned import relative_error
from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.documents import doc_tokens
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.lake.files import read_part
from moeheal.pipeline.model import roles
from moeheal.pipeline.llamacpp import CTX
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.stages.quantize import token_set

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.experiments.calibration_gap import routed_weights  # noqa: E402
from bench.experiments.evaluator_gap import BATCH, chunk_klds  # noqa: E402

FIRST = CTX // 2  # llama-perplexity scores positions FIRST .. CTX-2 of a chunk
OFFSETS = {"starts (tokens 0-255)": 0, "inside (tokens 256-511)": 256}


def captured_rows(runner: Runner, chunks: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
    """The reference's MoE rows (mixed, experts, weights, yr) at the scored positions, per layer."""
    acc: dict[int, dict[str, list[np.ndarray]]] = {}
    for start in range(0, len(chunks), BATCH):
        def keep(layer, cap) -> None:
            parts = acc.setdefault(layer, {k: [] for k in ("mixed", "experts", "weights", "yr")})
            for name, part in parts.items():
                value = getattr(cap, name)[:, FIRST:CTX - 1]  # (B, scored, ...)
                part.append(value.reshape(-1, value.shape[-1]))
        runner.forward(chunks[start:start + BATCH], capture=True, on_layer=keep, logits=False)
    return {layer: {k: np.concatenate(v) for k, v in parts.items()} for layer, parts in acc.items()}


def layer_tensors(model: GGUFModel, layer: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {f"blk.{layer}.{name}.weight": np.asarray(model.tensor(f"blk.{layer}.{name}.weight")) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/ablations/data-curve.toml"))
    parser.add_argument("--autoround", default="q2_k_autoround_65k")
    parser.add_argument("--files", nargs="+", default=["q2_k_gptq_64k", "q2_k_learned_64k", "q2_k_imatrix_65k"])
    parser.add_argument("--file", default="q2_k_gptq_64k", help="the file whose layers are swapped (probe 4)")
    parser.add_argument("--plain-shared", default="q2_k_imatrix_65k", help="a file whose shared expert has no ridge")
    parser.add_argument("--cal-tokens", type=int, default=65536)
    args = parser.parse_args()
    cfg = load_config(args.config, peers_may_be_missing=True)
    tables = cfg.lake_root / "current" / "tables"
    variants = read_part(tables / "variants.parquet", ("variant", "gguf")).to_pylist()
    gguf = {r["variant"]: Path(r["gguf"]) for r in variants}
    docs = sorted({r["doc_id"] for r in read_part(tables / "llama_kld.parquet", ("doc_id", "set")).to_pylist()
                   if r["set"] == "eval"})
    tokens = doc_tokens(sorted(cfg.lake_root.glob("parts/*/doc_tokens.parquet"))[0].parent)
    source = open_model(gguf["reference"])
    reference = Runner(source)
    autoround = open_model(gguf[args.autoround])
    layers = source.moe_layers
    routing = read_part(tables / "routing.parquet", ("trace", "layer", "pos", "expert")).to_pylist()
    n_expert = source.hp.n_expert
    cal = np.zeros((max(layers) + 1, n_expert))
    for r in routing:
        if r["trace"] == "calibration" and r["pos"] < args.cal_tokens:
            cal[r["layer"], r["expert"]] += 1
    chunks = {label: np.stack([tokens[d][off:off + CTX] for d in docs]).astype(np.int32)
              for label, off in OFFSETS.items()}
    rows = {label: captured_rows(reference, c) for label, c in chunks.items()}
    print(f"{len(docs)} eval documents; positions {FIRST}-{CTX - 2} of each chunk scored\n\n1. routing")
    for label in OFFSETS:
        for layer in layers:
            use = np.bincount(rows[label][layer]["experts"].reshape(-1), minlength=n_expert).astype(float)
            use, share = use / use.sum(), cal[layer] / cal[layer].sum()
            low = share < 0.5 / n_expert
            kl = np.sum(use * np.log((use + 1e-9) / (share + 1e-9)))
            print(f"  {label}, layer {layer}: KL(use || calibration) {kl:.3f}; "
                  f"assignments to under-sampled experts {use[low].sum():.3f} (calibration {share[low].sum():.3f})")
    print("\n2. one layer alone: routed-output relative error on the reference's inputs")
    for layer in layers:
        sets = {label: token_set(source, layer, rows[label][layer], False) for label in OFFSETS}
        for name in [args.autoround, *args.files]:
            w = routed_weights(open_model(gguf[name]), layer)
            errors = "; ".join(f"{label} {relative_error(w, s):.4f}" for label, s in sets.items())
            print(f"  layer {layer} {name}: {errors}")
    base = {label: chunk_klds(reference, Runner(autoround), c, FIRST).sum() for label, c in chunks.items()}
    print(f"\n3. the shared expert's ridge: KLD / {args.autoround}'s")
    plain = open_model(gguf[args.plain_shared])
    shared = {k: v for layer in layers for k, v in layer_tensors(plain, layer, (roles.SHARED[-1],)).items()}
    for name in args.files[:2]:
        model = open_model(gguf[name])
        for label, c in chunks.items():
            as_is = chunk_klds(reference, Runner(model), c, FIRST).sum() / base[label]
            swapped = chunk_klds(reference, Runner(model, overrides=shared), c, FIRST).sum() / base[label]
            print(f"  {name}, {label}: as is {as_is:.3f}; "
                  f"shared down projection from {args.plain_shared} {swapped:.3f}")
    print(f"\n4. one layer's experts swapped: {args.file} with {args.autoround}'s, KLD / {args.autoround}'s")
    model = open_model(gguf[args.file])
    for label, c in chunks.items():
        cells = [f"none {chunk_klds(reference, Runner(model), c, FIRST).sum() / base[label]:.3f}"]
        for layer in layers:
            swap = layer_tensors(autoround, layer, roles.ROUTED)
            kld = chunk_klds(reference, Runner(model, overrides=swap), c, FIRST).sum()
            cells.append(f"layer {layer} {kld / base[label]:.3f}")
        print(f"  {label}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
