"""One config healed twice (two devices, two builds): does every figure, and every conclusion, agree?

    python bench/tools/compare_runs.py demo/results/uniform-8k bench/results/demo-h200

Each side is a snapshot folder as ``demo/card.py`` writes it (``sizes.csv``,
``comparisons.csv``; ``--lake-tables DIR --out FOLDER`` writes one from a lake's
``tables/``, e.g. a run on another machine). GPTQ's schedule differs by device
(``kernels.gptq_schedule``: a GPU rounds 32 columns per step and factors in
float64, the CPU keeps the whole-block step and the float32 factor), so the
healed bytes differ in near-tie codes and the KLDs in their last digits; what
must hold is that the differences are small against the effects the demo
reports. Prints, per window set: each variant's pooled KLD on both sides and the
relative difference; then every compared pair's ΔKLD % [95% CI] on both sides
and whether the conclusion (CI below zero, above zero, or straddling it) is
the same. Exit 1 if any conclusion differs.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from moeheal.pipeline.config import load_config
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.lake.store import TableSet

REPO = Path(__file__).resolve().parents[2]


def read_rows(folder: Path, name: str) -> list[dict[str, str]]:
    """A snapshot table's rows as text."""
    with (folder / f"{name}.csv").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def verdict(lo: float, hi: float) -> str:
    """What a CI says: b better (below zero), b worse (above zero) or no difference shown."""
    return "better" if hi < 0 else "worse" if lo > 0 else "unclear"


def write_lake_snapshot(tables: Path, config: Path, out: Path) -> None:
    """``demo/card.py``'s snapshot of a lake's tables folder (a published set, copied from elsewhere)."""
    sys.path.append(str(REPO / "demo"))
    import card  # the demo's script, not a package

    cfg = load_config(config)
    settings = {"bootstrap": cfg.bootstrap, "ngram": cfg.ngram, "n_expert": GGUFModel(cfg.reference).hp.n_expert,
                "compare": json.dumps(cfg.compare)}
    card.write_snapshot(card.snapshot_lake(TableSet(tables), settings), out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, nargs="?", help="snapshot folder, side a")
    parser.add_argument("b", type=Path, nargs="?", help="snapshot folder, side b")
    parser.add_argument("--lake-tables", type=Path, help="write a snapshot of this lake tables folder and stop")
    parser.add_argument("--config", type=Path, default=REPO / "demo" / "heal.toml", help="its config")
    parser.add_argument("--out", type=Path, help="the snapshot folder to write")
    args = parser.parse_args()
    if args.lake_tables:
        if args.out is None:
            parser.error("--lake-tables needs --out")
        write_lake_snapshot(args.lake_tables, args.config, args.out)
        print(f"{args.out}: snapshot of {args.lake_tables}")
        return 0
    if args.a is None or args.b is None:
        parser.error("name two snapshot folders (or --lake-tables)")

    kld = {side: {(r["set"], r["variant"]): float(r["kld"]) for r in read_rows(folder, "sizes")}
           for side, folder in (("a", args.a), ("b", args.b))}
    print(f"a = {args.a}, b = {args.b}\n")
    print("| set | variant | KLD a | KLD b | b vs a, % |\n|---|---|---:|---:|---:|")
    shifts = []
    if not set(kld["a"]) & set(kld["b"]):
        raise SystemExit(f"{args.a} and {args.b} share no (set, variant)")
    for key in sorted(kld["a"]):
        if key in kld["b"]:
            shift = 100 * (kld["b"][key] / kld["a"][key] - 1)
            shifts.append(abs(shift))
            print(f"| {key[0]} | {key[1]} | {kld['a'][key]:.4f} | {kld['b'][key]:.4f} | {shift:+.2f} |")
    print(f"\nlargest |shift| {max(shifts):.2f}%, median {sorted(shifts)[len(shifts) // 2]:.2f}% "
          f"over {len(shifts)} (set, variant) pairs\n")

    pairs = {side: {(r["set"], r["a"], r["b"]): r for r in read_rows(folder, "comparisons")}
             for side, folder in (("a", args.a), ("b", args.b))}
    print("| set | a → b | ΔKLD % [95% CI], side a | side b | same conclusion |\n|---|---|---|---|---|")
    differ = 0
    for key in sorted(pairs["a"]):
        if key not in pairs["b"]:
            continue
        cells, verdicts = [], []
        for side in ("a", "b"):
            r = pairs[side][key]
            lo, hi = float(r["ci_lo"]), float(r["ci_hi"])
            cells.append(f"{float(r['delta_pct']):+.1f} [{lo:+.1f}, {hi:+.1f}]")
            verdicts.append(verdict(lo, hi))
        same = verdicts[0] == verdicts[1]
        differ += not same
        print(f"| {key[0]} | {key[1]} → {key[2]} | {cells[0]} | {cells[1]} | "
              f"{'yes' if same else f'no: {verdicts[0]} / {verdicts[1]}'} |")
    print(f"\n{differ} of {len(pairs['a'])} comparisons change conclusion")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
