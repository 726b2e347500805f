"""Learned rounding's settings on a config's own layer: the held-out and unseen curve of each setting.

    python bench/experiments/learned_settings.py -c heal.toml --layer 1 --format q2_k \
        '{"steps": 32, "batch_tokens": 256, "lr": 0.01, "sub_lr": 0.01, "scale_lr": 0.001, "optimizer": "adam"}' ...

Builds (or finds in the config's lake) the calibration and unseen dumps, rounds
the layer's routed experts with GPTQ (`--start ls`: the importance-weighted
least-squares search GPTQ refines, about a quarter of its cost) and the config's
first variant's knobs (its `quant` replaced by --format), then runs `kernels.learned.learn_layer`
once per JSON setting (`learned.Settings` fields but `eval_every`, which is
steps / 8) on the first 7/8 of the calibration rows, the last 1/8 held out as
the pipeline holds them out, and measures the unseen dump at every held-out
measurement. Prints per setting the held-out and unseen relative errors of
the layer's routed output at steps 0, s/8, ..., s, and the mean training-batch
error of the first and last 5 steps. Used to choose the pipeline's settings
(docs/learned-rounding.md): the unseen dump decides, the evaluation windows
are never read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--format", default="q2_k")
    parser.add_argument("--start", choices=("gptq", "ls"), default="gptq",
                        help="the rounding learned rounding starts from (the pipeline's: gptq)")
    parser.add_argument("settings", nargs="+", help="JSON objects of learned.Settings fields")
    args = parser.parse_args()

    from moeheal.kernels import encode
    from moeheal.kernels import learned
    from moeheal.pipeline.config import load_config
    from moeheal.pipeline.heal import HealRun
    from moeheal.pipeline.stages import quantize as Q
    from moeheal.pipeline.data.dumps import open_dump, read_layer

    cfg = load_config(args.config)
    run = HealRun(cfg, log=lambda line: print(line, file=sys.stderr))
    model = run.source
    cal = open_dump(run.result(run.dump("calibration")).path, model.hp, model.moe_layers)
    unseen = open_dump(run.result(run.dump("unseen")).path, model.hp, model.moe_layers)
    variant = dataclasses.replace(cfg.healed_variants[0], quant=args.format, round="gptq")
    params = Q.QuantizeParams.of(variant)
    weights = Q.expert_weights(model, args.layer)
    plan = Q.importance_plan(weights, cal, args.layer, params)
    raw = {name: encode.quantize_experts(w, args.format, plan[name][0], plan[name][1] if args.start == "gptq" else None)
           for name, w in weights.items()}
    tensors = {name: learned.LearnedTensor(args.format, tuple(w.shape), raw[name]) for name, w in weights.items()}
    rows = read_layer(cal[str(args.layer)], slice(None))
    cut = len(rows["mixed"]) - len(rows["mixed"]) // Q.LEARNED_HOLDOUT
    data = Q.token_set(model, args.layer, rows, shared=False)
    extra = {"unseen": Q.token_set(model, args.layer, read_layer(unseen[str(args.layer)], slice(None)), shared=False)}
    for text in args.settings:
        knobs = json.loads(text)
        settings = learned.Settings(eval_every=max(1, knobs["steps"] // Q.LEARNED_EVALS), **knobs)
        start = time.perf_counter()
        _, curve = learned.learn_layer(tensors, {}, data.take(np.arange(cut)),
                                       data.take(np.arange(cut, len(rows["mixed"]))), settings, extra,
                                       measure_extra=True)
        seconds = time.perf_counter() - start
        held = [round(r["loss"], 5) for r in curve if r["split"] == "heldout"]
        unseen_loss = [round(r["loss"], 5) for r in curve if r["split"] == "unseen"]
        train = [r["loss"] for r in curve if r["split"] == "train"]
        print(f"{args.format} layer {args.layer}, {args.start} start, {knobs}: {seconds:.0f} s (compilation included); held-out "
              f"{held}; unseen {unseen_loss}; train batches {np.mean(train[:5]):.4f} -> {np.mean(train[-5:]):.4f}",
              flush=True)


if __name__ == "__main__":
    main()
