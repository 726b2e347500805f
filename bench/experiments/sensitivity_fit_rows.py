"""Does fitting the sensitivity measurement's alpha on `FIT_ROWS` strided calibration rows change a recipe?

The sensitivity stage prices a routed role's candidate format by its output error after alpha, one
scalar per (role, format) fitted on the calibration rows. Past `sensitivity.FIT_ROWS` rows it fits it
on evenly strided rows (`pipeline/stages/sensitivity.py`), which at 65,536 rows skips 7 of every 8
routed passes. This script measures every MoE layer of a config's budget variant both ways (the
stride, and every row: `FIT_ROWS` past the row count) with `measure_sensitivity` itself, outside the
lake (whose keys do not see a patched constant), then allocates each budget of the config's variants
with the same knobs from both tables (`allocate.choose_recipe`) and prints, per budget, whether the
recipes are the same (`--budgets`: other budgets too), and per (layer, role, format) the largest relative
change of kl_est, alpha and rel_err.

Builds the config's dumps and unseen guidance in its lake if they are not there; tunes nothing.

    .venv/bin/python -P bench/experiments/sensitivity_fit_rows.py -c demo/ablations/budget-64k.toml --budgets 2.625
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.dumps import open_dump
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.stages import sensitivity
from moeheal.pipeline.stages.allocate import AllocateParams, choose_recipe


def measure(run: HealRun, variant, fit_rows: int) -> pa.Table:
    """Every MoE layer of `variant`'s measurement with `FIT_ROWS` = `fit_rows`, concatenated."""
    source = run.source
    cal = open_dump(run.result(run.dump("calibration")).path, source.hp, source.moe_layers)
    unseen = open_dump(run.result(run.dump("unseen")).path, source.hp, source.moe_layers)
    guidance = run.result(run.guidance("unseen")).path
    saved, sensitivity.FIT_ROWS = sensitivity.FIT_ROWS, fit_rows
    try:
        return pa.concat_tables([
            sensitivity.measure_sensitivity(
                source, cal, unseen, guidance,
                dataclasses.replace(sensitivity.SensitivityParams.of(variant, source.arch), layer=layer),
                log=lambda line: print(f"  {line}", flush=True))
            for layer in source.moe_layers])
    finally:
        sensitivity.FIT_ROWS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--budgets", type=float, nargs="*", default=[],
                        help="budgets (bits per routed weight) to allocate besides the config's")
    args = parser.parse_args()
    run = HealRun(load_config(args.config), log=lambda line: None)
    run.overlap()  # the audit first, as a heal does
    budgets, arch = run.budget_variants(), run.source.arch
    first = budgets[0]
    shared = sensitivity.SensitivityParams.of(first, arch)
    measured = [v for v in budgets if sensitivity.SensitivityParams.of(v, arch) == shared]
    tables = {}
    for name, fit_rows in (("strided", sensitivity.FIT_ROWS), ("every row", 1 << 40)):
        start = time.perf_counter()
        print(f"{name} (FIT_ROWS = {fit_rows}):", flush=True)
        tables[name] = measure(run, first, fit_rows)
        print(f"  {time.perf_counter() - start:.1f} s", flush=True)
    a, b = (t.to_pylist() for t in tables.values())
    for key in ("kl_est", "alpha", "rel_err"):
        change = max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b, strict=True) if y[key])
        print(f"largest relative change of {key}, strided against every row: {change:.2e}")
    print("| variant | budget | bits, strided | bits, every row | same recipe |")
    print("|---|---|---|---|---|")
    extra = [dataclasses.replace(first, name=f"budget {b:g}", budget_bpw=b) for b in args.budgets]
    for v in measured + extra:
        params = AllocateParams.of(v)
        (ra, sa), (rb, sb) = (choose_recipe(t, params, v.name) for t in tables.values())
        same = ra.select(["layer", "role", "format"]).equals(rb.select(["layer", "role", "format"]))
        print(f"| {v.name} | {v.budget_bpw} | {sa['bpw']:.4f} | {sb['bpw']:.4f} | {'yes' if same else 'no'} |")
    assert np.isfinite([r["kl_est"] for r in a]).all()


if __name__ == "__main__":
    main()
