"""How concentrated the guidance stage's Fisher weights are: what learned rounding's weighted loss
(`learned_loss = "fisher"`) effectively trains on.

For every MoE layer of a healed lake's guidance stage, over the first `--rows` calibration rows (the
rows a variant with that `cal_tokens` reads): the share of the total weight held by the largest 1%
of (token, channel) entries and by the 1% of tokens with the largest summed weight, and Kish's
effective sample size, (sum w)^2 / sum w^2, as a fraction of the entries and of the tokens: a
weighted mean over n values has the variance of an unweighted one over that many. Reads only the
calibration trace's weights; nothing here reads the evaluation windows.

    .venv/bin/python -P bench/experiments/fisher_weights.py -c demo/ablations/fisher.toml --rows 65536
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.fisher import read_fisher
from moeheal.pipeline.heal import HealRun


def concentration(weights: np.ndarray) -> dict[str, float]:
    """Top-1% shares and Kish's effective fraction of a layer's weights (rows, d), over entries and tokens."""
    entries = np.sort(weights.ravel().astype(np.float64))[::-1]  # (rows * d,)
    tokens = np.sort(weights.sum(axis=1, dtype=np.float64))[::-1]  # (rows,)

    def kish(w: np.ndarray) -> float:
        return float(w.sum() ** 2 / np.square(w).sum() / w.size)

    return {"top1pct_entries": float(entries[:max(1, entries.size // 100)].sum() / entries.sum()),
            "top1pct_tokens": float(tokens[:max(1, tokens.size // 100)].sum() / tokens.sum()),
            "kish_entries": kish(entries), "kish_tokens": kish(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/ablations/fisher.toml"))
    parser.add_argument("--rows", type=int, default=0, help="the first rows only (a variant's cal_tokens); 0: all")
    args = parser.parse_args()
    run = HealRun(load_config(args.config), log=lambda line: None)
    folder = run.result(run.guidance()).path
    print("| layer | top 1% of entries hold | top 1% of tokens hold | Kish's effective fraction: entries | tokens |")
    print("|---:|---:|---:|---:|---:|")
    for layer in run.reference.moe_layers:
        c = concentration(read_fisher(folder, layer, slice(0, args.rows or None)))
        print(f"| {layer} | {c['top1pct_entries']:.3f} | {c['top1pct_tokens']:.3f} | {c['kish_entries']:.4f} "
              f"| {c['kish_tokens']:.4f} |")


if __name__ == "__main__":
    main()
