"""Code identity of a stage: every project module it imports, transitively, and every query it runs.

A cached output is only as trustworthy as the list of code it was keyed on. A
hand-kept list of functions misses module constants, the helpers they call
and the SQL they run (the audit's stale caches came from exactly that), so the
list is not kept by hand: starting from a stage's own module, the import
statements of each project module (module level and inside functions) are
followed through the source with `ast`, without importing anything, and every
string literal that names a query (`run_sql(con, "overlap")`, a tuple of check
names) adds `sql/<stem>.sql`: queries are always named literally in the module
that runs them. The identity is the SHA-256 over the sorted (module name,
digest) pairs of that closure, so editing the code of any file a stage can
reach changes its fingerprint, and editing any other file does not.

A module's code is what Python runs: its syntax tree (`python_digest`), less
comments (the tree has none) and string statements (a docstring, or a bare
string anywhere, evaluates to nothing; no module a stage reaches reads a
`__doc__`, tests/test_codeid.py checks). A docstring or comment edit, a line
moved by one, a re-wrap inside brackets re-key nothing; a constant, a default
argument, a decorator, an f-string, an annotation does. A query keeps its text
digest: its header comments declare the report sections it feeds
(`-- heading:`, `-- columns:`), so in SQL a comment can be code.

The tree is written out by hand (`_encode`), not with `ast.dump`, whose text
changes between Pythons: a node is its class name and its fields by name,
leaving out the unset ones (None, []), so a field a later Python adds
(3.12's `type_params`) is absent until code uses it; a literal is its type and
an exact text (`float.hex`, never `repr`, whose escapes of a string follow the
Unicode tables of the running Python). tests/test_codeid_python.py pins the
digests of fixture modules and recomputes them on every other CPython found,
so the identity is the same on every Python the package supports.

Files are found under a source root laid out like the package (`moeheal/`,
`pipeline/`, `kernels/`, `sql/`), the checkout by default; tests point it at a
mutated copy.
"""

from __future__ import annotations

import ast
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

