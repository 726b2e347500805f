"""How far end-to-end tuning's loss moves when the reference keeps only its top k tokens plus a bucket.

    .venv/bin/python bench/experiments/e2e_topk.py [-c demo/heal.toml] [--variants q2_k_imatrix,iq2_xxs_imatrix]
                                                   [--k 16,64,256,1024] [--json bench/results/e2e-topk/demo.json]

For each variant named (outside GGUFs of the config, which need no heal: by default llama.cpp's
Q2_K and IQ2_XXS of the demo), over the unseen trace (the trace e2e keeps its step on; never the
evaluation windows): the mean KL(reference || variant) per token over the full vocabulary (the
baseline, computed in the same run from the same logits), and for each k the bucketed KL
`kernels.e2e.kl_sum_topk` uses, its ratio to the full KL, and the reference's mean mass outside
its top k. The bucketed KL is never above the full one (log-sum inequality) and equals it at k = V.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after site-packages: DESIGN.md, Imports

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from moeheal.kernels.e2e import kl_sum_topk, top_k_distribution  # noqa: E402
from moeheal.kernels.kld import kl_from_log_probs  # noqa: E402
from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.gguf.model import open_model  # noqa: E402
from moeheal.pipeline.heal import HealRun  # noqa: E402
from moeheal.pipeline.model.runner import Runner  # noqa: E402
from moeheal.pipeline.data.documents import trace_tokens  # noqa: E402
from moeheal.pipeline.data.topk import padded_sequences  # noqa: E402

BATCH = 8


def measure(reference: Runner, variant: Runner, tokens: np.ndarray, mask: np.ndarray, ks: list[int]) -> dict:
    """Summed full and bucketed KL, and the reference's summed mass outside its top k, over the trace."""
    sums = {"full": 0.0, **{f"k{k}": 0.0 for k in ks}, **{f"rest{k}": 0.0 for k in ks}}
    for start in range(0, len(tokens), BATCH):
        rows = slice(start, start + BATCH)
        ref_logp = jax.nn.log_softmax(jnp.asarray(reference.forward(tokens[rows])), axis=-1)  # (B, T, V)
        logits = jnp.asarray(variant.forward(tokens[rows]))  # (B, T, V)
        m = jnp.asarray(mask[rows])  # (B, T)
        sums["full"] += float(jnp.sum(kl_from_log_probs(ref_logp, logits) * m))
        for k in ks:
            ids, logp_k, log_rest = top_k_distribution(ref_logp, k)  # (B,T,k) x2, (B,T)
            sums[f"k{k}"] += float(kl_sum_topk(ids, logp_k, log_rest, logits, m))
            sums[f"rest{k}"] += float(jnp.sum(jnp.exp(log_rest) * m))
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/heal.toml"))
    parser.add_argument("--variants", default="q2_k_imatrix,iq2_xxs_imatrix")
    parser.add_argument("--k", default="16,64,256,1024")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = load_config(args.config)
    run = HealRun(cfg, log=lambda line: None)
    reference = Runner(open_model(cfg.reference))
    vocab = reference.hp.vocab_size
    ks = [min(int(k), vocab) for k in args.k.split(",")]
    tokens, mask = padded_sequences(*trace_tokens(run.result(run.traces()).path, "unseen"), cfg.seq_tokens)
    by_name = {v.name: v for v in cfg.variants}
    rows = []
    print(f"unseen trace: {int(mask.sum())} tokens, vocabulary {vocab}")
    print("| variant | full KL | " + " | ".join(f"k={k}: KL (ratio), mass outside" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for name in args.variants.split(","):
        sums = measure(reference, Runner(open_model(run.variant_gguf(by_name[name]))), tokens, mask, ks)
        n = float(mask.sum())
        row = {"variant": name, "tokens": int(n), "vocab": vocab, "full_kl": sums["full"] / n,
               "topk": {k: {"kl": sums[f"k{k}"] / n, "ratio": sums[f"k{k}"] / sums["full"],
                            "mass_outside": sums[f"rest{k}"] / n} for k in ks}}
        rows.append(row)
        cells = [f"{t['kl']:.4f} ({t['ratio']:.4f}), {t['mass_outside']:.4f}" for t in row["topk"].values()]
        print(f"| {name} | {row['full_kl']:.4f} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
