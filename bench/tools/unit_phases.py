"""Where a heal's per-layer units spent their time: the phase lines they log, summed per unit kind.

    python bench/tools/unit_phases.py HEAL.log [HEAL.log ...]

Every quantize and calibrate unit, and the sensitivity stage for each layer, logs one line of its phases (`progress.Phases`: `quantize layer 1:
weights 0.01 s, read 0.05 s, ..., learned rounding 7.45 s, write 0.00 s (total 28.27 s)`). Printed per
unit kind (quantize, calibrate, sensitivity) and phase: the seconds summed over every unit line of the logs, the
count of lines that have the phase, and its share of the kind's total. The lines name a layer but not a
variant (the stage's label is on another line, and shard processes interleave theirs), so the sums are
over every variant's units; a phase's count says which units have it (the baseline's quantize units
have no learned rounding).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

PHASE_LINE = re.compile(r"^(?P<kind>quantize|calibrate|sensitivity) layer \d+: (?P<phases>.*) \(total [0-9.]+ s\)$")
PHASE_ITEM = re.compile(r"([a-z][a-z ]*?) ([0-9.]+) s(?:, |$)")


def phase_sums(lines: list[str]) -> dict[str, dict[str, tuple[float, int]]]:
    """{kind: {phase: (seconds summed, lines with it)}} over the unit phase lines among `lines`."""
    sums: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for line in lines:
        unit = PHASE_LINE.match(line.strip())
        if unit is None:
            continue
        for name, seconds in PHASE_ITEM.findall(unit.group("phases")):
            row = sums[unit.group("kind")][name]
            row[0] += float(seconds)
            row[1] += 1
    return {kind: {name: (s, n) for name, (s, n) in phases.items()} for kind, phases in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args()
    lines = [line for log in args.logs for line in log.read_text(encoding="utf-8", errors="replace").splitlines()]
    print("| unit | phase | seconds, summed | units with it | share of the kind |")
    print("|---|---|---:|---:|---:|")
    for kind, phases in phase_sums(lines).items():
        total = sum(s for s, _ in phases.values())
        for name, (seconds, count) in sorted(phases.items(), key=lambda kv: -kv[1][0]):
            print(f"| {kind} | {name} | {seconds:.1f} | {count} | {100 * seconds / max(total, 1e-9):.1f}% |")


if __name__ == "__main__":
    main()
