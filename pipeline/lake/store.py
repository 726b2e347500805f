"""The lake: content-addressed stage outputs, published table sets and DuckDB views.

Layout under the root (see SPEC.md): `dumps/<fp>.zarr`, `quant/<fp>/`,
`models/<fp>.gguf`, `parts/<fp>/` (a stage's own rows of shared tables),
`runs/<fp>.json` (provenance), `tmp/` (work in progress), and what users read:
`tables/<name>.parquet`, `lake.duckdb` and `report/`. Nothing here knows any math.

Stage outputs are content-addressed: built under `tmp/`, renamed into place
when complete, their provenance written after them with a manifest of sizes
and digests that a cache hit re-checks.

What users read is published as a set: a run stages its tables (and DuckDB
file, and report) in `tmp/publish-*/`, and only when the whole run succeeded
is the folder moved to `published/<id>/` and the symbolic link `current`
switched to it in one atomic rename. `tables`, `lake.duckdb` and `report` are
fixed links into `current`, so the three always come from one successful run,
and a run that fails (a rejected config, a crash) leaves them untouched. All
links and the views inside `lake.duckdb` are relative, so a lake can be moved:
open it from inside (`cd lake && duckdb lake.duckdb`; `moeheal sql` does that
for you).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from moeheal import __version__
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import atomic_write_bytes, write_parquet
from moeheal.pipeline.lake.fingerprint import content_digest, library_versions
from moeheal.pipeline.lake.sqlrun import run_sql

CODE_VERSION = __version__
STAGE_FOLDERS = ("dumps", "quant", "models", "parts", "runs", "tmp", "published")
PUBLISHED_LINKS = {"tables": "current/tables", "lake.duckdb": "current/lake.duckdb", "report": "current/report"}
SOURCES_FILE = "sources.json"  # per published set: table -> the stage fingerprints it was read from
KEEP_GENERATIONS = 2  # the current published set and the one before it


@dataclass(frozen=True)
class StageResult:
    """A finished stage output: where it lives and whether this run computed it."""

    stage: str
    fingerprint: str
    path: Path
    cached: bool


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    base = path if path.is_dir() else path.parent
    return {str(f.relative_to(base)): {"size": f.stat().st_size, "sha256": content_digest(f)}
            for f in files}


class TableSet:
    """Named Parquet tables in one folder, with DuckDB over them: the published set or a staged one."""

    def __init__(self, tables_dir: Path):
        self.tables_dir = tables_dir

    def table_path(self, name: str) -> Path:
        return self.tables_dir / f"{name}.parquet"

    def read_table(self, name: str) -> pa.Table:
        return pq.read_table(self.table_path(name))

    def table_names(self) -> list[str]:
        return sorted(p.stem for p in self.tables_dir.glob("*.parquet")) if self.tables_dir.is_dir() else []

    def connect(self) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB with one view per table (nothing on disk is locked or written)."""
        con = duckdb.connect()
        for name in self.table_names():
            _create_view(con, name, self.table_path(name).resolve())
        return con

    def query(self, stem: str, **params: Any) -> pa.Table:
        """Run `sql/<stem>.sql` over these tables with named parameters."""
        con = self.connect()
        try:
            return run_sql(con, stem, **params)
        finally:
            con.close()


