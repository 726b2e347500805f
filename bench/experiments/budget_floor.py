"""How far below llama.cpp's Q2_K a recipe of at most `--budget` bits per routed weight can go, by the
sensitivity stage's own estimate: the allocate stage's recipe (`choose_recipe`, exact on the demo's
nine routed tensors) from a narrow and a wide set of formats, against uniform Q2_K priced the same way.

The sensitivity tables of several lakes healed from the same calibration dump are merged per (layer,
role, format) (each lake measured the formats of its own budget variants; a cell two lakes share
must agree to 1e-12, or the script stops). Only the sensitivity stage's outputs are read: the
unseen trace's Fisher-priced output error of each tensor quantized alone, `kl_est`. An estimate, not
a measured KL: bench/RESULTS.md, "What a format costs the model", ranks it against the measured one.

    .venv/bin/python -P bench/experiments/budget_floor.py -c demo/ablations/budget.toml \\
        -c demo/ablations/budget-2p1.toml
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from moeheal.pipeline.config import load_config
from moeheal.pipeline.stages.allocate import AllocateParams, choose_recipe

NARROW = ("iq1_m", "iq2_xxs", "iq2_xs", "iq2_s")  # the formats for a recipe under 2.1 bits
WIDE = NARROW + ("q2_k", "iq3_xxs")
COLUMNS = "layer, role, tensor, format, n_weights, bytes, kl_est"


def routed_sensitivity(configs: list[Path]) -> pa.Table:
    """The routed rows of every config's published sensitivity table, one per (layer, role, format)."""
    merged: dict[tuple[int, str, str], dict] = {}
    for config in configs:
        table = load_config(config).lake_root / "current" / "tables" / "sensitivity.parquet"
        rows = duckdb.sql(f"SELECT DISTINCT {COLUMNS} FROM '{table}' WHERE role LIKE 'ffn_%_exps'").to_arrow_table()
        for row in rows.to_pylist():
            old = merged.setdefault((row["layer"], row["role"], row["format"]), row)
            if old["bytes"] != row["bytes"] or abs(old["kl_est"] - row["kl_est"]) > 1e-12:
                raise SystemExit(f"{table}: ({row['layer']}, {row['role']}, {row['format']}) differs from another "
                                 "lake's: not one dump")
    return pa.Table.from_pylist(list(merged.values()))


def best(sensitivity: pa.Table, formats: tuple[str, ...], budget: float) -> tuple[float, float, list[str]]:
    """The allocate stage's recipe from `formats` under `budget` bits: (summed kl_est, bits, format per
    (layer, role) in order)."""
    measured = sensitivity.filter(pc.is_in(sensitivity["format"], pa.array(formats)))
    recipe, summary = choose_recipe(measured, AllocateParams(budget, formats, "routed"), "budget_floor")
    return summary["pred_err"], summary["bpw"], recipe.column("format").to_pylist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, action="append", required=True)
    parser.add_argument("--budget", type=float, default=2.1)
    args = parser.parse_args()
    sensitivity = routed_sensitivity(args.config)
    uniform = sensitivity.filter(pc.equal(sensitivity["format"], "q2_k"))
    n_items = len({(r["layer"], r["role"]) for r in sensitivity.select(["layer", "role"]).to_pylist()})
    q2_k = sum(uniform.column("kl_est").to_pylist())
    print(f"{n_items} routed tensors; uniform q2_k: summed kl_est {q2_k:.4f} at 2.625 bits\n")
    print(f"| formats | bits (at most {args.budget}) | recipe, (layer, role) in order | summed kl_est "
          "| / uniform q2_k |")
    print("|---|---:|---|---:|---:|")
    for name, formats in (("narrow", NARROW), ("wide", WIDE)):
        kl, bits, recipe = best(sensitivity, formats, args.budget)
        print(f"| {name}: {', '.join(formats)} | {bits:.3f} | {' '.join(recipe)} | {kl:.4f} | {kl / q2_k:.3f} |")
    items = sorted((r["layer"], r["role"]) for r in uniform.select(["layer", "role"]).to_pylist())
    order = ", ".join(f"{layer}:{role.split('_')[1]}" for layer, role in items)
    print(f"\n(layer, role) order: {order}")


if __name__ == "__main__":
    main()
