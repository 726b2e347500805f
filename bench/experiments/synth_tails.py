"""How heavy the tails of `moeheal synth`'s weights are: kurtosis per tensor role, synth against the demo model.

    python bench/experiments/synth_tails.py [--like qwen3-30b-a3b qwen3-next-80b] [--experts 8] [--vocab 4096]

synth draws each weight matrix from a Student-t whose degrees of freedom come from the excess
kurtosis of the same role in the bundled trained demo model (`synth.ROLE_FITS`, refitted from the
demo by `tests/test_synth.py`). This script measures what comes out: for the demo model
(`demo/model/demo-q8_0.gguf`) and for a file written by `write_synth` per named model (the first
layers that hold every role it has; the expert count and vocabulary shrunk, which changes the
number of weights, not their distribution), it reads every weight tensor back (not norms and
biases), pools the layers
per role as the fit does, and prints the kurtosis (E[(x - mean)^4] / var^2, float64; a Gaussian's
is 3, so excess = kurtosis - 3) with the number of weights. Both files are Q8_0, read through
`GGUFModel` (the values the pipeline sees). The kurtosis of a trained large model's weights is
not measured here (the project holds no such model).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.sources.synth import (
    BORROWED_ROLES, DECAY_ROLE, DEMO_MODEL, LIKE, NORM_ROLE, ZERO_ROLE, role_of, write_synth,
)

FIRST_LAYERS = {"qwen3-next-80b": 4, "deepseek-v3": 2}  # a full-attention layer; a dense and an MoE layer


def kurtosis(x: np.ndarray) -> float:
    """Pearson's kurtosis E[(x - mean)^4] / var^2 of all values, in float64 (3 for a Gaussian)."""
    centred = x.astype(np.float64).ravel() - x.mean(dtype=np.float64)  # (n,)
    var = np.mean(centred**2)
    return float(np.mean(centred**4) / var**2)


def role_kurtosis(model: GGUFModel) -> dict[str, tuple[float, int]]:
    """{role: (kurtosis, weights)} over the model's weights (norms, biases and Qwen3-Next's decay
    rates, which synth does not draw from the fit, left out), layers pooled per role."""
    pooled: dict[str, list[np.ndarray]] = {}
    for name in model.tensor_names:
        role = role_of(name)
        if role not in (NORM_ROLE, ZERO_ROLE, DECAY_ROLE):
            pooled.setdefault(role, []).append(model.tensor(name).ravel())
    return {role: (kurtosis(np.concatenate(parts)), sum(p.size for p in parts)) for role, parts in pooled.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--like", nargs="+", default=["qwen3-30b-a3b", "qwen3-next-80b"], choices=list(LIKE))
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer of the synth files")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary of the synth files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    columns = {"demo": role_kurtosis(GGUFModel(DEMO_MODEL))}
    with tempfile.TemporaryDirectory() as tmp:
        for like in args.like:
            path = write_synth(Path(tmp) / f"{like}.gguf", like, n_layer=FIRST_LAYERS.get(like, 1), seed=args.seed,
                               vocab_size=args.vocab, n_expert=args.experts).paths[0]
            columns[like] = role_kurtosis(GGUFModel(path))
    roles = list(dict.fromkeys(role for column in columns.values() for role in column))
    print(f"kurtosis per tensor role (Gaussian: 3); synth files: {args.experts} experts, vocabulary {args.vocab}, "
          f"seed {args.seed}, q8_0; (n) = weights")
    print("| role | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for role in roles:
        cells = [f"{columns[c][role][0]:.2f} ({columns[c][role][1]:,})" if role in columns[c] else "" for c in columns]
        drawn_as = f" (drawn as {BORROWED_ROLES[role]})" if role in BORROWED_ROLES else ""
        print(f"| {role}{drawn_as} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
