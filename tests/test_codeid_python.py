"""A module's digest is its code and nothing else, and the same on every Python the package supports.

`codeid.python_digest` hashes the syntax tree less comments and string statements, written out by
hand. The digests of a few fixture modules are pinned here, so a Python that wrote the tree another
way fails on any machine; where another CPython >= 3.11 is installed (pyenv's, a `python3.N` on the
path), the fixtures and every module of the package are digested there too and must agree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeheal.pipeline.lake import codeid
from tests.test_trust import REPO, SOURCE_FOLDERS

CODEID_PY = REPO / "pipeline" / "lake" / "codeid.py"

# What the code of the package uses, and what its tree can differ in between Pythons: f-strings
# (PEP 701 re-parsed them in 3.12; 3.12.1 adds an empty literal to a nested format spec), literals
# of every type, non-ASCII text, decorators, defaults, annotations, match, except*.
FIXTURES = {
    "literals": '''"""Docstring."""
X: int = 1_000
Y = 0x10 + 1e-3 + 1j + -0.0 + 10**400
Z = (b"\\x00b", u"u", "\\u00e9t\\u00e9 \\U0001f600 \\N{BULLET}", r"\\d+", ..., None, True, False, 0)
''',
    "fstrings": '''w, p = 10, 3
def f(a, b, c, d):
    s = f"{a}" f"{b!r:>{w}.{p}}" "plain" f"{c=}" f"{d = !s:^10}" f"{{literal}}" f"{a:}" f"{a!a}"
    t = f"{'nested' + f'{b}'}" rf"\\d{a}" f"""multi
line {a:%Y-%m-%d} end""" f"{a:{'>'}10}" f"" f"{a}{b}"
    return s, t
''',
    "statements": '''from __future__ import annotations
import functools as ft
from . import sibling
from ..parent import thing as other


@ft.lru_cache(maxsize=None)
def f(a, /, b: "str" = "x", *args, c=(1, 2), d, **kw) -> list[int]:
    """Docstring."""
    global X
    if (n := len(b)) > 3:
        return [i for i in range(n) if i % 2]
    match a:
        case {"k": [1, *rest]} | (2 | 3) as m if m:
            pass
        case Point(x=0, y=_):
            pass
    try:
        raise ValueError from None
    except* (TypeError, ValueError):
        pass
    finally:
        lambda q=1, *, r=2: q
    return b[1:2, ::3, ...]


class C(Base, metaclass=Meta):
    "Class docstring."
    attr: ClassVar[int] = 3

    async def m(self):
        async with ctx() as (u, v), other():
            await x
        for i in range(3):
            continue
        else:
            y = not i and i or ~i
        assert i, "message"
''',
}
PINNED = {
    "literals": "0d4c262a23b5f249fb082c4e80d8567d3d15b682c6e0c1fa969171869cc7ad4c",
    "fstrings": "ed7cd8266d0cccda992137567c152e69635f886831ff6ac88195e6d066b75b61",
    "statements": "69afd6ece3c67d144d2f9a535dffd04b17935c9b7efd13eea26e40b417bf0d51",
}

# Run by another Python: codeid.py is standard library only, loaded by path (the package's
# dependencies need not be installed there). Reads {"fixtures": {name: source}, "files": {path:
# source}} on stdin: the sources read once, here, so an edit made meanwhile cannot tell them apart.
DIGEST_ELSEWHERE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("codeid", sys.argv[1])
codeid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(codeid)
job = json.load(sys.stdin)
print(json.dumps({kind: {k: codeid.python_digest(v) for k, v in job[kind].items()} for kind in job}))
"""


