"""The real-size record: runs of `bench/speed/bench_real_size.py --json` at several depths, one model
shape, joined and extrapolated to the real model's depth.

    python bench/tools/real_size_record.py RUN.json [RUN.json ...] --out bench/results/real-size/qwen3-30b-a3b.json

Each run heals some variants of a synthetic model of `layers` layers (random weights of the real shapes:
time and memory, never quality). Every stage's wall time is linear in the depth (a per-layer unit runs once
per layer, a forward pass such as a dump or the reference's top-k crosses every layer, an e2e step sweeps
them twice), so per stage kind the runs that share a variant set give `wall = fixed + per_layer x layers`
by least squares over their depths (the stages that never read a layer, `DEPTH_FREE`, their mean; with one depth, the proportional `wall / layers x layers`, which
charges compilation to every layer and so overstates), evaluated at the real depth and labelled as
extrapolated. A stage kind that runs of several variant sets measured (the shared ones, or one variant's
in a one-variant run and in a ladder run) takes the fit over the most depths. A stage kind belongs to the variant its label names (`quantize:<variant>:<layer>`,
`e2e:<variant>`); the unhealed baseline's stages, which every run builds, belong to no total; the rest
(corpus, traces, dumps, the reference's top-k, audit) are shared. `total_s` is the first variant's whole
heal from the source GGUF to its evaluated file (its stages and the shared ones), `recipe_total_s` the
second's, `ladder_total_s` every variant's stages with the shared ones once.

A run with shard workers (`--shards N`, what `heal --workers N` runs) built its dumps and every per-layer
unit in the workers' phase, which is the stage kind `shard workers` here (shared: the unhealed baseline's
units are in it too, so its totals are an upper bound); the units it left for the heal are cache hits.

Memory and utilisation are the runs' own figures (the largest over runs for the peaks; utilisation from
the deepest run of the first variant, over its heal phase). Beside them, where the runs kept each stage's
count of GPU samples and of busy ones (`busy_samples`, `samples`), `gpu_busy_fraction_extrapolated`: those
counts fitted in depth per stage kind as the wall times are and summed over the first variant's heal at the
real depth (a deep heal compiles once and spends its time in the per-layer stages, so its share of busy
samples differs from a shallow run's); likewise `gpu_util_mean_extrapolated` from each stage's device-busy
seconds (its samples' utilisation summed) over its wall time. Labelled extrapolated, the measured figures
beside them. `gpu_by_variant` holds the same figures per variant healed alone in some runs, from those runs
only (its shared stages as they measured them): the recipe's runs keep the counts where `q2_k`'s do not,
so beside them `gpu_busy_fraction_whole_runs` fits each run's whole-heal share instead (`whole_run_share`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

BASELINE = "unhealed"
GB = 1e9
# Stages that never read the model's layers (the text, its split and windows, the audit's SQL): their time
# does not follow the depth, so their mean over runs is kept, not a line whose slope is noise.
DEPTH_FREE = ("corpus", "traces", "windows", "audit")
SHARD_PHASE = "shard workers"  # a run's `shard_phase_s` as a stage kind
# A stage's line in the bench's log: its stamp (seconds since the heal began), label and what it did.
LOG_STAGE = re.compile(r"^\s*(?P<t>[0-9.]+) s  \[(?P<label>[^\]]+)\] (?P<what>computing|cache hit) ")


def stage_kind(label: str, variants: list[str]) -> str:
    """A stage label's kind: its stage, with the variant it names (`quantize:<variant>:<layer>` ->
    `quantize:<variant>`, `e2e:<variant>`); a stage of no variant by its stage alone (`reference-topk:1024:unseen`
    -> `reference-topk`, `dump:calibration` -> `dump`). `variants` holds the baseline too."""
    stage, *rest = label.split(":")
    named = [part for part in rest if part in variants]
    return f"{stage}:{named[0]}" if named else stage


def _legacy_kind(label: str) -> str:
    """The kind runs made before `stage_kind`: the layer dropped, else the stage alone (so `e2e:<variant>`
    of several variants fell into one `e2e`)."""
    parts = label.split(":")
    return ":".join(parts[:-1]) if len(parts) > 2 and parts[-1].isdigit() else parts[0]


def relabelled(run: dict, log: str) -> dict:
    """A run written before its stage kinds kept their variant, with `per_stage_s` rebuilt from its log's
    stage lines by `stage_kind` (each stage from its `computing` line to the next stage line, as the bench
    timed it) and checked against the run's own sums; each kind's GPU figures carried over where its old
    kind held it alone (besides the baseline's)."""
    names = [*run["variants"], BASELINE]
    stamps = [(float(m["t"]), m["label"], m["what"]) for line in log.splitlines() if (m := LOG_STAGE.match(line))]
    walls: dict[str, float] = defaultdict(float)
    legacy: dict[str, float] = defaultdict(float)
    intervals: dict[str, int] = defaultdict(int)
    became: dict[str, set[str]] = defaultdict(set)
    for i, (t, label, what) in enumerate(stamps):
        if what != "computing":
            continue
        seconds = (stamps[i + 1][0] if i + 1 < len(stamps) else run["heal_s"]) - t
        kind, old = stage_kind(label, names), _legacy_kind(label)
        walls[kind] += seconds
        legacy[old] += seconds
        intervals[old] += 1
        if owner(kind, run["variants"]) != BASELINE:
            became[old].add(kind)
    for old, seconds in run["per_stage_s"].items():  # each interval's two stamps are rounded to 0.1 s
        if abs(legacy.get(old, 0.0) - seconds) > 0.1 * intervals[old] + 0.05:
            raise ValueError(f"{run['json']}: {old} sums to {legacy.get(old, 0.0):.1f} s in the log, "
                             f"{seconds:.1f} s in the run")
    split = {kind: run["per_stage_split"][old] for old, kinds in became.items() if len(kinds) == 1
             for kind in kinds if old in run.get("per_stage_split", {})}
    return {**run, "per_stage_s": dict(walls), "per_stage_split": split}


def owner(kind: str, variants: list[str]) -> str | None:
    """The variant a stage kind's label names, BASELINE for the unhealed baseline's, None when shared."""
    parts = kind.split(":")
    for name in [*variants, BASELINE]:
        if name in parts:
            return name
    return None


def fit_depth(walls: dict[int, float]) -> dict[str, float]:
    """`fixed + per_layer x layers` through the (layers, wall) points by least squares; with one point,
    the line through the origin."""
    layers = np.array(sorted(walls), np.float64)
    wall = np.array([walls[int(n)] for n in layers], np.float64)
    if len(layers) == 1:
        return {"fixed_s": 0.0, "per_layer_s": float(wall[0] / layers[0])}
    per_layer, fixed = np.polyfit(layers, wall, 1)
    return {"fixed_s": float(fixed), "per_layer_s": float(per_layer)}


def fit_stages(members: list[dict], variants: list[str], depth: int) -> dict[str, dict]:
    """Each stage kind of one variant set's runs (`members`, at several depths), the baseline's left out:
    its measured walls, the line through them, the wall at `depth`, and the GPU's figures fitted as the
    wall is (device-busy seconds and the 1-second samples' counts, where every run kept them)."""
    stages: dict[str, dict] = {}
    for kind in sorted({k for run in members for k in run["per_stage_s"]}):
        who = owner(kind, variants)
        if who == BASELINE:
            continue
        walls = {run["layers"]: run["per_stage_s"][kind] for run in members if kind in run["per_stage_s"]}
        fit = ({"fixed_s": float(np.mean(list(walls.values()))), "per_layer_s": 0.0} if kind in DEPTH_FREE
               else fit_depth(walls))
        entry = {"variant": who, "measured_s": {str(n): s for n, s in sorted(walls.items())}, **fit,
                 "wall_s": fit["fixed_s"] + fit["per_layer_s"] * depth}
        splits = {run["layers"]: run.get("per_stage_split", {}).get(kind, {}) for run in members
                  if kind in run["per_stage_s"]}
        for key in ("device_busy_s", "busy_samples", "samples"):
            if all(key in split for split in splits.values()):
                points = {n: split[key] for n, split in splits.items()}
                line = ({"fixed_s": float(np.mean(list(points.values()))), "per_layer_s": 0.0}
                        if kind in DEPTH_FREE else fit_depth(points))
                entry[key] = max(0.0, line["fixed_s"] + line["per_layer_s"] * depth)
        deepest = max(members, key=lambda run: run["layers"])
        if kind in deepest.get("per_stage_split", {}):
            entry["split_at_deepest"] = deepest["per_stage_split"][kind]
        stages[kind] = entry
    return stages


def gpu_shares(stages: list[dict]) -> dict[str, float]:
    """`gpu_util_mean_extrapolated` (%) and `gpu_busy_fraction_extrapolated` of a heal's fitted stages: the
    summed device-busy seconds over the summed wall, the summed busy samples over the summed samples;
    each only where every stage has both of its figures."""
    out = {}
    for name, part, whole, scale in (("gpu_util_mean_extrapolated", "device_busy_s", "wall_s", 100.0),
                                     ("gpu_busy_fraction_extrapolated", "busy_samples", "samples", 1.0)):
        if stages and all(part in e and whole in e for e in stages):
            out[name] = scale * sum(e[part] for e in stages) / max(sum(e[whole] for e in stages), 1e-9)
    return out


def whole_run_share(members: list[dict], depth: int) -> dict[str, float]:
    """`gpu_busy_fraction_whole_runs`: the share of busy 1-second samples at `depth` from runs that kept
    only their whole heal's share (`gpu_busy_fraction`), not each stage's counts: the busy samples
    (share x heal seconds, the sampler taking one a second) and the heal's seconds, each fitted in depth
    and evaluated there. Coarser than the per-stage fit: the baseline's units are in both."""
    points = [run for run in members if run.get("gpu_busy_fraction") is not None]
    if len({run["layers"] for run in points}) < 2:
        return {}
    busy = fit_depth({run["layers"]: run["gpu_busy_fraction"] * run["heal_s"] for run in points})
    heal = fit_depth({run["layers"]: run["heal_s"] for run in points})
    return {"gpu_busy_fraction_whole_runs": (busy["fixed_s"] + busy["per_layer_s"] * depth)
            / (heal["fixed_s"] + heal["per_layer_s"] * depth)}


def join_runs(runs: list[dict], depth: int) -> dict:
    """The record of `runs` (bench_real_size figures, each with its `json` path) extrapolated to `depth`."""
    runs = [{**run, "per_stage_s": {**run["per_stage_s"], SHARD_PHASE: run["shard_phase_s"]}}
            if "shard_phase_s" in run else run for run in runs]
    groups: dict[tuple[str, ...], list[dict]] = defaultdict(list)
    for run in runs:
        groups[tuple(run["variants"])].append(run)
    order = list(dict.fromkeys(v for run in runs for v in run["variants"]))
    stages: dict[str, dict] = {}
    for variants, members in groups.items():
        for kind, entry in fit_stages(members, list(variants), depth).items():
            # a stage measured by several groups (a shared one, or a variant's in runs of several variant
            # sets): the fit over the most depths, the first group's where they tie
            if kind not in stages or len(entry["measured_s"]) > len(stages[kind]["measured_s"]):
                stages[kind] = entry

    def shared_by(name: str) -> set[str]:
        """The shared stage kinds `name`'s heal runs: those its runs' `needs` name, else those its runs of
        itself alone measured, else every shared kind (a ladder's guidance belongs to its recipe alone)."""
        needs = [set(r["needs"][name]) for r in runs if name in r.get("needs", {})]
        alone = [set(r["per_stage_s"]) for r in runs if r["variants"] == [name]]
        every = {kind for kind, e in stages.items() if e["variant"] is None}
        return every & set.union(*(needs or alone)) if needs or alone else every

    def mine(names: list[str]) -> list[dict]:
        shared = set().union(*(shared_by(name) for name in names))
        return [e for kind, e in stages.items() if e["variant"] in names or (e["variant"] is None and kind in shared)]

    def total(names: list[str], key: str = "wall_s") -> float:
        return sum(e[key] for e in mine(names))

    # each variant healed alone (runs of it and no other): its heal's GPU figures from those runs only, the
    # shared stages as they measured them (the record's stages may take a shared kind from another group)
    alone_gpu = {}
    for name in order:
        alone = groups.get((name,), [])
        if alone:
            deepest = max(alone, key=lambda run: run["layers"])
            alone_gpu[name] = {"gpu_busy_fraction": deepest.get("gpu_busy_fraction"),
                               "gpu_util_mean": deepest.get("gpu_util_mean"), "layers": deepest["layers"],
                               **gpu_shares(list(fit_stages(alone, [name], depth).values())),
                               **whole_run_share(alone, depth)}

    first = [r for r in runs if order[0] in r["variants"]]
    deepest_first = max(first, key=lambda run: run["layers"])
    record = {
        "like": runs[0]["like"], "extrapolated_to": depth, "calibration_tokens": runs[0]["calibration_tokens"],
        "unseen_tokens": runs[0].get("unseen_tokens"),
        "label": f"extrapolated linearly in depth from {sorted({r['layers'] for r in runs})} layers to {depth}",
        "device": runs[0].get("device_kind") or runs[0]["device"],
        "variants": order,
        "layers_measured": sorted({r["layers"] for r in runs}),
        "stages": stages,
        "total_s": total(order[:1]),
        **({"recipe_total_s": total(order[1:2])} if len(order) > 1 else {}),
        "ladder_total_s": total(order),
        "gpu_peak_gb": max((r.get("device_peak_bytes") or 0) for r in runs) / GB or None,
        "nvidia_smi_peak_gb": max((r.get("nvidia_smi_peak_mib") or 0) for r in runs) * 2**20 / GB or None,
        "host_rss_gb": max((r.get("heal_peak_anon_bytes") or 0) for r in runs) / GB or None,
        "gpu_util_mean": deepest_first.get("gpu_util_mean"),
        "gpu_busy_fraction": deepest_first.get("gpu_busy_fraction"),
        **gpu_shares(mine(order[:1])),
        "gpu_by_variant": alone_gpu,
        "runs": [{"layers": r["layers"], "variants": r["variants"], "command": r.get("command"),
                  "json": r["json"], "log": r["json"].replace(".json", ".log"), "heal_s": r["heal_s"],
                  "stopped": r.get("stopped", False)} for r in runs],
    }
    return record


def load_run(path: Path | str, root: Path = Path(".")) -> dict:
    """A bench_real_size JSON (`json`: its path as given), relabelled from its log beside it when it was
    written before the bench kept each stage's variant and each variant's `needs`."""
    run = {**json.loads((root / path).read_text()), "json": str(path)}
    return run if "needs" in run else relabelled(run, (root / path).with_suffix(".log").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench_real_size.py --json files")
    parser.add_argument("--depth", type=int, help="the depth to extrapolate to (default: the runs' real_layers)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [load_run(p) for p in args.runs]
    record = join_runs(runs, args.depth or runs[0]["real_layers"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['label']} on {record['device']}:")
    for kind, e in sorted(record["stages"].items(), key=lambda kv: -kv[1]["wall_s"]):
        print(f"  {kind:44s} {e['wall_s']:8.1f} s  ({e['fixed_s']:.1f} + {e['per_layer_s']:.2f} / layer)")
    for key in ("total_s", "recipe_total_s", "ladder_total_s"):
        if key in record:
            print(f"{key}: {record[key] / 60:.1f} min")
    if "gpu_util_mean_extrapolated" in record:
        print(f"GPU utilisation {record['gpu_util_mean']:.1f}% on average over the deepest run; extrapolated to "
              f"{record['extrapolated_to']} layers: {record['gpu_util_mean_extrapolated']:.1f}%")
    if "gpu_busy_fraction_extrapolated" in record:
        print(f"GPU busy in {record['gpu_busy_fraction']:.1%} of the deepest run's samples; extrapolated to "
              f"{record['extrapolated_to']} layers: {record['gpu_busy_fraction_extrapolated']:.1%}")
    for name, gpu in record["gpu_by_variant"].items():
        if "gpu_busy_fraction_whole_runs" in gpu:
            print(f"{name} alone: GPU busy in {gpu['gpu_busy_fraction_whole_runs']:.1%} of the samples at "
                  f"{record['extrapolated_to']} layers, extrapolated from its runs' whole-heal shares")
        if "gpu_busy_fraction_extrapolated" in gpu:
            print(f"{name} alone: GPU busy in {gpu['gpu_busy_fraction']:.1%} of its {gpu['layers']}-layer run's "
                  f"samples; extrapolated to {record['extrapolated_to']} layers from its own runs: "
                  f"{gpu['gpu_busy_fraction_extrapolated']:.1%} (mean utilisation "
                  f"{gpu['gpu_util_mean_extrapolated']:.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
