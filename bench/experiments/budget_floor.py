"""How far below llama.cpp's Q2_K a recipe of at most `--budget` bits per routed weight can go, by the
sensitivity stage's own estimate: the allocator's best recipe (`kernels.allocate`, exact on the
demo's nine routed tensors) from a narrow and a wide set of formats, against uniform Q2_K priced the
same way.

The sensitivity tables of several lakes healed from the same calibration dump are merged per (layer,
role, format) (each lake measured the formats of its own budget variants; a cell two lakes share
must agree to 1e-12, or the script stops). Only the sensitivity stage's outputs are read: the
unseen trace's Fisher-priced output error of each tensor quantized alone, `kl_est`. An estimate, not
a measured KL: bench/RESULTS.md, "What a format costs the model", ranks it against the measured one.

    .venv/bin/python -P bench/experiments/budget_floor.py -c demo/ablations/budget.toml \
        -c demo/ablations/budget-2p1.toml
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb
import numpy as np

from moeheal.kernels.allocate import allocate
from moeheal.pipeline.config import load_config

NARROW = ("iq1_m", "iq2_xxs", "iq2_xs", "iq2_s")  # the formats for a recipe under 2.1 bits
WIDE = NARROW + ("q2_k", "iq3_xxs")


def routed_cells(configs: list[Path]) -> dict[tuple[int, str, str], tuple[int, int, float]]:
    """(layer, role, format) -> (bytes, n_weights, kl_est) over every config's published sensitivity."""
    cells: dict[tuple[int, str, str], tuple[int, int, float]] = {}
    for config in configs:
        table = load_config(config).lake_root / "current" / "tables" / "sensitivity.parquet"
        rows = duckdb.sql(f"SELECT DISTINCT layer, role, format, bytes, n_weights, kl_est FROM '{table}' "
                          "WHERE role LIKE 'ffn_%_exps'").fetchall()
        for layer, role, fmt, nbytes, n, kl in rows:
            old = cells.setdefault((layer, role, fmt), (nbytes, n, kl))
            if old[0] != nbytes or abs(old[2] - kl) > 1e-12:
                raise SystemExit(f"{table}: ({layer}, {role}, {fmt}) differs from another lake's: not one dump")
    return cells


def best(cells: dict, formats: tuple[str, ...], budget: float) -> tuple[float, float, list[str]]:
    """The allocator's recipe from `formats` under `budget` bits: (summed kl_est, bits, format per tensor)."""
    items = sorted({(layer, role) for layer, role, _ in cells})
    costs = np.array([[cells.get((*i, f), (-1,))[0] for f in formats] for i in items])  # (items, formats)
    errors = np.array([[cells.get((*i, f), (0, 0, 0.0))[2] for f in formats] for i in items])  # (items, formats)
    n_weights = sum(cells[(*i, formats[1])][1] for i in items)
    choice = allocate(costs, errors, int(budget * n_weights / 8)).choice
    bits = 8 * sum(costs[k, c] for k, c in enumerate(choice)) / n_weights
    return float(sum(errors[k, c] for k, c in enumerate(choice))), bits, [formats[c] for c in choice]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, action="append", required=True)
    parser.add_argument("--budget", type=float, default=2.1)
    args = parser.parse_args()
    cells = routed_cells(args.config)
    items = sorted({(layer, role) for layer, role, _ in cells})
    q2_k = sum(cells[(*i, "q2_k")][2] for i in items)
    print(f"{len(items)} routed tensors; uniform q2_k: summed kl_est {q2_k:.4f} at 2.625 bits\n")
    print(f"| formats | bits (at most {args.budget}) | recipe, (layer, role) in order | summed kl_est "
          "| / uniform q2_k |")
    print("|---|---:|---|---:|---:|")
    for name, formats in (("narrow", NARROW), ("wide", WIDE)):
        kl, bits, recipe = best(cells, formats, args.budget)
        print(f"| {name}: {', '.join(formats)} | {bits:.3f} | {' '.join(recipe)} | {kl:.4f} | {kl / q2_k:.3f} |")
    order = ", ".join(f"{layer}:{role.split('_')[1]}" for layer, role in items)
    print(f"\n(layer, role) order: {order}")


if __name__ == "__main__":
    main()