PACKAGE = "moeheal"
# The package's subpackages and the folder each lives in (pyproject's package-dir).
SUBPACKAGES = {"pipeline": "pipeline", "kernels": "kernels", "sql": "sql"}
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def module_file(module: str, root: Path) -> Path | None:
    """The source file of project module `module` under `root`, or None if it is not ours."""
    parts = module.split(".")
    if not module or parts[0] != PACKAGE:
        return None
    if len(parts) == 1:  # a checkout keeps it in moeheal/, an installed package at its root
        return next((f for f in (root / PACKAGE / "__init__.py", root / "__init__.py") if f.is_file()), None)
    base = root / SUBPACKAGES.get(parts[1], "\0")
    rel = base.joinpath(*parts[2:])
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a block that never runs, so its imports
    name no code the module executes."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _executed_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` (like `ast.walk`) except the bodies of `if TYPE_CHECKING:` blocks."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if _type_checking_only(node):
            todo.extend([node.test, *node.orelse])
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def lazy_api(tree: ast.AST) -> dict[str, str]:
    """A package's lazily re-exported names, `API = {"name": "module", ...}` in its `__init__`
    (`kernels/__init__.py`): `from moeheal.kernels import quantize` runs `kernels/encode.py`."""
    for node in getattr(tree, "body", []):
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "API" and isinstance(node.value, ast.Dict):
            pairs = zip(node.value.keys, node.value.values)
            return {k.value: v.value for k, v in pairs if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name an `import` or `from ... import` in `tree` may refer to (imports under
    `if TYPE_CHECKING:` name nothing that runs)."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in _executed_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            parts = base.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def _string_constants(tree: ast.AST) -> set[str]:
    """Every string literal in `tree`: a query stem is named literally somewhere in its module
    (`run_sql(con, "overlap")`, a tuple of check names, a report's list of sections)."""
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@lru_cache(maxsize=4096)
def _references(source: str, filename: str, module: str,
                is_package: bool) -> tuple[frozenset[str], frozenset[str], tuple[tuple[str, str], ...]]:
    """(module names imported, string literals, a package's lazy API as (name, module) pairs) of one
    file's source; keyed on the text, so a closure
    re-parses only the files that changed since the last one (a plan computes one per stage module)."""
    tree = ast.parse(source, filename=filename)
    api = {f"{module}.{name}": f"{module}.{target}" for name, target in lazy_api(tree).items()} if is_package else {}
    return (frozenset(_imported_names(tree, module, is_package)), frozenset(_string_constants(tree)),
            tuple(sorted(api.items())))


def closure(entry: str, root: Path = SOURCE_ROOT) -> dict[str, Path]:
    """Every project file `entry` (a module name) can reach, keyed by module name or `sql:<stem>`.

    Keys are names, not paths, so a checkout and an installed wheel of the same
    code have the same identity.
    """
    seen: dict[str, Path] = {}
    files: set[Path] = set()
    lazy: dict[str, str] = {}  # "moeheal.kernels.quantize" -> "moeheal.kernels.encode", from packages seen
    wanted: set[str] = set()  # every name imported so far (a package's API may be read after its user)
    todo = [entry]
    while todo:
        module = todo.pop()
        file = module_file(module, root)
        if file is None or module in seen or file in files:
            continue
        files.add(file)
        seen[module] = file
        imported, strings, api = _references(file.read_text(encoding="utf-8"), str(file), module,
                                             file.name == "__init__.py")
        lazy.update(api)
        for stem in strings:
            sql = root / SUBPACKAGES["sql"] / f"{stem}.sql"
            if stem.isidentifier() and sql.is_file():
                seen[f"sql:{stem}"] = sql
                todo.append(f"{PACKAGE}.sql")  # the package the queries are read from
        todo.extend(imported)
        todo.append(module.rpartition(".")[0])  # importing a module runs its package's __init__ first
        wanted.update(imported)
        todo.extend(lazy[name] for name in wanted & lazy.keys() if lazy[name] not in seen)
    return seen


def _is_text(node: Any) -> bool:
    """A string literal (an f-string is a JoinedStr, not one)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_string_statement(node: Any) -> bool:
    """A statement that is a string literal alone: a docstring, or any bare string, which Python
    evaluates to nothing (an f-string runs its expressions, so it is not one)."""
    return isinstance(node, ast.Expr) and _is_text(node.value)


def _literal(value: object) -> list[str]:
    """A literal as [type, exact text]: `1`, `1.0`, `True` and `"1"` differ, and the text depends on
    the value alone, never on the running Python's `repr` of it."""
    if isinstance(value, float):
        text = value.hex()
    elif isinstance(value, complex):
        text = f"{value.real.hex()} {value.imag.hex()}"
    elif isinstance(value, bool) or value is None or value is Ellipsis:
        text = str(value)
    elif isinstance(value, int):
        text = hex(value)  # not str(): no int_max_str_digits limit
    elif isinstance(value, bytes):
        text = value.hex()
    elif isinstance(value, str):
        text = value
    else:
        raise TypeError(f"unexpected literal {type(value).__name__} in a syntax tree")
    return [type(value).__name__, text]


def _fstring_parts(values: list[ast.expr]) -> list[ast.expr]:
    """An f-string's parts with adjacent literal text merged and empty text dropped: Python 3.12.1
    ends a nested format spec (`f"{x:>{w}}"`) with an empty literal that 3.11 and 3.13 do not have."""
    parts: list[ast.expr] = []
    for value in values:
        if _is_text(value) and parts and _is_text(parts[-1]):
            parts[-1] = ast.Constant(parts[-1].value + value.value)
        elif not (_is_text(value) and not value.value):
            parts.append(value)
    return parts


def _encode(node: Any) -> Any:
    """A syntax tree as JSON-ready lists: [class name, {field: value}] per node, its set fields only
    (positions are attributes, not fields: code moved by a line keys the same), string statements
    left out."""
    if isinstance(node, ast.JoinedStr):
        node = ast.JoinedStr(values=_fstring_parts(node.values))
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in node._fields)
        encoded = {name: _encode(value) for name, value in fields if value is not None}
        return [type(node).__name__, {name: value for name, value in encoded.items() if value != []}]
    if isinstance(node, list):
        return [_encode(item) for item in node if not _is_string_statement(item)]
    return _literal(node)  # a constant's value, an identifier, an import's level, a conversion code


@lru_cache(maxsize=4096)
def python_digest(source: str, filename: str = "<source>") -> str:
    """SHA-256 of a module's code: its syntax tree without comments or string statements, written
    out the same way by every Python (sorted keys; non-ASCII as escapes of its code points)."""
    tree = _encode(ast.parse(source, filename=filename))
    return hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_digest(file: Path) -> str:
    """A module's `python_digest`; any other file (a query) by its bytes."""
    if file.suffix == ".py":
        return python_digest(file.read_text(encoding="utf-8"), str(file))
    return hashlib.sha256(file.read_bytes()).hexdigest()


@lru_cache(maxsize=None)
def code_identity(entry: str, root: Path = SOURCE_ROOT) -> str:
    """SHA-256 over the sorted (module name, `file_digest`) pairs of `entry`'s closure."""
    h = hashlib.sha256()
    for rel, file in sorted(closure(entry, root).items()):
        h.update(rel.encode())
        h.update(file_digest(file).encode())
    return h.hexdigest()
