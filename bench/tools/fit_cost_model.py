"""Fit the constants of `moeheal plan --estimate` (pipeline/estimate.py) to committed timing records.

    python bench/tools/fit_cost_model.py                        # the default records below -> moeheal/data/cost_model.json
    python bench/tools/fit_cost_model.py 'bench/results/h200-*/rs*.json' 'bench/results/real-size/runs/rs*.json' \\
        'bench/results/demo-cpu*/stage_times.csv'               # records named by path or glob
    python bench/tools/fit_cost_model.py h100='runs/a.json'     # a record's device class named, not read from its path
    python bench/tools/fit_cost_model.py --holdout              # each record predicted from the others: the error
    python bench/tools/fit_cost_model.py --predict bench/results/h200-65k/rs65k.json --layers 48
                                                                # a record's stages at the real model's 48 layers

A record is either the `--json` of bench/speed/bench_real_size.py (per stage kind `per_stage_s`, the
model `like`, its `layers`, `calibration_tokens`; `experts` and `vocab` where the record has them, else
the real model's, which every committed record ran with) or a demo heal's stage_times.csv
(bench/tools/stage_times.py: units and seconds per stage) with `demo-heal.toml` beside it, the demo's
config of that run (its [calibration], [moce] and [[variant]] tables say how many quantize units each
rounding had and what each unit read). Its device class (h200, h100, cpu) is the prefix `CLASS=`, else
the first of them in the record's `device_kind` or `device` field ("NVIDIA H100 80GB HBM3", "TFRT_CPU_0"),
else in its path.

An observation is a stage kind's seconds in one record (a per-layer kind's: per variant, and where the
record's log is beside it, same stem, .log, the first unit of each rounding, which compiles, apart from
the rest) against the size and work of its invocations (pipeline/estimate.py). The constants of a device class (per cost-model key: once, per
1e9 weights, per 1e12 weight-tokens) are the non-negative least squares fit of its observations,
each row weighted by 1 / its seconds (so a 2-second stage counts as much as a 200-second one in
relative terms). The records fitted are written into the output beside the constants.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import re
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from moeheal.pipeline import estimate
from moeheal.pipeline.config import UNHEALED, Variant, _variant, e2e_schedule
from moeheal.pipeline.estimate import Invocation, Shapes, codebook, e2e_key, invocation, rounding_key
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.sources.synth import LIKE
from moeheal.pipeline.stages.sensitivity import SensitivityParams

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "demo"
OUT = REPO / "moeheal" / "data" / estimate.COST_MODEL
# The GPU records are the Qwen3-30B-A3B shape's only: the demo's run on an H200 (demo-h200) is kept out,
# its stages' time being mostly the fixed cost of a tiny model, which the rates would carry to the 30B shape;
# so is h200-levers/rs_levers.json, run on a lake with some units cached, whose clock charged two computed
# healed dumps to other stages (its README). The H100's are the current code's three depths (real-size/runs/
# rs10_*, and the recipe's three depths fb_l2-fb_l4, which price its sensitivity, guidance and i-quant units;
# fa_l2-fa_l4 are the recipe before sensitivity's FIT_ROWS and e2e's and learned rounding's programs
# compiled ahead, sp_l2-sp_l4 before the search's candidate scales at once and sensitivity per layer, and
# rc_l2/rc_l3 before learned rounding compiled per (format, shape), its per-layer compile priced as work;
# rs9_* and rs8_* are earlier codes on other H100 machines); its earlier rs_l2/rs_l3 ran before XLA's Triton GEMM autotuning was turned off, the calibrate
# unit's sums moved to the device and the dump ran layer by layer, 2-2.5x slower per stage, so a fit over
# both priced neither.
DEFAULT_RECORDS = ("bench/results/h200-65k/rs*.json", "bench/results/h200-budget/rs*.json",
                   "bench/results/h200-levers/rs_levers2.json", "bench/results/h100-*/rs*.json",
                   "bench/results/real-size/runs/rs10_*.json", "bench/results/real-size/runs/fb_l*.json",
                   "bench/results/demo-cpu*/stage_times.csv")
ONCE_PENALTY = 0.1  # see `fit`
SIZE_PENALTY = 0.03  # see `fit`
SEQ_TOKENS = 512  # the bench's and the demo's sequence length


@dataclass(frozen=True)
class Observation:
    """One stage kind's measured seconds in one record, and what it computed."""

    record: str
    stage: str
    seconds: float
    invocations: tuple[Invocation, ...]
    once: bool = True  # whether its stage kinds' `once` is in it (not for the units after a kind's first)


