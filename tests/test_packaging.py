"""The built wheel installs like any other package: one `moeheal` namespace, SQL as package data,
and no clash with Hugging Face's `kernels` installed beside it."""

from __future__ import annotations

import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.wheels import REPO, build_wheel, run


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_one_namespace_and_the_sql(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"moeheal"}
    shipped = {Path(n).name for n in names if n.startswith("moeheal/sql/") and n.endswith(".sql")}
    assert shipped == {p.name for p in (REPO / "sql").glob("*.sql")}


@pytest.mark.slow
def test_installed_beside_hf_kernels(wheel, tmp_path):
    """A fresh environment: our wheel, its dependencies (borrowed from the test environment's
    site-packages, read-only) and Hugging Face's `kernels` from the index."""
    env = tmp_path / "env"
    run([sys.executable, "-m", "venv", str(env)], cwd=tmp_path)
    python, bin_dir = env / "bin" / "python", env / "bin"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    # the dependencies only: a plain path entry, whose own .pth files (our editable install) are not run
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], cwd=tmp_path)
    # into the fresh environment itself, though the borrowed dependencies hold it too (transformers needs it)
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "-c", str(REPO / "requirements" / "lock.txt"),
         "kernels"], cwd=tmp_path)

    work = tmp_path / "work"
    shutil.copytree(REPO / "demo", work / "demo", ignore=shutil.ignore_patterns("lake", "__pycache__"))
    config = work / "demo" / "heal.toml"
    config.write_text(config.read_text().replace('root = "../lake"', 'root = "lake"'))

    assert run([str(bin_dir / "moeheal"), "--help"], cwd=work).returncode == 0
    version = run([str(bin_dir / "moeheal"), "--version"], cwd=work).stdout
    assert version.startswith("moeheal ") and "unknown" not in version
    audit = run([str(python), "-m", "moeheal", "audit", "-c", str(config)], cwd=work)
    assert "audit: split clean" in audit.stdout
    theirs = run([str(python), "-c", "import kernels; print(kernels.__file__); kernels.get_kernel"], cwd=work)
    assert str(site) in theirs.stdout
    ours = run([str(python), "-c", "import moeheal.kernels, moeheal.sql; print(moeheal.kernels.__file__)"],
               cwd=work)
    assert str(site / "moeheal" / "kernels") in ours.stdout
    for bare in ("pipeline", "sql"):
        probe = run([str(python), "-c", f"import {bare}"], cwd=work, check=False)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, bare
