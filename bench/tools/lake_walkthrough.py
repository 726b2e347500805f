"""Keeping a lake, walked through on the smallest healed world (bench/inputs/healworld.py, variant v1):
heal, `moeheal lake du`, one knob changed and healed again, `du` again, `gc` as a dry run (also
keeping what the previous published set names), `gc --yes`, `du`, and a last heal that finds every
stage in the lake.

    python bench/tools/lake_walkthrough.py [DIR]

prints the transcript (paths under DIR shown relative to it) that docs/reference.md records;
tests/test_lake_gc.py walks the same steps and checks what they show.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after site-packages: DESIGN.md, Imports
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MOEHEAL_PLOTS", "0")

from bench.inputs.healworld import V1, write_world  # noqa: E402
from moeheal.pipeline.commands.cli import main as moeheal  # noqa: E402

KNOB = ("ridge_rho = 6.0", "ridge_rho = 3.0")  # the one knob changed: v1's ridge strength


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    rc: int
    out: str  # stdout and stderr


def run(argv: list[str]) -> Step:
    """One `moeheal` command in this process, its output captured."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = moeheal(argv)
    return Step(tuple(argv), rc, out.getvalue())


def walk(folder: Path) -> list[Step]:
    """The walk-through's commands, in order, on a new world under `folder`."""
    config = write_world(folder.resolve(), variants=V1)
    c = str(config)
    steps = [run(["heal", "-c", c]), run(["lake", "du", "-c", c])]
    text = config.read_text()
    assert KNOB[0] in text
    config.write_text(text.replace(*KNOB))
    steps += [run(["heal", "-c", c]), run(["lake", "du", "-c", c]), run(["lake", "gc", "-c", c]),
              run(["lake", "gc", "-c", c, "--keep-sets", "2"]), run(["lake", "gc", "-c", c, "--yes"]), run(["lake", "du", "-c", c]), run(["heal", "-c", c]),
              run(["plan", "-c", c])]
    return steps


def transcript(steps: list[Step], folder: Path) -> str:
    lines = []
    for i, step in enumerate(steps):
        if i == 2:
            lines.append(f"# v1's {KNOB[0]} -> {KNOB[1]} in heal.toml")
        shown = [str(Path(a).relative_to(folder)) if a.startswith(str(folder)) else a for a in step.argv]
        out = step.out
        if step.argv[0] == "heal":
            computed = sum(" computing " in line for line in out.splitlines())
            found = sum(" cache hit " in line for line in out.splitlines())
            out = f"({computed} stage invocations computed, {found} found in the lake)"
        elif step.argv[0] == "plan":
            out = out.rstrip().splitlines()[-1]
        lines += [f"$ moeheal {' '.join(shown)}", out.rstrip().replace(str(folder) + "/", "")]
    return "\n".join(lines)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)
        print(transcript(walk(folder), folder.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