# ---- records ------------------------------------------------------------------------------------
def device_class(spec: str) -> tuple[str | None, str]:
    """(class, glob) of a `CLASS=GLOB` argument; the class None where it is read from each path."""
    head, sep, tail = spec.partition("=")
    return (head, tail) if sep and head in estimate.DEVICES else (None, spec)


def class_of(path: Path, name: str) -> str:
    """The device class a record names in its `device_kind` or `device` field, else its path (`name`) does."""
    fields = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else {}
    for text in (f"{fields.get('device_kind', '')} {fields.get('device', '')}".lower(), name.lower()):
        found = [d for d in estimate.DEVICES if d in text]
        if found:
            return min(found, key=text.index)
    raise SystemExit(f"{name}: no device class ({', '.join(estimate.DEVICES)}) in its device fields or path; "
                     "name it CLASS=PATH")


def variants_of(tables: list[dict]) -> list[Variant]:
    """The healed [[variant]] tables as the config reads them (an outside GGUF's are left out)."""
    return [_variant(Path("record"), REPO, i, t, peers_may_be_missing=True)
            for i, t in enumerate(tables) if "gguf" not in t]


def bench_variants() -> dict[str, Variant]:
    """bench_real_size's variants by name, from its config tables."""
    sys.path.append(str(REPO))  # run as a script: the repository's bench package
    from bench.speed.bench_real_size import VARIANTS

    return {name: variants_of(tomllib.loads(text)["variant"])[0] for name, text in VARIANTS.items()}


def e2e_steps(variant: Variant, cal_tokens: int) -> int:
    """The steps an e2e variant runs (`e2e_steps = 0`: one pass, as the config resolves it)."""
    return variant.e2e_steps or e2e_schedule(variant.cal_tokens or cal_tokens, SEQ_TOKENS, variant.e2e_batch_seqs)


LOG_LINE = re.compile(r"([\d.]+) s  \[(?P<label>[^\]]+)\] (?:computing|cache hit) ")


def log_durations(path: Path) -> dict[str, float]:
    """{label: seconds} of a bench_real_size log (its stamped stage lines: each to the next one's); empty
    where there is no log. The last stage has no next line: left out."""
    if not path.exists():
        return {}
    stamps = [(float(m.group(1)), m.group("label")) for line in path.read_text(encoding="utf-8").splitlines()
              if (m := LOG_LINE.search(line))]
    return {label: stamps[i + 1][0] - t for i, (t, label) in enumerate(stamps[:-1])}


def per_label_observations(units: dict[str, list[tuple[str, Invocation]]], seconds_of: dict[str, float],
                           logged: dict[str, float], name: str) -> list[Observation]:
    """The per-layer labels' observations (`quantize:gptq_q2_k`: its units, (unit label, invocation) each).
    A key's `once` (its programs compiled) is in the observation of its first unit in run order: that unit
    alone where the log times it, else its label's. The units after it are observations without it."""
    order = list(logged)
    ranked = sorted(((order.index(u) if u in order else len(order), label, u, inv)
                     for label, members in units.items() for u, inv in members), key=lambda t: t[0])
    first: dict[str, tuple[str, str]] = {}  # key -> (label, unit label)
    for _, label, unit, inv in ranked:
        first.setdefault(inv.key, (label, unit))
    out = []
    for label, members in units.items():
        head = [(u, inv) for u, inv in members if first[inv.key] == (label, u)]
        if head and head[0][0] in logged:  # its first unit apart: the compile, then the rest without it
            out.append(Observation(name, label, logged[head[0][0]], (head[0][1],)))
            rest = tuple(inv for u, inv in members if u != head[0][0])
            if rest:
                out.append(Observation(name, label, seconds_of[label] - logged[head[0][0]], rest, once=False))
        else:
            out.append(Observation(name, label, seconds_of[label], tuple(inv for _, inv in members), once=bool(head)))
    return out


def bench_observations(path: Path, name: str) -> list[Observation]:
    """A bench_real_size record: each stage kind of `per_stage_s`, its invocations from the label, the
    bench's config (variants, 1/4 of the calibration tokens unseen) and the synthetic model's shapes;
    where its log is beside it (same stem, .log), each per-layer kind's first units apart."""
    return record_observations(json.loads(path.read_text(encoding="utf-8")), name, log_durations(path.with_suffix(".log")))


