"""The e2e stage of every `e2e = true` variant of a config, and nothing after it: its curve and cost.

    python bench/experiments/e2e_demo.py -c /tmp/e2e/heal.toml [--json out.json]

Runs (or finds cached) what `e2e:<variant>` needs (traces, dumps, the per-layer units, the
assembly) and the stage itself, without evaluating, then prints per variant the KL at step 0, at
the kept step and at the last step on the unseen trace (held-out) and the calibration probe
(in-sample), and the stage's CPU seconds from its curve (the tuning loop) and its wall seconds
from its provenance record. Point it at a copy of demo/heal.toml with its own `[lake] root` and
only the variants to measure: the demo's own lake is left alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.heal import HealRun  # noqa: E402
from moeheal.pipeline.stages.e2e import CURVE_FILE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run = HealRun(load_config(args.config, peers_may_be_missing=True))
    run.overlap()
    out = []
    for variant in (v for v in run.cfg.healed_variants if v.e2e):
        result = run.result(run.e2e(variant))
        curve = pq.read_table(result.path / CURVE_FILE).to_pylist()
        record = json.loads(run.lake.provenance_path(result.fingerprint).read_text())
        unseen = [r for r in curve if r["split"] == "unseen"]
        kept = min(unseen, key=lambda r: (r["kl"], r["step"]))["step"]
        for split in ("unseen", "calibration"):
            pts = {r["step"]: r for r in curve if r["split"] == split}
            last = max(pts)
            row = {"variant": variant.name, "split": split, "tokens": pts[0]["tokens"], "kl_step0": pts[0]["kl"],
                   "kept_step": kept, "kl_kept": pts[kept]["kl"], "last_step": last, "kl_last": pts[last]["kl"],
                   "change_pct": 100 * (pts[kept]["kl"] / pts[0]["kl"] - 1),
                   "tuning_cpu_s": pts[last]["seconds"], "stage_wall_s": record["finished"] - record["started"]}
            out.append(row)
            print(json.dumps(row), flush=True)
        print("curve (step: unseen / calibration probe): " + ", ".join(
            f"{r['step']}: {r['kl']:.5f} / {c['kl']:.5f}" for r, c in zip(
                unseen, [r for r in curve if r["split"] == "calibration"])), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
