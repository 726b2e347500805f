"""No top-level folder of the repository shadows an installed distribution (DESIGN.md, Imports).

The checkout's folders `kernels/`, `pipeline/`, `sql/`, `tests/`, `bench/`, `demo/` are importable as
`moeheal.*` (or not at all); under their bare names they collide with distributions that other packages
import: transformers imports Hugging Face's `kernels`, and with the repository root first on sys.path it
found ours and failed at collection. These tests read the installed distributions' top-level modules
from their metadata, so a new collision fails here, not in a third-party import of some later release.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def our_top_level_names() -> list[str]:
    """The repository's top-level folders that a bare import could find, less the package itself."""
    return sorted(p.name for p in REPO.iterdir()
                  if p.is_dir() and p.name.isidentifier() and not p.name.startswith((".", "_")) and p.name != "moeheal")


def resolves_into(name: str, folder: Path) -> bool:
    """Whether `import name`, in this process as it is now, finds (or already found) `folder`."""
    module = sys.modules.get(name)
    spec = module.__spec__ if module is not None and getattr(module, "__spec__", None) else None
    if spec is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    return any(Path(place).resolve().is_relative_to(folder) for place in places if place)


def shadowed_distributions() -> list[str]:
    """'name: our folder hides <distributions>' for each top-level folder of ours that the import
    system would take for a module an installed distribution provides."""
    provided = importlib.metadata.packages_distributions()
    return [f"{name}: {REPO / name} hides the installed {', '.join(sorted(set(provided[name])))}"
            for name in our_top_level_names()
            if name in provided and resolves_into(name, REPO / name)]


def test_the_guard_sees_our_folders():
    names = our_top_level_names()
    assert {"kernels", "pipeline", "sql", "tests", "bench", "demo"} <= set(names)
    assert "moeheal" not in names


def test_no_folder_of_ours_shadows_an_installed_distribution():
    assert shadowed_distributions() == []


def test_the_repository_root_is_never_ahead_of_site_packages():
    site = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    entries = [Path(entry or ".").resolve() for entry in sys.path]
    first_site = min(i for i, entry in enumerate(entries) if entry in site)
    assert REPO not in entries[:first_site], f"the repository root is on sys.path before site-packages: {sys.path}"


def test_the_guard_fails_when_the_root_comes_first(tmp_path):
    """The guard itself, in a Python that starts the way `python -m pytest` did before (the working
    directory first): where an installed distribution shares a folder's name, it names it."""
    provided = importlib.metadata.packages_distributions()
    expected = sorted(name for name in our_top_level_names() if name in provided)
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        f"guard = runpy.run_path({str(Path(__file__))!r})\n"
        "print('\\n'.join(line.split(':')[0] for line in guard['shadowed_distributions']()))\n")
    out = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True, check=True).stdout
    assert sorted(out.split()) == expected
