"""Keeping a lake, walked through on the smallest healed world (bench/inputs/healworld.py, variant v1):
heal, `moeheal lake du`, one knob changed and healed again, `du` again, `gc` as a dry run (also
keeping what the previous published set names), `gc --yes`, `du`, and a last heal that finds every
stage in the lake.

    python bench/tools/lake_walkthrough.py [DIR]
    python bench/tools/lake_walkthrough.py --demo DIR     # the same on the bundled demo (demo/heal.toml
                                                          # with its lake in DIR; q2_k_healed's ridge_rho
                                                          # 6.0 -> 3.0): about as long as two `make heal`s

prints the transcript (paths under DIR shown relative to it) that docs/reference.md records;
tests/test_lake_gc.py walks the same steps and checks what they show.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
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
DEMO = Path(__file__).resolve().parents[2] / "demo"
DEMO_VARIANT = "q2_k_healed"  # the demo's variant whose knob is changed
PATH_VALUE = re.compile(r'^(\s*\w+\s*=\s*)"([^"]+)"', re.M)


def demo_config(folder: Path) -> Path:
    """demo/heal.toml written into `folder` with its lake there: every value naming a file beside the demo's
    config made absolute, so the copy reads the demo's model, corpus, windows and peers."""
    text = (DEMO / "heal.toml").read_text(encoding="utf-8").replace('root = "../lake"', f'root = "{folder / "lake"}"')
    text = PATH_VALUE.sub(lambda m: f'{m.group(1)}"{DEMO / m.group(2)}"' if (DEMO / m.group(2)).exists()
                          else m.group(0), text)
    config = folder / "heal.toml"
    config.write_text(text, encoding="utf-8")
    return config


def change_knob(text: str, variant: str | None) -> str:
    """`text` with KNOB changed in the [[variant]] named `variant` (None: the only one it holds)."""
    blocks = text.split("[[variant]]")
    for i, block in enumerate(blocks[1:], 1):
        if variant is None or f'name = "{variant}"\n' in block:
            assert KNOB[0] in block
            blocks[i] = block.replace(*KNOB, 1)
            return "[[variant]]".join(blocks)
    raise ValueError(f"no variant {variant}")


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


def walk(folder: Path, demo: bool = False) -> list[Step]:
    """The walk-through's commands, in order, on a new world (or the demo's config) under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = demo_config(folder.resolve()) if demo else write_world(folder.resolve(), variants=V1)
    c = str(config)
    steps = [run(["heal", "-c", c]), run(["lake", "du", "-c", c])]
    config.write_text(change_knob(config.read_text(), DEMO_VARIANT if demo else None))
    steps += [run(["heal", "-c", c]), run(["lake", "du", "-c", c]), run(["lake", "gc", "-c", c]),
              run(["lake", "gc", "-c", c, "--keep-sets", "2"]), run(["lake", "gc", "-c", c, "--yes"]), run(["lake", "du", "-c", c]), run(["heal", "-c", c]),
              run(["plan", "-c", c])]
    return steps


def transcript(steps: list[Step], folder: Path, variant: str = "v1") -> str:
    lines = []
    for i, step in enumerate(steps):
        if i == 2:
            lines.append(f"# {variant}'s {KNOB[0]} -> {KNOB[1]} in heal.toml")
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
    args = sys.argv[1:]
    demo = args[:1] == ["--demo"]
    args = args[1:] if demo else args
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args[0]) if args else Path(tmp)
        print(transcript(walk(folder, demo), folder.resolve(), DEMO_VARIANT if demo else "v1"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