def record_observations(record: dict, name: str, logged: dict[str, float]) -> list[Observation]:
    """`bench_observations` of a record read, with its log's {label: seconds} (empty: none)."""
    hp, layers, tokens = LIKE[record["like"]].hp, record["layers"], record["calibration_tokens"]
    shapes = Shapes(layers, record.get("experts", hp.n_expert), hp.n_expert_used, hp.d_model, hp.d_expert,
                    record.get("vocab", hp.vocab_size))
    unseen = record.get("unseen_tokens") or max(512, tokens // 4)  # the bench's default before it recorded it
    known = {**bench_variants(), UNHEALED.name: UNHEALED}
    used = [known[label.split(":")[1]] for label in record["per_stage_s"] if label.startswith("quantize:")]
    budget = [v for v in used if v.budgeted]
    per_layer: dict[str, list[tuple[str, Invocation]]] = {}
    grouped: dict[str, list[tuple[float, list[Invocation]]]] = defaultdict(list)
    for label, secs in record["per_stage_s"].items():
        stage, _, rest = label.partition(":")
        variant = known.get(rest)
        if stage in estimate.PER_LAYER:
            key = (rounding_key(variant.round, variant.importance, codebook(variant.candidate_formats()))
                   if stage == "quantize" else stage)
            per_layer[label] = [(f"{label}:{layer}", invocation(key, shapes, tokens)) for layer in range(layers)]
        elif stage == "dump":
            grouped[stage].append((secs, [invocation(stage, shapes, tokens), invocation(stage, shapes, unseen)]))
        elif stage == "assemble":  # `assemble:<variant>`, or the kind alone over every variant the run built
            grouped[stage].append((secs, [invocation(stage, shapes)] * (1 if variant is not None else len(used))))
        elif stage == "reference-topk":
            grouped[stage].append((secs, [invocation(stage, shapes, unseen if rest.endswith("unseen") else tokens + unseen)]))
        elif stage == "guidance":
            grouped[stage].append((secs, [invocation(stage, shapes, unseen if budget else tokens)]))
        elif stage == "sensitivity":
            grouped[stage].append((secs, [invocation(stage, shapes, unseen, formats=len(v.candidates)) for v in budget]))
        elif stage == "e2e":  # `e2e:<variant>`, or the kind alone over every e2e variant the run healed
            tuned = [variant] if variant is not None else [v for v in used if v.e2e]
            grouped[stage].append((secs, [invocation(e2e_key(codebook(v.candidate_formats())), shapes,
                                                     e2e_steps(v, tokens) * SEQ_TOKENS * v.e2e_batch_seqs)
                                          for v in tuned]))
        else:
            grouped[stage].append((secs, [invocation(stage, shapes)]))
    return [Observation(name, stage, sum(s for s, _ in parts), tuple(i for _, invs in parts for i in invs))
            for stage, parts in grouped.items()] + per_label_observations(per_layer, record["per_stage_s"], logged, name)


def demo_observations(path: Path, name: str) -> list[Observation]:
    """A demo heal's stage_times.csv: each stage's units, with the quantize units split by rounding as
    the run's config (`demo-heal.toml` beside it) has them, on the demo model's shapes."""
    config = tomllib.loads((path.parent / "demo-heal.toml").read_text(encoding="utf-8"))
    cal, moce = config["calibration"], config.get("moce", {})
    tokens, unseen = cal["tokens"], cal.get("unseen_tokens", 0)
    model = open_model(DEMO / config["model"]["reference"])
    shapes = estimate.shapes_of(model)
    healed = variants_of(config["variant"])
    distinct = {json.dumps(v.knobs(), sort_keys=True): v for v in healed}  # a unit serves every variant with its knobs
    per_round: dict[str, int] = defaultdict(int)
    for v in [UNHEALED, *distinct.values()]:
        per_round[rounding_key(v.round, v.importance, codebook(v.candidate_formats()))] += shapes.n_moe
    evaluated = sum(int(r["ctx_tokens"]) + int(r["scored_tokens"])
                    for r in csv.DictReader(open(DEMO / "windows.csv", newline="", encoding="utf-8")))
    tuned = [invocation(e2e_key(codebook(v.candidate_formats())), shapes, e2e_steps(v, tokens) * SEQ_TOKENS)
             for v in distinct.values() if v.e2e]  # an e2e stage per distinct tuned variant
    formats = [len(v.candidates) for v in healed if v.budgeted] or [0]
    measured = []  # the distinct sensitivity measurements: a unit of each (before, one) per MoE layer
    for v in (v for v in healed if v.budgeted):
        if SensitivityParams.of(v, model.arch) not in measured:
            measured.append(SensitivityParams.of(v, model.arch))
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            stage, units = row["stage"], int(row["units"])
            if stage == "quantize":
                invs = [invocation(key, shapes, tokens) for key, n in per_round.items() for _ in range(n)]
            elif stage == "dump":
                invs = [invocation(stage, shapes, tokens), invocation(stage, shapes, unseen)][:units]
            elif stage == "reference-topk":
                invs = [invocation(stage, shapes, tokens + unseen)] + [invocation(stage, shapes, unseen)] * (units - 1)
            elif stage == "guidance":
                invs = [invocation(stage, shapes, unseen)] * units
            elif stage == "sensitivity":
                layers = shapes.n_moe if units <= len(measured) else 1  # a record from before the units
                invs = [invocation(stage, shapes, unseen, formats=formats[0], layers=layers)] * units
            elif stage == "e2e":
                invs = tuned if len(tuned) == units else tuned[:1] * units
            elif stage in ("evaluate", "reference-logits"):
                reps = moce.get("reps", 2) * max(1, len(moce.get("bonus", [0.0]))) if stage == "evaluate" else 1
                invs = [invocation(stage, shapes, evaluated * reps)] * units
            else:
                invs = [invocation(stage, shapes, tokens)] * units
            out.append(Observation(name, stage, float(row["seconds"]), tuple(invs)))
    return out


def load_records(specs: list[str]) -> dict[str, list[Observation]]:
    """Every record the arguments name: {device class: observations}, each record once."""
    by_class: dict[str, list[Observation]] = defaultdict(list)
    seen: set[str] = set()
    for spec in specs:
        named, pattern = device_class(spec)
        for match in sorted(glob.glob(str(REPO / pattern) if not Path(pattern).is_absolute() else pattern)):
            path = Path(match).resolve()
            name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            if name in seen:
                continue
            seen.add(name)
            read = demo_observations if path.suffix == ".csv" else bench_observations
            by_class[named or class_of(path, name)] += read(path, name)
    return dict(by_class)


# ---- the fit ------------------------------------------------------------------------------------
def design_row(obs: Observation, keys: list[str]) -> np.ndarray:
    """One observation's row: per key, 1 (its `once`, where the stage built it), summed size, summed work."""
    row = np.zeros(3 * len(keys))
    for inv in obs.invocations:
        i = 3 * keys.index(inv.key)
        row[i] = 1.0 if obs.once else 0.0
        row[i + 1] += inv.size / estimate.SIZE_UNIT
        row[i + 2] += inv.work / estimate.WORK_UNIT
    return row


def fit(observations: list[Observation]) -> dict[str, list[float]]:
    """Per key: [once s, s per 1e9 weights, s per 1e12 weight-tokens], non-negative, fitted in relative
    error. Two small penalties settle what the records cannot tell apart. Where every record built the
    same number of a kind's units, `once` and the per-unit rates explain them equally: ONCE_PENALTY
    (relative to the kind's median observation) gives the rates the time, so more units cost more.
    Where a kind that computes over tokens was timed at one token count only, its size and work
    rates do: SIZE_PENALTY gives the work rate the time, so more tokens cost more (a unit reads every
    calibration row).

    A codebook key is fitted apart only where some observation holds it without its base key (a
    bench_real_size record's per-variant stage); where it only ever shares an observation with its base
    key (a demo's stage totals), the split between them is arbitrary, so it is folded into the base key
    and priced as it (`estimate.seconds`)."""
    separable = {inv.key for obs in observations for inv in obs.invocations
                 if inv.key != estimate.base_key(inv.key)
                 and not any(other.key == estimate.base_key(inv.key) for other in obs.invocations)}
    observations = [replace(obs, invocations=tuple(inv if inv.key in separable or inv.key == estimate.base_key(inv.key)
                                                   else replace(inv, key=estimate.base_key(inv.key))
                                                   for inv in obs.invocations)) for obs in observations]
    keys = sorted({inv.key for obs in observations for inv in obs.invocations})
    a = np.array([design_row(obs, keys) for obs in observations])
    y = np.array([obs.seconds for obs in observations])
    w = 1.0 / np.maximum(y, 1.0)
    penalty = np.zeros((2 * len(keys), a.shape[1]))
    for i, key in enumerate(keys):
        rows = [j for j, obs in enumerate(observations) if any(inv.key == key for inv in obs.invocations)]
        typical = max(float(np.median(y[rows])), 1.0)
        penalty[2 * i, 3 * i] = ONCE_PENALTY / typical
        if a[rows, 3 * i + 2].any():  # a kind that computes over tokens: its time follows them where unsure
            penalty[2 * i + 1, 3 * i + 1] = SIZE_PENALTY * float(np.median(a[rows, 3 * i + 1])) / typical
    a_w = np.vstack([a * w[:, None], penalty])
    scale = np.maximum(np.abs(a_w).max(axis=0), 1e-12)  # columns of unit size: nnls' tolerance is absolute
    coef, _ = nnls(a_w / scale, np.concatenate([y * w, np.zeros(len(penalty))]), maxiter=100 * a.shape[1])
    coef /= scale
    return {key: [round(float(c), 6) for c in coef[3 * i:3 * i + 3]] for i, key in enumerate(keys)}


def record_total(observations: list[Observation], constants: dict[str, list[float]]) -> tuple[float, float]:
    """(measured, predicted) seconds of one record's stages."""
    invocations = [inv for obs in observations for inv in obs.invocations]
    predicted = estimate.seconds(invocations, constants)
    return sum(obs.seconds for obs in observations), sum(s or 0.0 for s in predicted.values())


def holdout(observations: list[Observation], record: str) -> tuple[float, float, list[str]]:
    """(measured, predicted) seconds of `record` from the constants fitted to its class's other records,
    over the stage kinds they have a record of, and the stage kinds they have none of (left out of both)."""
    constants = fit([obs for obs in observations if obs.record != record])
    kept = [obs for obs in observations if obs.record == record]
    unknown = sorted({obs.stage for obs in kept
                      if any(estimate.base_key(inv.key) not in constants for inv in obs.invocations)})
    return (*record_total([obs for obs in kept if obs.stage not in unknown], constants), unknown)


def predict_at(path: Path, layers: int, constants: dict[str, list[float]]) -> dict[str, float | None]:
    """Seconds per cost-model key of a bench_real_size record's stages run on `layers` layers of its model."""
    record = {**json.loads(path.read_text(encoding="utf-8")), "layers": layers}
    return estimate.seconds([i for obs in record_observations(record, str(path), {}) for i in obs.invocations],
                            constants)


def cost_model(by_class: dict[str, list[Observation]]) -> dict:
    return {"fitted_by": "bench/tools/fit_cost_model.py",
            "units": {"once": "s", "size": "s per 1e9 weights", "work": "s per 1e12 weight-tokens"},
            "devices": {device: {"records": sorted({obs.record for obs in obs_list}), "constants": fit(obs_list)}
                        for device, obs_list in sorted(by_class.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", default=list(DEFAULT_RECORDS),
                        help="records or globs, each optionally CLASS=... (default: the committed ones)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the constants (default {OUT.relative_to(REPO)})")
    parser.add_argument("--holdout", action="store_true",
                        help="print each record's total predicted from its class's other records; write nothing")
    parser.add_argument("--predict", type=Path, metavar="RECORD",
                        help="print a bench_real_size record's stages predicted at --layers layers by the shipped "
                             "constants of --device; write nothing")
    parser.add_argument("--layers", type=int, default=48, help="--predict: the layers (default 48)")
    parser.add_argument("--device", default="h200", help="--predict: the device class (default h200)")
    args = parser.parse_args()
    if args.predict:
        predicted = predict_at(args.predict, args.layers, estimate.load_cost_model()["devices"][args.device]["constants"])
        print(estimate.estimate_table(predicted, args.device))
        return 0
    by_class = load_records(args.records)
    if not by_class:
        raise SystemExit("no records matched")
    if args.holdout:
        print("| class | record held out | measured s | predicted s | error | stage kinds no other record has |")
        print("|---|---|---|---|---|---|")
        for device, obs_list in sorted(by_class.items()):
            for record in sorted({obs.record for obs in obs_list}):
                measured, predicted, unknown = holdout(obs_list, record)
                print(f"| {device} | {record} | {measured:.0f} | {predicted:.0f} | {predicted / measured - 1:+.1%} | "
                      f"{', '.join(unknown)} |")
        return 0
    args.out.write_text(json.dumps(cost_model(by_class), indent=1) + "\n", encoding="utf-8")
    for device, obs_list in sorted(by_class.items()):
        print(f"{device}: {len({o.record for o in obs_list})} records, {len(obs_list)} observations -> {args.out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
