"""The built wheel installs like any other package: one `moeheal` namespace, SQL as package data,
and no clash with Hugging Face's `kernels` installed beside it.

Without the network: every pip run here has the index off (`PIP_NO_INDEX`), so a download fails the
test rather than happening. What pip would otherwise fetch comes from a local wheelhouse of this test
environment's own installed distributions, each packed again as a wheel (`wheel_of_installed`):
setuptools, the build backend the wheel's isolated build installs (torch requires it, so the test
environment has it), and `kernels`, installed beside ours.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.wheels import REPO, build_wheel, run

# What the installer writes into a .dist-info folder (a wheel holds none of them; RECORD is written again).
INSTALLER_FILES = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")


def wheel_of_installed(name: str, folder: Path) -> Path:
    """Distribution `name`, as this environment installed it, packed again as a wheel in `folder`:
    the files its RECORD lists, less the installer's own, bytecode, and files outside the
    site-packages folder (console scripts, which pip writes again from entry_points.txt)."""
    dist = importlib.metadata.distribution(name)
    info = next(f for f in dist.files if f.name == "WHEEL" and f.parent.name.endswith(".dist-info"))
    tag = next(line.removeprefix("Tag: ") for line in info.read_text().splitlines() if line.startswith("Tag: "))
    files = [f for f in dist.files if ".." not in f.parts and "__pycache__" not in f.parts and f.suffix != ".pyc"
             and not (f.parent == info.parent and f.name in INSTALLER_FILES)]
    wheel = folder / f"{info.parent.name.removesuffix('.dist-info')}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in files:
            source = Path(file.locate())
            archive.write(source, str(file))  # with its mode: an extension module stays executable
            data = source.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{file},sha256={digest},{len(data)}")
        record.append(f"{info.parent}/RECORD,,")
        archive.writestr(f"{info.parent}/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheelhouse")
    for name in ("setuptools", "kernels"):
        wheel_of_installed(name, folder)
    return folder


@pytest.fixture(scope="module")
def offline_pip(wheelhouse) -> Path:
    """Every pip this file runs (those in `tests.wheels` too, which pass the environment on): no
    index, the wheelhouse as the only place to find a package, no check for a newer pip."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("PIP_FIND_LINKS", str(wheelhouse))
        patch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        yield wheelhouse


@pytest.fixture(scope="module")
def wheel(offline_pip, tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_one_namespace_and_the_sql(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"moeheal"}
    shipped = {Path(n).name for n in names if n.startswith("moeheal/sql/") and n.endswith(".sql")}
    assert shipped == {p.name for p in (REPO / "sql").glob("*.sql")}


def test_an_installed_distribution_packs_again_into_the_wheel_it_was(offline_pip):
    """kernels' wheel from the wheelhouse holds exactly the installed distribution's files."""
    dist = importlib.metadata.distribution("kernels")
    (packed,) = offline_pip.glob("kernels-*.whl")
    names = set(zipfile.ZipFile(packed).namelist())
    assert f"kernels-{dist.version}.dist-info/RECORD" in names and "kernels/__init__.py" in names
    assert {str(f) for f in dist.files if f.suffix == ".py" and ".." not in f.parts} <= names
    assert not any(name.startswith("..") or name.endswith((".pyc", "/INSTALLER")) for name in names)


@pytest.mark.long
def test_installed_beside_hf_kernels(wheel, offline_pip, tmp_path):
    """A fresh environment: our wheel, its dependencies (borrowed from the test environment's
    site-packages, read-only) and Hugging Face's `kernels`, from the wheelhouse."""
    env = tmp_path / "env"
    run([sys.executable, "-m", "venv", str(env)], cwd=tmp_path)
    python, bin_dir = env / "bin" / "python", env / "bin"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    # the dependencies only: a plain path entry, whose own .pth files (our editable install) are not run
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], cwd=tmp_path)
    # into the fresh environment itself, though the borrowed dependencies hold it too (transformers needs it)
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", "--find-links",
         str(offline_pip), "-c", str(REPO / "requirements" / "lock.txt"), "kernels"], cwd=tmp_path)

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
