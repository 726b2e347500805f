"""Atomic file writes: a reader never sees half a file under its final name.

Kept apart from the lake so that a stage's code identity (its import closure)
does not change when the lake's bookkeeping does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moeheal.pipeline.errors import InputError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync it, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_parquet(path: Path, table: pa.Table) -> None:
    """Write a Parquet file atomically (temp file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)  # a flipped bit fails to read
    os.replace(tmp, path)


def read_part(path: Path, columns: tuple[str, ...]) -> pa.Table:
    """A stage's own Parquet output, read back; damaged, truncated or someone else's is an InputError.

    Parts are checked against their manifest on a cache hit, but a part can
    still be replaced or cut between runs; this names the file instead of
    letting Arrow's error or a missing column surface as a traceback.
    """
    try:
        table = pq.read_table(path, page_checksum_verification=True)  # pages carry CRCs (write_parquet)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:160]})") from None
    missing = [c for c in columns if c not in table.schema.names]
    if missing:
        raise InputError(f"{path}: no column {missing[0]!r} (columns: {', '.join(table.schema.names)[:160]})")
    return table
