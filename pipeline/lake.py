"""The lake: content-addressed stage outputs, Parquet tables and DuckDB views.

Layout under the root (see SPEC.md): `tables/<name>.parquet`, `lake.duckdb`,
`dumps/<fp>.zarr`, `quant/<fp>/`, `models/<fp>.gguf`, `parts/<fp>/` (a stage's
own rows of shared tables), `runs/<fp>.json` (provenance), `tmp/` (work in
progress). Nothing here knows any math.

Every write is atomic: outputs are built under `tmp/` and renamed into place
when complete, and a stage's provenance is written after its outputs, with a
manifest of their sizes and digests that a cache hit re-checks. A crash leaves
at most a `tmp/` entry that nothing reads as a finished output.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from moeheal.pipeline.fingerprint import content_digest, library_versions
from moeheal.pipeline.sqlrun import run_sql

CODE_VERSION = "0.1.0"


@dataclass(frozen=True)
class StageResult:
    """A finished stage output: where it lives and whether this run computed it."""

    stage: str
    fingerprint: str
    path: Path
    cached: bool


def atomic_write_bytes(path: Path, data: bytes) -> None:
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
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    base = path if path.is_dir() else path.parent
    return {str(f.relative_to(base)): {"size": f.stat().st_size, "sha256": content_digest(f)}
            for f in files}


class Lake:
    """One data root. All paths are absolute; the DuckDB file holds views only."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        for sub in ("tables", "dumps", "quant", "models", "parts", "runs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # ---- stage outputs -------------------------------------------------------------
    def output_path(self, kind: str, fingerprint: str, suffix: str = "") -> Path:
        return self.root / kind / f"{fingerprint}{suffix}"

    def provenance_path(self, fingerprint: str) -> Path:
        return self.root / "runs" / f"{fingerprint}.json"

    def is_complete(self, kind: str, fingerprint: str, suffix: str = "") -> bool:
        """True only if the output and its provenance exist and the output matches the manifest."""
        out, prov = self.output_path(kind, fingerprint, suffix), self.provenance_path(fingerprint)
        if not out.exists() or not prov.exists():
            return False
        try:
            record = json.loads(prov.read_text())
        except json.JSONDecodeError:
            return False
        return record.get("fingerprint") == fingerprint and record.get("outputs") == _manifest(out)

    @contextmanager
    def _lock(self, fingerprint: str) -> Iterator[None]:
        """One writer per fingerprint, across processes."""
        with open(self.root / "tmp" / f"{fingerprint}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def work_path(self, kind: str, fingerprint: str, suffix: str = "") -> Path:
        """Where a stage builds its output; stable per fingerprint so a killed build can resume."""
        return self.root / "tmp" / f"{kind}-{fingerprint}{suffix}"

    def materialize(self, stage: str, kind: str, fingerprint: str, suffix: str,
                    build: Callable[[Path], None], provenance: dict[str, Any],
                    log: Callable[[str], None] = print, resume: bool = False) -> StageResult:
        """Return the output for `fingerprint`, building it under tmp/ and publishing it if absent.

        A build that was killed leaves its work under tmp/; it is discarded, or
        handed to `build` again when the stage can `resume` from it.
        """
        final = self.output_path(kind, fingerprint, suffix)
        with self._lock(fingerprint):
            if self.is_complete(kind, fingerprint, suffix):
                log(f"[{stage}] cache hit {fingerprint[:12]}")
                return StageResult(stage, fingerprint, final, cached=True)
            work = self.work_path(kind, fingerprint, suffix)
            if work.exists() and not resume:
                shutil.rmtree(work) if work.is_dir() else work.unlink()
            started = time.time()
            log(f"[{stage}] computing {fingerprint[:12]}")
            build(work)
            if final.exists():  # an incomplete or tampered output under this name
                shutil.rmtree(final) if final.is_dir() else final.unlink()
            os.replace(work, final)
            record = {
                "stage": stage, "fingerprint": fingerprint, "code_version": CODE_VERSION,
                "libraries": library_versions(), "started": started, "finished": time.time(),
                "outputs": _manifest(final), **provenance,
            }
            atomic_write_bytes(self.provenance_path(fingerprint),
                               json.dumps(record, indent=1, sort_keys=True, default=str).encode())
            return StageResult(stage, fingerprint, final, cached=False)

    # ---- tables and views ---------------------------------------------------------
    def table_path(self, name: str) -> Path:
        return self.root / "tables" / f"{name}.parquet"

    def write_table(self, name: str, table: pa.Table) -> None:
        write_parquet(self.table_path(name), table)
        self.refresh_views()

    def read_table(self, name: str) -> pa.Table:
        return pq.read_table(self.table_path(name))

    def table_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "tables").glob("*.parquet"))

    def connect(self) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB with one view per table (no lock on lake.duckdb)."""
        con = duckdb.connect()
        for name in self.table_names():
            _create_view(con, name, self.table_path(name))
        return con

    def refresh_views(self) -> None:
        """Rebuild lake.duckdb (views over tables/) in a temp file, then rename it into place."""
        target = self.root / "lake.duckdb"
        tmp = self.root / "tmp" / f"lake.{os.getpid()}.duckdb"
        tmp.unlink(missing_ok=True)
        con = duckdb.connect(str(tmp))
        try:
            for name in self.table_names():
                _create_view(con, name, self.table_path(name))
        finally:
            con.close()
        os.replace(tmp, target)

    def query(self, stem: str, **params: Any) -> pa.Table:
        """Run `sql/<stem>.sql` over the lake's views with named parameters."""
        con = self.connect()
        try:
            return run_sql(con, stem, **params)
        finally:
            con.close()


def _create_view(con: duckdb.DuckDBPyConnection, name: str, parquet: Path) -> None:
    """A view over one Parquet file. DDL takes no bound parameters, so the identifier and
    the path literal are quoted here, and only here; table names come from our own files."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"bad table name {name!r}")
    literal = str(parquet).replace("'", "''")
    con.execute(f"CREATE OR REPLACE VIEW \"{name}\" AS SELECT * FROM read_parquet('{literal}')")