def other_pythons() -> list[Path]:
    """Every CPython >= 3.11 found here other than the one running the tests."""
    found = {Path(p) for p in (shutil.which(f"python3.{minor}") for minor in range(11, 20)) if p}
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found |= set(pyenv.glob("3.*/bin/python3"))
    running = Path(sys.executable).resolve()
    out: dict[str, Path] = {}
    for python in sorted(found):
        probe = subprocess.run([str(python), "-c", "import sys; print(sys.implementation.name, "
                                "sys.version_info >= (3, 11), sys.version.split()[0], sys.executable)"],
                               capture_output=True, text=True)
        fields = probe.stdout.split()
        if probe.returncode == 0 and fields[:2] == ["cpython", "True"] and Path(fields[3]).resolve() != running:
            out.setdefault(fields[2], python)  # one per version
    return sorted(out.values())


def package_files() -> list[Path]:
    return sorted(p for folder in SOURCE_FOLDERS for p in (REPO / folder).rglob("*.py"))


def test_fixture_digests_are_pinned():
    """A different Python (or a change to the encoding) that writes a tree another way fails here."""
    assert {name: codeid.python_digest(source) for name, source in FIXTURES.items()} == PINNED


def test_every_other_python_gives_the_same_digests():
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no other CPython >= 3.11 here: the pinned digests stand in for one")
    sources = {str(f): f.read_text(encoding="utf-8") for f in package_files()}
    job = json.dumps({"fixtures": FIXTURES, "files": sources})
    here = {f: codeid.python_digest(source) for f, source in sources.items()}
    for python in pythons:
        out = subprocess.run([str(python), "-c", DIGEST_ELSEWHERE, str(CODEID_PY)], input=job,
                             capture_output=True, text=True, check=True)
        there = json.loads(out.stdout)
        assert there["fixtures"] == PINNED, python
        assert there["files"] == here, (python, sorted(f for f in here if there["files"][f] != here[f]))


@pytest.mark.parametrize(("before", "after"), [
    ('def f():\n    """One line."""\n    return 1\n', 'def f():\n    """Two\n\n    lines."""\n    return 1\n'),
    ('def f():\n    """Doc."""\n    return 1\n', 'def f():\n    return 1\n'),
    ("X = 1\n", "X = 1  # a comment\n# another\n"),
    ("X = 1\n", '"""A module docstring."""\n\nX = 1\n'),
    ("X = 1\n", 'X = 1\n"""An attribute docstring."""\n'),
    ("X = f(1, 2)\n", "X = f(\n    1,\n    2)\n"),
    ("X = 'a'\n", 'X = "a"\n'),
    ("def f():\n    return 1\n", "\n\ndef f():\n\n    return 1\n"),
])
def test_what_python_does_not_run_keys_nothing(before, after):
    assert codeid.python_digest(before) == codeid.python_digest(after)


@pytest.mark.parametrize(("before", "after"), [
    ("X = 1\n", "X = 2\n"),
    ("X = 1\n", "X = 1.0\n"),
    ("X = 1\n", "X = True\n"),
    ("X = 1\n", "X = '1'\n"),
    ("X = 0.1\n", "X = 0.10000000000000002\n"),
    ("X = 'é'\n", "X = 'e'\n"),
    ("def f(a=1):\n    return a\n", "def f(a=2):\n    return a\n"),
    ("@cache\ndef f():\n    return 1\n", "def f():\n    return 1\n"),
    ("@lru_cache(maxsize=8)\ndef f():\n    return 1\n", "@lru_cache(maxsize=9)\ndef f():\n    return 1\n"),
    ("X = f'{a:>8}'\n", "X = f'{a:>9}'\n"),
    ("X = f'{a}'\n", "X = f'{a!r}'\n"),
    ("X = f'{a} '\n", "X = f'{a}'\n"),
    ("x: int = 1\n", "x: float = 1\n"),
    ("def f():\n    f'{g()}'\n", "def f():\n    pass\n"),  # an f-string statement runs g
    ("X = a[1:]\n", "X = a[:1]\n"),
    ("X = {'k': 1}\n", "X = {'k': None}\n"),
])
def test_a_change_python_runs_re_keys(before, after):
    assert codeid.python_digest(before) != codeid.python_digest(after)
