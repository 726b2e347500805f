"""Where a heal's XLA compilation goes: a `JAX_LOG_COMPILES=1` log of bench/speed/bench_real_size.py,
its compilations attributed to the stage that was computing when each finished.

    python bench/tools/compile_log.py bench/results/real-size/runs/sp_l4_full.log.gz [--top 6]

JAX logs `Finished XLA compilation of jit(NAME) in S sec` per program; the heal logs
`[LABEL] computing KEY` when a stage starts (the bench's stamped lines). Per stage kind
(`real_size_record.stage_kind`: `quantize:<variant>:<layer>` -> `quantize:<variant>`) it prints the
programs compiled, their seconds, and the programs that took the most, with how many times each name
was compiled: a name compiled once per layer is a program keyed by something that changes per layer
(a recipe's mix of formats), one compiled a bounded number of times is keyed by (format, shape).
The seconds are XLA's compilation alone (not tracing or lowering), the measure the bench's `compile_s` sums.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))
from bench.tools.real_size_record import LOG_STAGE, stage_kind  # noqa: E402

COMPILED = re.compile(r"Finished XLA compilation of jit\((?P<name>[^)]*)\) in (?P<s>[0-9.eE+-]+) sec")
BEFORE_STAGES = "(start)"  # compilations before the first stage line: the bench's own setup


@dataclass
class StageCompiles:
    """One stage kind's compilations: seconds and count per program name."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    count: Counter = field(default_factory=Counter)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def read_lines(path: Path) -> list[str]:
    """A log's lines, gzip or plain."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:
        return f.read().splitlines()


def attribute(lines: list[str], variants: list[str]) -> dict[str, StageCompiles]:
    """Each compilation charged to the stage kind computing when it finished. `variants` are the names a
    stage label may carry (`stage_kind`'s), the baseline's included."""
    stages: dict[str, StageCompiles] = defaultdict(StageCompiles)
    current = BEFORE_STAGES
    for line in lines:
        stage = LOG_STAGE.match(line)
        if stage:
            current = stage_kind(stage["label"], variants) if stage["what"] == "computing" else current
            continue
        compiled = COMPILED.search(line)
        if compiled:
            stages[current].seconds[compiled["name"]] += float(compiled["s"])
            stages[current].count[compiled["name"]] += 1
    return dict(stages)


def variant_names(lines: list[str]) -> list[str]:
    """The variants a log's stage labels name: the third part of `quantize:<variant>:<layer>`."""
    names = {"unhealed"}
    for line in lines:
        stage = LOG_STAGE.match(line)
        if stage and stage["label"].startswith("quantize:"):
            names.add(stage["label"].split(":")[1])
    return sorted(names)


def report(stages: dict[str, StageCompiles], top: int) -> str:
    """A markdown table: per stage kind, programs, seconds and the costliest programs (name x count: s)."""
    rows = ["| stage kind | programs | XLA compile s | costliest programs (name x times compiled: s) |",
            "|---|---|---|---|"]
    for kind, c in sorted(stages.items(), key=lambda kv: -kv[1].total_s):
        costly = sorted(c.seconds.items(), key=lambda kv: -kv[1])[:top]
        named = ", ".join(f"`{name}` x{c.count[name]}: {s:.1f}" for name, s in costly)
        rows.append(f"| {kind} | {sum(c.count.values())} | {c.total_s:.1f} | {named} |")
    total = sum(c.total_s for c in stages.values())
    rows.append(f"| all | {sum(sum(c.count.values()) for c in stages.values())} | {total:.1f} | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a JAX_LOG_COMPILES=1 log of the real-size bench (.gz or plain)")
    parser.add_argument("--top", type=int, default=4, help="programs named per stage kind")
    args = parser.parse_args(argv)
    lines = read_lines(args.log)
    print(f"{args.log}:")
    print(report(attribute(lines, variant_names(lines)), args.top))


if __name__ == "__main__":
    main()
