"""Content fingerprints: what makes a cached output valid.

A stage output is named by the SHA-256 of everything it was computed from:
the stage's name and code, its parameters, the *content* of every input file
(never a path, an mtime or a size alone) and the fingerprints of upstream
stages. Two runs that would compute the same thing share a name; any change,
however small, gives a new one. This closes the audit's holes where a cache
was keyed on a subset of its inputs (gate/up weights, a token file rewritten
under the same path, layer 0 only).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=4096)
def _cached_digest(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    """Digest memo keyed by the file's identity, within one process only.

    ctime is in the key because it cannot be set back: a file rewritten with the
    same size and a restored mtime still gets a fresh digest.
    """
    p = Path(path)
    if p.is_dir():
        return tree_digest(p)
    return _file_sha256(p)


def content_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's sorted (relative path, file digest) list."""
    p = Path(path)
    st = p.stat()
    return _cached_digest(str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(f for f in root.rglob("*") if f.is_file()):
        h.update(str(file.relative_to(root)).encode())
        h.update(content_digest(file).encode())
    return h.hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal parameters hash equal."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour a stage's output depends on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("jax", "jaxlib", "numpy", "gguf", "zarr", "duckdb", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def fingerprint(stage: str, code: str, params: dict[str, Any], input_digests: dict[str, str],
                upstream: dict[str, str]) -> str:
    """SHA-256 over a stage's name, code, parameters, input contents and upstream fingerprints."""
    payload = canonical_json({
        "stage": stage,
        "code": hashlib.sha256(code.encode()).hexdigest(),
        "params": params,
        "inputs": input_digests,
        "upstream": upstream,
        "libraries": library_versions(),
    })
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
