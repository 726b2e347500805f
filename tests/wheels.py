"""Building and installing the project's wheel in tests: a command runner and a wheel built from a
copy of what the wheel is made of.

The wheel is built from a copy, not the checkout: setuptools writes `build/` and `*.egg-info` into
the tree it builds, so two tests building from the checkout at once (two test workers) would write
the same folders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_SOURCES = ("pyproject.toml", "README.md", "moeheal", "pipeline", "kernels", "sql")


def run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """`cmd` outside this test environment's PYTHONPATH and virtualenv, JAX on the CPU; with `check`,
    a failure is an assertion that shows the end of its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"})
    assert not check or done.returncode == 0, f"{cmd}: {done.stderr[-2000:]}"
    return done


def build_wheel(work: Path) -> Path:
    """The project's wheel, built under `work` from a copy of its sources."""
    source = work / "source"
    for name in WHEEL_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"), str(source)], cwd=work)
    return next((work / "dist").glob("moeheal-*.whl"))
