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
import re
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


# How much of each library's version goes into every stage's key (None: all of it). The key
# promises that a cached output is what this code would compute now, to the bit, and the key is
# in every fingerprint, so each number here trades a stale bit against a recomputed heal:
# - jax, jaxlib: XLA compiles every forward pass, GPTQ, learned rounding and e2e; a patch
#   release changes fusion and reduction order, so float bits, so the whole version;
# - numpy: the encoders' and decoders' arithmetic; a patch release can swap a SIMD kernel;
# - gguf: gguf-py dequantizes the source's tensors and lays out every GGUF written;
# - scipy: its OpenBLAS is the LAPACK JAX's CPU backend calls for GPTQ's Cholesky factor and solves,
#   and the ridge's solves; a new build can move their last bits, so near-tie codes: the whole version;
# - duckdb: the audit's and the comparisons' SQL, made exact on purpose (integer sums, a
#   counter-based bootstrap hash); a function's semantics or the Parquet writer change in a
#   minor release, a patch release fixes bugs: major.minor;
# - tokenizers: the ids of the corpus, an exact algorithm over the GGUF's vocabulary, which a
#   0.x library changes in a minor release: major.minor;
# - zarr: stores the dumps losslessly, so no version changes a value read back; the store's
#   format (v2, v3), which an older major cannot read, changes with the major: major.
# Python's own version is not keyed: the project's arithmetic is the libraries'.
KEYED_RELEASE_PARTS: dict[str, int | None] = {
    "jax": None, "jaxlib": None, "numpy": None, "gguf": None, "scipy": None, "duckdb": 2, "tokenizers": 2,
    "zarr": 1,
}


@lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Installed versions of the libraries a stage's output depends on, whole (the provenance
    record's; `keyed_library_versions` is what a key holds)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in KEYED_RELEASE_PARTS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def release_prefix(version: str, parts: int | None) -> str:
    """The first `parts` numbers of a version's release ("3.1.6", 1 -> "3"; "2.1.0rc1", 2 ->
    "2.1"), or the whole version when `parts` is None or it does not start with a number."""
    release = re.match(r"\d+(?:\.\d+)*", version)
    if parts is None or release is None:
        return version
    return ".".join(release.group().split(".")[:parts])


def keyed_library_versions() -> dict[str, str]:
    """Each library's version at the grain `KEYED_RELEASE_PARTS` gives it: what every key holds."""
    return {name: release_prefix(version, KEYED_RELEASE_PARTS[name]) for name, version in library_versions().items()}


def fingerprint(stage: str, code: str, params: dict[str, Any], input_digests: dict[str, str],
                upstream: dict[str, str]) -> str:
    """SHA-256 over a stage's name, code, parameters, input contents, upstream fingerprints and
    `keyed_library_versions`."""
    payload = canonical_json({
        "stage": stage,
        "code": hashlib.sha256(code.encode()).hexdigest(),
        "params": params,
        "inputs": input_digests,
        "upstream": upstream,
        "libraries": keyed_library_versions(),
    })
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
