"""Choose the e2e learning rates on the unseen trace: a grid of (e2e_lr, e2e_scale_lr) per e2e variant.

    python bench/experiments/e2e_sweep.py -c demo/heal.toml [--steps 40] [--lr 0.002,0.004] \
        [--scale-lr 0,0.0005,0.002] [--json out.json]

For every `e2e = true` variant of the config, the assembled GGUF the e2e stage would tune (run or
found cached, nothing after it) is tuned once per grid point with the stage's own `tune`, and the
table prints, per point, the unseen trace's KL at step 0 and at the kept step (the lowest measured,
as the stage keeps), the kept step, and the calibration probe's KL there (in-sample). The
reference's log-probabilities over both traces are computed once and shared by every point.

The unseen trace is what the stage selects its step on and what the defaults are chosen on; the
evaluation windows are never read here, so choosing `E2E_LR` / `E2E_SCALE_LR` from this table
and confirming once on eval keeps eval out of the choice. Because both the kept step and the grid
point are picked on the same trace, the kept KL is optimistic: the eval windows give the
unbiased gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.gguf.model import open_model  # noqa: E402
from moeheal.pipeline.heal import HealRun  # noqa: E402
from moeheal.pipeline.data.documents import trace_tokens  # noqa: E402
from moeheal.pipeline.model.tuner import Trace, Tuner  # noqa: E402
from moeheal.pipeline.stages.e2e import E2EParams, tune  # noqa: E402


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=floats, default=[0.002], help="e2e_lr values (norms, routers)")
    parser.add_argument("--scale-lr", type=floats, default=[0.0, 0.0005, 0.002], help="e2e_scale_lr values")
    parser.add_argument("--variants", default="", help="comma-separated e2e variants (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run = HealRun(load_config(args.config, peers_may_be_missing=True))
    run.overlap()
    wanted = [v for v in run.cfg.healed_variants if v.e2e]
    if args.variants:
        wanted = [v for v in wanted if v.name in args.variants.split(",")]
    traces = run.result(run.traces()).path
    rows = []
    print("| variant | e2e_lr | e2e_scale_lr | unseen KL step 0 | kept step | unseen KL kept | change | "
          "calibration probe KL kept | CPU s |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for variant in wanted:
        topk = run.result(run.reference_topk(min(variant.e2e_topk, run.reference.hp.vocab_size))).path
        calibration, unseen = (Trace(*trace_tokens(traces, name), run.cfg.seq_tokens, topk, name)
                               for name in ("calibration", "unseen"))
        tuner = Tuner(open_model(run.result(run.assemble(variant)).path), run.source)
        for lr in args.lr:
            for scale_lr in args.scale_lr:
                params = dataclasses.replace(E2EParams.of(variant, run.cfg.seq_tokens), steps=args.steps, lr=lr,
                                             scale_lr=scale_lr)
                started = time.process_time()
                _, curve = tune(tuner, calibration, unseen, params, log=lambda m: None)
                seconds = time.process_time() - started
                held = {r["step"]: r["kl"] for r in curve if r["split"] == "unseen"}
                probe = {r["step"]: r["kl"] for r in curve if r["split"] == "calibration"}
                kept = min(held, key=lambda s: (held[s], s))
                row = {"variant": variant.name, "e2e_lr": lr, "e2e_scale_lr": scale_lr, "steps": args.steps,
                       "unseen_step0": held[0], "kept_step": kept, "unseen_kept": held[kept],
                       "change_pct": 100 * (held[kept] / held[0] - 1), "probe_kept": probe[kept],
                       "cpu_s": seconds, "unseen_curve": [held[s] for s in sorted(held)]}
                rows.append(row)
                print(f"| {variant.name} | {lr:g} | {scale_lr:g} | {held[0]:.5f} | {kept} | {held[kept]:.5f} | "
                      f"{row['change_pct']:+.2f}% | {probe[kept]:.5f} | {seconds:.0f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