class Publication(TableSet):
    """A run's tables, staged under tmp/ until `Lake.publish` makes them the lake's current set."""

    def __init__(self, lake: "Lake"):
        self.lake = lake
        self.id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.folder = lake.root / "tmp" / f"publish-{self.id}"
        super().__init__(self.folder / "tables")
        self.tables_dir.mkdir(parents=True)

    def write_table(self, name: str, table: pa.Table, sources: list[str] | None = None) -> None:
        """Stage a table; `sources` identify what it was computed from (stage fingerprints, GGUF
        digests), so that a later partial run can tell whether it still matches (`Lake.sources`)."""
        write_parquet(self.table_path(name), table)
        self.record_sources(name, sources)

    def carry(self, name: str, current: Path, sources: list[str] | None) -> None:
        """Take a table of the current set into this one unchanged (a hard link: never written again)."""
        os.link(current.resolve(), self.table_path(name))
        self.record_sources(name, sources)

    def record_sources(self, name: str, sources: list[str] | None) -> None:
        recorded = read_sources(self.folder)
        recorded.pop(name, None)
        if sources is not None:
            recorded[name] = list(sources)
        (self.folder / SOURCES_FILE).write_text(json.dumps(recorded, indent=1, sort_keys=True))

    @property
    def report_dir(self) -> Path:
        return self.folder / "report"

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class Lake(TableSet):
    """One data root. Stage outputs are keyed by fingerprint; tables are read from the published set."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        super().__init__(self.root / "tables")
        try:
            for sub in STAGE_FOLDERS:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            if not self._published_set_linked():
                with self.lock("layout"):  # shards of one heal open a new lake at the same moment
                    self._link_published_set()
        except OSError as exc:
            raise InputError(f"{exc.filename2 or exc.filename or self.root}: lake: cannot write ({exc.strerror})") from None

    def _published_set_linked(self) -> bool:
        current = self.root / "current"
        return ((current.is_symlink() or not current.exists())
                and all((self.root / name).is_symlink() for name in PUBLISHED_LINKS))

    def _link_published_set(self) -> None:
        """The links `tables`, `lake.duckdb` and `report` into `current/`, made where missing."""
        current = self.root / "current"
        if current.exists() and not current.is_symlink():
            _remove(current)  # copied without its links: whatever is there is not a published set
        for name, target in PUBLISHED_LINKS.items():
            link = self.root / name
            if not link.is_symlink():
                _remove(link)  # loose tables (an older layout, a copy that followed links) are not a set
                link.symlink_to(target)

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
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
        return record.get("fingerprint") == fingerprint and record.get("outputs") == _manifest(out)

    @contextmanager
    def lock(self, name: str, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """An exclusive lock on `tmp/<name>.lock`, across processes, removed when released.

        flock dies with its holder, so a crashed holder never blocks anyone. The
        file is unlinked on release; a waiter that got the lock on a file which
        was unlinked meanwhile retries on the new one, so two holders never
        coexist. The holder's pid is written into the file; `on_wait` is told
        who holds it before this process blocks.
        """
        path = self.root / "tmp" / f"{name}.lock"
        while True:
            with open(path, "a+") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if on_wait is not None:
                        handle.seek(0)
                        on_wait(f"lake {self.root} is in use by moeheal pid {handle.read().strip() or '?'}; waiting")
                    fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    if os.fstat(handle.fileno()).st_ino != os.stat(path).st_ino:
                        continue  # unlinked by the previous holder after we opened it
                except FileNotFoundError:
                    continue
                handle.truncate(0)
                handle.write(str(os.getpid()))
                handle.flush()
                try:
                    yield
                finally:
                    path.unlink(missing_ok=True)
                return

    def work_path(self, kind: str, fingerprint: str, suffix: str = "") -> Path:
        """Where a stage builds its output; stable per fingerprint so a killed build can resume."""
        return self.root / "tmp" / f"{kind}-{fingerprint}{suffix}"

    def materialize(self, stage: str, kind: str, fingerprint: str, suffix: str,
                    build: Callable[[Path], None], provenance: dict[str, Any],
                    log: Callable[[str], None] = print, resume: bool = False,
                    label: str | None = None) -> StageResult:
        """Return the output for `fingerprint`, building it under tmp/ and publishing it if absent.

        A build that was killed leaves its work under tmp/; it is discarded, or
        handed to `build` again when the stage can `resume` from it. The log
        lines name the invocation by `label` (`quantize:v1:3`), else the stage.
        """
        shown = label or stage
        final = self.output_path(kind, fingerprint, suffix)
        with self.lock(fingerprint):
            if self.is_complete(kind, fingerprint, suffix):
                log(f"[{shown}] cache hit {fingerprint[:12]}")
                return StageResult(stage, fingerprint, final, cached=True)
            work = self.work_path(kind, fingerprint, suffix)
            if work.exists() and not resume:
                _remove(work)
            started = time.time()
            log(f"[{shown}] computing {fingerprint[:12]}")
            try:
                build(work)
            except OSError as exc:  # a full disk, say: no partial output stays behind (a resumable one is kept)
                if not resume:
                    _remove(work)
                exc.filename = exc.filename or str(work)  # writes through file objects name no path
                raise
            _remove(final)  # an incomplete or tampered output under this name
            os.replace(work, final)
            record = {
                "stage": stage, "fingerprint": fingerprint, "code_version": CODE_VERSION,
                "libraries": library_versions(), "started": started, "finished": time.time(),
                "outputs": _manifest(final), **provenance,
            }
            atomic_write_bytes(self.provenance_path(fingerprint),
                               json.dumps(record, indent=1, sort_keys=True, default=str).encode())
            return StageResult(stage, fingerprint, final, cached=False)

    # ---- published table sets -------------------------------------------------------
    def begin_publication(self) -> Publication:
        return Publication(self)

    def publish(self, publication: Publication) -> Path:
        """Make `publication` the lake's current set in one atomic step; return its folder.

        Writes `lake.duckdb` (views with paths relative to the lake) into the
        staged folder, moves it to `published/<id>`, then renames a fresh
        `current` link over the old one. Older sets beyond the last
        KEEP_GENERATIONS are removed.
        """
        write_views(publication.folder / "lake.duckdb",
                    {name: f"tables/{name}.parquet" for name in publication.table_names()})
        publication.report_dir.mkdir(exist_ok=True)
        final = self.root / "published" / publication.id
        with self.lock("publish"):
            os.replace(publication.folder, final)
            link = self.root / "tmp" / f"current.{os.getpid()}.link"
            link.unlink(missing_ok=True)
            link.symlink_to(Path("published") / publication.id)
            os.replace(link, self.root / "current")
            generations = sorted((p for p in (self.root / "published").iterdir() if p.is_dir()),
                                 key=lambda p: p.stat().st_mtime)
            for old in generations[:-KEEP_GENERATIONS]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        return final

    def republish(self, replace: dict[str, pa.Table], report: Callable[[TableSet, Path], Any] | None = None) -> Path:
        """A new set: the current tables with `replace` swapped in, and optionally a new report.

        For edits after a run (tests, `moeheal report`): the unchanged tables are
        hard links to the current set's files, which are never written again.
        """
        publication = self.begin_publication()
        try:
            sources = self.sources()
            for name in self.table_names():
                if name not in replace:
                    publication.carry(name, self.table_path(name), sources.get(name))
            for name, table in replace.items():
                publication.write_table(name, table)
            if report is not None:
                report(publication, publication.report_dir)
            return self.publish(publication)
        except BaseException:
            publication.discard()
            raise

    def write_table(self, name: str, table: pa.Table) -> None:
        """Publish one table (a new set, the others carried over)."""
        self.republish({name: table})

    def sources(self) -> dict[str, list[str]]:
        """What each table of the current set was computed from (`Publication.write_table`)."""
        return read_sources(self.root / "current")

    @property
    def report_dir(self) -> Path:
        return self.root / "report"


def read_sources(folder: Path) -> dict[str, list[str]]:
    """The sources record of a published or staged set ({} for a set without one)."""
    path = folder / SOURCES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _remove(path: Path) -> None:
    """Remove a file, link or folder if present."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def write_views(path: Path, relative_tables: dict[str, str]) -> None:
    """A DuckDB file holding one view per table over a path relative to the file's folder."""
    path.unlink(missing_ok=True)
    con = duckdb.connect(str(path))
    try:
        con.execute("SET file_search_path = $folder", {"folder": str(path.parent)})  # views bind when created
        for name, rel in relative_tables.items():
            _create_view(con, name, Path(rel))
    finally:
        con.close()


def _create_view(con: duckdb.DuckDBPyConnection, name: str, parquet: Path) -> None:
    """A view over one Parquet file. DDL takes no bound parameters, so the identifier and
    the path literal are quoted here, and only here; table names come from our own files."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"bad table name {name!r}")
    literal = str(parquet).replace("'", "''")
    con.execute(f"CREATE OR REPLACE VIEW \"{name}\" AS SELECT * FROM read_parquet('{literal}')")
