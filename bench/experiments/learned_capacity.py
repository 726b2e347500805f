"""How much of learned rounding's expert work is padding: each step's per-expert capacity against its pairs.

    python bench/experiments/learned_capacity.py -c demo/heal.toml            # the config's own routing
    python bench/experiments/learned_capacity.py --random 128 8 --tokens 65536  # random top-k, the 30B shape

A learned-rounding step (`kernels.learned.layer_error`) runs every expert on `capacity` rows: the largest
count of one expert's pairs in any batch of the unit, rounded up (`learned.expert_capacity`), so the programs
compile once. Its products are E x capacity rows where the batch has batch x k pairs. Printed per layer:
the batches (the pipeline's schedule, `quantize.learned_schedule`, on the calibration rows less the
held-out eighth, shuffled as `learn_layer` shuffles them), the pairs per expert on average, the largest
count, the capacity, and the padding factor E x capacity / (batch x k): the products' rows over the rows
that carry a pair. With `-c`, the routing is the calibration dump's (built or found in the config's lake,
at the first healed variant's `cal_tokens`); with `--random E K`, softmax-free top-K of Gaussian logits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))


def padding(experts: np.ndarray, n_expert: int, seed: int = 0) -> dict[str, float]:
    """The step layout's figures for routing `experts` (T, k) as `learn_layer` batches its training rows."""
    from moeheal.kernels import learned
    from moeheal.pipeline.stages import quantize as Q

    n = len(experts)
    cut = n - max(1, n // Q.LEARNED_HOLDOUT)
    steps, batch = Q.learned_schedule(cut, 0)
    order = learned.batch_order(cut, steps, batch, seed)  # as `learn_layer` batches its training rows
    capacity = learned.expert_capacity(experts[:cut], n_expert, order)
    most = max(int(np.bincount(experts[b].reshape(-1), minlength=n_expert).max()) for b in order)
    pairs = batch * experts.shape[1]
    return {"steps": steps, "batch": batch, "mean": pairs / n_expert, "most": most, "capacity": capacity,
            "padding": n_expert * capacity / pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config")
    parser.add_argument("--random", nargs=2, type=int, metavar=("E", "K"))
    parser.add_argument("--tokens", type=int, default=65536, help="calibration rows (with --random)")
    args = parser.parse_args()
    rows: list[tuple[str, np.ndarray, int]] = []
    if args.random:
        n_expert, k = args.random
        logits = np.random.default_rng(0).standard_normal((args.tokens, n_expert), np.float32)  # (T, E)
        rows.append((f"random top-{k} of {n_expert}", np.argsort(-logits, axis=1)[:, :k], n_expert))  # (T, k)
    if args.config:
        from moeheal.pipeline.config import load_config
        from moeheal.pipeline.data.dumps import open_dump
        from moeheal.pipeline.heal import HealRun

        cfg = load_config(args.config)
        run = HealRun(cfg, log=lambda line: print(line, file=sys.stderr))
        model = run.source
        dump = open_dump(run.result(run.dump("calibration")).path, model.hp, model.moe_layers)
        cal_tokens = cfg.healed_variants[0].cal_tokens or None
        for layer in model.moe_layers:
            rows.append((f"{cfg.path.name} layer {layer}", dump[str(layer)]["experts"][slice(0, cal_tokens)],
                         model.hp.n_expert))
    print("| routing | rows | steps x batch | pairs per expert, mean | most in a batch | capacity | padding |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, experts, n_expert in rows:
        p = padding(np.asarray(experts), n_expert)
        print(f"| {name} | {len(experts)} | {p['steps']} x {p['batch']} | {p['mean']:.1f} | {p['most']} "
              f"| {p['capacity']} | {p['padding']:.2f}x |")


if __name__ == "__main__":
    main()
