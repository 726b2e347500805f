"""Where a heal spent its time, per stage kind, from the lake's provenance records.

    python bench/tools/stage_times.py lake/runs                                           # this machine's lake
    python bench/tools/stage_times.py lake/runs bench/results/demo-h200/stage_times.csv   # beside another run's
    python bench/tools/stage_times.py lake/runs --csv stage_times.csv                     # keep a run's figures
    python bench/tools/stage_times.py lake/runs --alone                                   # what ran with nothing beside it

Every stage writes ``runs/<fingerprint>.json`` with its start and finish
times (``Lake`` provenance); summing them per stage kind (quantize, calibrate,
evaluate, ...) says where a run's wall time went, whatever the variant or
layer. A source is a lake's ``runs/`` folder or a CSV this script wrote.
Columns: units built, total seconds, and for the second source its ratio to
the first. A run killed and resumed counts only the units that finished. A
``runs/`` folder holds every record the lake keeps, earlier runs' too: time one
run on an empty lake (``make clean``) for its figures alone.

``--alone`` (a lake's records only) says where a heal with several processes (``--workers``) left
cores idle: the run's span from its first start to its last finish cut where any unit starts or
ends, each piece given to the units running then; printed per stage kind, the seconds it ran with no
other unit beside it, then the seconds in which no unit ran at all (the orchestrator between stages,
start-up). On a machine with as many cores as workers, that is the time to win by running more at once.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path


def records(source: Path) -> list[tuple[str, float, float]]:
    """(stage kind, started, finished) of every provenance record in a lake's ``runs/`` folder (or its root)."""
    folder = source / "runs" if (source / "runs").is_dir() else source
    out = []
    for path in folder.glob("*.json"):
        run = json.loads(path.read_text(encoding="utf-8"))
        if not {"stage", "started", "finished"} <= run.keys():
            raise SystemExit(f"{path}: not a stage's provenance record (no stage, started and finished)")
        out.append((run["stage"], float(run["started"]), float(run["finished"])))
    if not out:
        raise SystemExit(f"{folder}: no provenance records (runs/<fingerprint>.json)")
    return out


def stage_seconds(source: Path) -> dict[str, tuple[int, float]]:
    """stage kind -> (units, seconds) from a lake's ``runs/`` folder or a CSV written by ``--csv``."""
    if source.suffix == ".csv":
        with source.open(newline="", encoding="utf-8") as f:
            return {r["stage"]: (int(r["units"]), float(r["seconds"])) for r in csv.DictReader(f)}
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for stage, started, finished in records(source):
        totals[stage][0] += 1
        totals[stage][1] += finished - started
    return {stage: (int(n), s) for stage, (n, s) in totals.items()}


def running_alone(runs: list[tuple[str, float, float]]) -> tuple[dict[str, float], float, float]:
    """({stage kind: seconds it ran with no other unit running}, seconds no unit ran, span seconds)."""
    edges = sorted({t for _, a, b in runs for t in (a, b)})
    alone: dict[str, float] = defaultdict(float)
    idle = 0.0
    for lo, hi in zip(edges, edges[1:]):
        active = [stage for stage, a, b in runs if a <= lo and b >= hi]
        if not active:
            idle += hi - lo
        elif len(active) == 1:
            alone[active[0]] += hi - lo
    return dict(alone), idle, edges[-1] - edges[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", type=Path, nargs="+", help="a lake (or its runs/ folder) or a CSV, one or two")
    parser.add_argument("--csv", type=Path, help="write the first source's figures here")
    parser.add_argument("--alone", action="store_true",
                        help="per stage kind, the seconds it ran with no other unit beside it (a lake only)")
    args = parser.parse_args()
    if len(args.sources) > 2:
        parser.error("one or two sources")
    if args.alone:
        alone, idle, span = running_alone(records(args.sources[0]))
        print(f"span {span:.1f} s from the first unit's start to the last one's finish\n")
        print("| stage | seconds running alone | share of the span |\n|---|---:|---:|")
        for stage, seconds in sorted(alone.items(), key=lambda kv: -kv[1]):
            print(f"| {stage} | {seconds:.1f} | {seconds / span:.1%} |")
        print(f"| (no unit running) | {idle:.1f} | {idle / span:.1%} |")
        return 0
    tables = [stage_seconds(s) for s in args.sources]
    if args.csv:
        with args.csv.open("w", newline="", encoding="utf-8") as f:
            out = csv.writer(f, lineterminator="\n")
            out.writerow(["stage", "units", "seconds"])
            out.writerows([stage, n, f"{s:.2f}"] for stage, (n, s) in sorted(tables[0].items()))
    labels = [s.parent.name for s in args.sources]  # lake/runs -> lake, demo-h200/stage_times.csv -> demo-h200
    header = " | ".join(f"{label} units | {label} s" for label in labels)
    print(f"| stage | {header} |{f' {labels[1]} / {labels[0]} |' if len(tables) == 2 else ''}")
    print("|---" * (1 + 2 * len(tables) + (len(tables) == 2)) + "|")
    stages = sorted(set().union(*tables), key=lambda st: -tables[0].get(st, (0, 0.0))[1])
    for stage in stages + ["all"]:
        cells, seconds = [], []
        for table in tables:
            n, s = (sum(v[0] for v in table.values()), sum(v[1] for v in table.values())) if stage == "all" \
                else table.get(stage, (0, 0.0))
            cells += [str(n), f"{s:.1f}"]
            seconds.append(s)
        ratio = f" {seconds[1] / seconds[0]:.2f}x |" if len(tables) == 2 and seconds[0] else (" |" if len(tables) == 2 else "")
        print(f"| {stage} | {' | '.join(cells)} |{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
