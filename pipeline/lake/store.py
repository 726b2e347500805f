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
for you). A set's views read its own files (`published/<id>/tables/...`), never
a path through `current`, and a set stays while a DuckDB session has its
`lake.duckdb` open (`_open_in_duckdb`).

Every set carries `generation.json`: its sequence number, given under the
publish lock, the set it replaced, and its files with their sizes. Sets are
ordered and pruned by that record alone, never by a clock or a modification
time (a notebook that opens `lake.duckdb` read-write writes into a set's
folder; the lake may live on NFS). The lake's layout version is in
`layout.json` (LAYOUT_HISTORY); a lake this code cannot read is refused in
one line, and a version-1 lake is upgraded in place on its first write.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
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
GENERATION_FILE = "generation.json"  # per published set: its sequence number, the set it replaced, its files
KEEP_GENERATIONS = 2  # the current published set and the one before it

LAYOUT_FILE = "layout.json"  # at the lake's root: {"layout": N, "written_by": "moeheal X"}
LAYOUT_VERSION = 2  # what this code writes
READS_LAYOUTS = (1, 2)  # what it reads (a version-1 lake is upgraded on its first write)
LAYOUT_HISTORY = {
    1: "published/<id>/ sets ordered and pruned by folder modification time; no layout.json (moeheal up to 0fb9cec)",
    2: "every published set carries generation.json (sequence number, the set it replaced, its files), ordered and "
       "pruned by it; layout.json at the root. Released with the stage code identity that ignores comments and "
       "docstrings, which gives every stage a new fingerprint once: the first heal after the upgrade recomputes "
       "(the old outputs stay until `moeheal lake gc`)",
}
KILL_AT = "MOEHEAL_KILL_AT"  # tests: a publishing process SIGKILLs itself at this step (`_kill_at`)
PINS = "pins"  # under tmp/: `<set>.lock`, held shared by the readers of a published set (`Lake.pin_current`)


@dataclass(frozen=True)
class StageResult:
    """A finished stage output: where it lives and whether this run computed it."""

    stage: str
    fingerprint: str
    path: Path
    cached: bool


# Files hashed at once for a manifest: SHA-256 releases the interpreter on large reads, and a dump is
# thousands of chunk files (1.2 GB a layer at the 30B shape: a second a layer on one core).
MANIFEST_THREADS = min(8, os.cpu_count() or 1)


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    """Every file of an output with its size and SHA-256, by relative path."""
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    base = path if path.is_dir() else path.parent
    with ThreadPoolExecutor(MANIFEST_THREADS) as pool:
        digests = list(pool.map(content_digest, files)) if len(files) > 1 else [content_digest(f) for f in files]
    return {str(f.relative_to(base)): {"size": f.stat().st_size, "sha256": digest}
            for f, digest in zip(files, digests)}


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


class PinnedConnection:
    """A DuckDB connection (every attribute is the connection's) whose published set stays pinned
    until `close()`."""

    def __init__(self, con: duckdb.DuckDBPyConnection, unpin: Callable[[], None]):
        self._con, self._unpin = con, unpin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)

    def close(self) -> None:
        try:
            self._con.close()
        finally:
            self._unpin()

    def __enter__(self) -> PinnedConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._unpin()


class Lake(TableSet):
    """One data root. Stage outputs are keyed by fingerprint; tables are read from the published set."""

    def __init__(self, root: str | Path, check_current: bool = True):
        """Open (or make) the lake at `root`. A layout this code cannot read is refused (InputError,
        one line); so is a `current` link that points at nothing, unless `check_current` is False
        (`moeheal lake repair`). Nothing in a version-1 lake is written until its first write."""
        self.root = Path(root).resolve()
        super().__init__(self.root / "tables")
        self.layout = read_layout(self.root)
        try:
            for sub in STAGE_FOLDERS:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            if not self._published_set_linked():
                with self.lock("layout"):  # shards of one heal open a new lake at the same moment
                    self._link_published_set()
        except OSError as exc:
            raise InputError(f"{exc.filename2 or exc.filename or self.root}: lake: cannot write ({exc.strerror})") from None
        if check_current:
            self.current_folder()

    def _published_set_linked(self) -> bool:
        current = self.root / "current"
        return ((current.is_symlink() or not current.exists())
                and all((self.root / name).is_symlink() for name in PUBLISHED_LINKS))

    def _link_published_set(self) -> None:
        """The links `tables`, `lake.duckdb` and `report` into `current/`, made where missing; a new
        lake (no layout record, nothing published) records this code's layout version."""
        current = self.root / "current"
        if current.exists() and not current.is_symlink():
            _remove(current)  # copied without its links: whatever is there is not a published set
        for name, target in PUBLISHED_LINKS.items():
            link = self.root / name
            if not link.is_symlink():
                _remove(link)  # loose tables (an older layout, a copy that followed links) are not a set
                link.symlink_to(target)
        if not (self.root / LAYOUT_FILE).exists() and not current.is_symlink() and not set_folders(self.root):
            write_layout(self.root)
            self.layout = LAYOUT_VERSION

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
            self.ensure_layout()  # the lake's first write brings an older layout up to date
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

    def current_folder(self) -> Path | None:
        """The published set `current` points at, resolved once (None: nothing published yet).
        A link that points at nothing is an InputError naming it and `moeheal lake repair`."""
        link = self.root / "current"
        if not link.is_symlink():
            return None
        folder = link.resolve()
        if not folder.is_dir():
            raise InputError(f"{link}: points at {os.readlink(link)}, which does not exist; the lake is left as it "
                             "is: `moeheal lake repair -c CONFIG` relinks its newest complete published set")
        return folder

    def connect(self) -> PinnedConnection:
        """TableSet.connect over the current set, `current` resolved once and the set pinned until the
        connection is closed: every view reads that one set, whatever is published meanwhile."""
        folder, unpin = self.pin_current()
        try:
            con = TableSet(folder / "tables" if folder is not None else self.tables_dir).connect()
        except BaseException:
            unpin()
            raise
        return PinnedConnection(con, unpin)

    def pin_current(self) -> tuple[Path | None, Callable[[], None]]:
        """The current set's folder and the function that unpins it.

        A reader holds `tmp/pins/<set>.lock` shared; pruning takes it exclusively without waiting
        and leaves a set that is read for a later publication to remove. A set pruned between
        resolving `current` and pinning it is gone once the pin is held: `current` is resolved
        again. In a lake this process cannot write, the set is read unpinned.
        """
        while True:
            folder = self.current_folder()
            if folder is None:
                return None, lambda: None
            try:
                (self.root / "tmp" / PINS).mkdir(exist_ok=True)
                handle = open(self.root / "tmp" / PINS / f"{folder.name}.lock", "a+")
            except OSError:
                return folder, lambda: None
            fcntl.flock(handle, fcntl.LOCK_SH)
            if folder.is_dir():
                return folder, handle.close
            handle.close()

    def publish(self, publication: Publication) -> Path:
        """Make `publication` the lake's current set in one atomic step; return its folder.

        Writes `lake.duckdb` (views over the set's own files, by paths relative
        to the lake) into the staged folder, then, under the publish lock, gives
        it the next sequence number (`generation.json`), moves it to
        `published/<id>`, renames a fresh `current` link over the old one and
        prunes: a set goes once KEEP_GENERATIONS newer sets have been published
        after it. Killed at any step, the lake shows the old set or the new one
        (tests/test_publish.py).
        """
        _stage_views(publication)
        with self.lock("publish"):
            return self._publish_locked(publication)

    def _publish_locked(self, publication: Publication) -> Path:
        self._upgrade_locked()
        replaced = self.current_folder()  # refuses a link that points at nothing: nothing is rebuilt over it
        generations = published_generations(self.root)
        record = {"seq": max((g.seq for g in generations), default=0) + 1, "id": publication.id,
                  "previous": replaced.name if replaced is not None else None, "layout": LAYOUT_VERSION,
                  "written_by": f"moeheal {CODE_VERSION}", "published": time.time(),  # for people; never ordered by
                  "files": _file_sizes(publication.folder)}
        atomic_write_bytes(publication.folder / GENERATION_FILE, json.dumps(record, indent=1).encode())
        final = self.root / "published" / publication.id
        os.replace(publication.folder, final)
        _kill_at("moved")
        link = self.root / "tmp" / f"current.{os.getpid()}.link"
        link.unlink(missing_ok=True)
        link.symlink_to(Path("published") / publication.id)
        _kill_at("linked")
        os.replace(link, self.root / "current")
        _kill_at("switched")
        self._prune_locked()
        return final

    def _prune_locked(self) -> None:
        """Remove the sets that KEEP_GENERATIONS newer published sets have followed.

        What was published is the chain of `previous` from the current set (a set
        moved in by a publication killed before its link never became current, is
        not on it, and does not count); the sets kept are the chain's first
        KEEP_GENERATIONS, and everything older than the oldest of them goes. A set
        goes by a rename out of `published/` first, so no half-removed set is ever
        there, and the set `current` points at is never touched.
        """
        current = self.current_folder()
        if current is None:
            return
        by_name = {g.folder.name: g for g in published_generations(self.root)}
        chain = [by_name[current.name]] if current.name in by_name else []
        while chain and len(chain) < KEEP_GENERATIONS and chain[-1].previous in by_name:
            chain.append(by_name[chain[-1].previous])
        if len(chain) < KEEP_GENERATIONS:
            return  # fewer published sets than kept, or a chain broken by hand: nothing is provably old
        oldest = min(g.seq for g in chain)
        for old in sorted(by_name.values(), key=lambda g: g.seq):
            if old.seq < oldest and old.folder != self.current_folder():
                self._remove_set(old.folder)

    def _remove_set(self, folder: Path) -> bool:
        """Remove a published set unless a reader has it pinned or a DuckDB session has its `lake.duckdb`
        open, a notebook whose views read this set's files (then a later publication removes it)."""
        pins = self.root / "tmp" / PINS
        pins.mkdir(exist_ok=True)
        with open(pins / f"{folder.name}.lock", "a+") as pin:
            try:
                fcntl.flock(pin, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if _open_in_duckdb(folder / "lake.duckdb"):
                return False
            trash = self.root / "tmp" / f"pruned-{folder.name}"
            _remove(trash)
            os.replace(folder, trash)  # out of published/ whole, in one step
            (pins / f"{folder.name}.lock").unlink(missing_ok=True)
        _kill_at("pruning")
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def _upgrade_locked(self) -> None:
        """Under the publish lock: bring the lake to this code's layout before its first write.

        Each set without `generation.json` (every set of a version-1 lake; one
        published since by older moeheal) gets the next sequence numbers in
        the order it was most likely published: `current`'s set last, the
        others by the modification time of their `sources.json` (written when
        the set's last table was staged, and never after), else by the start
        second in their id. Idempotent: a killed upgrade is finished by the
        next write. Also removes what a killed pruning left under tmp/.
        """
        for trash in (self.root / "tmp").glob("pruned-*"):
            shutil.rmtree(trash, ignore_errors=True)
        for pin in (self.root / "tmp" / PINS).glob("*.lock"):  # a reader's pin on a set long gone
            if not (self.root / "published" / pin.stem).is_dir():
                with open(pin, "a+") as handle:
                    try:
                        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    pin.unlink(missing_ok=True)
        sequenced = published_generations(self.root)
        strays = [f for f in set_folders(self.root) if read_generation(f) is None]
        if strays:
            link = self.root / "current"
            current = link.resolve() if link.is_symlink() else None
            strays.sort(key=lambda f: (f == current, _staged_time(f), f.name))
            previous = max(sequenced, key=lambda g: g.seq, default=None)
            seq = previous.seq if previous is not None else 0
            last = previous.folder.name if previous is not None else None
            for folder in strays:
                seq += 1
                record = {"seq": seq, "id": folder.name, "previous": last, "layout": 1,
                          "written_by": f"moeheal {CODE_VERSION}, upgrading a set it did not write",
                          "files": _set_files(folder)}
                atomic_write_bytes(folder / GENERATION_FILE, json.dumps(record, indent=1).encode())
                _kill_at("sequencing")
                last = folder.name
        if read_layout(self.root) < LAYOUT_VERSION:
            write_layout(self.root)
        self.layout = LAYOUT_VERSION

    def ensure_layout(self) -> None:
        """Upgrade an older layout before writing (a no-op once it is this code's)."""
        if self.layout < LAYOUT_VERSION:
            with self.lock("publish"):
                self._upgrade_locked()

    def republish(self, replace: dict[str, pa.Table], report: Callable[[TableSet, Path], Any] | None = None) -> Path:
        """A new set: the current tables with `replace` swapped in, and optionally a new report.

        For edits after a run (tests, `moeheal report`): the unchanged tables are
        hard links to the current set's files, which are never written again.
        The whole of it holds the publish lock, so the set it starts from is
        still the current one when it publishes (no publication in between is
        undone) and no table of another set is mixed in.
        """
        with self.lock("publish"):
            base = self.current_folder()
            publication = self.begin_publication()
            try:
                if base is not None:
                    sources, carried = read_sources(base), TableSet(base / "tables")
                    for name in carried.table_names():
                        if name not in replace:
                            publication.carry(name, carried.table_path(name), sources.get(name))
                for name, table in replace.items():
                    publication.write_table(name, table)
                if report is not None:
                    report(publication, publication.report_dir)
                _stage_views(publication)
                return self._publish_locked(publication)
            except BaseException:
                publication.discard()
                raise

    def write_table(self, name: str, table: pa.Table) -> None:
        """Publish one table (a new set, the others carried over)."""
        self.republish({name: table})

    def sources(self) -> dict[str, list[str]]:
        """What each table of the current set was computed from (`Publication.write_table`)."""
        folder = self.current_folder()
        return read_sources(folder) if folder is not None else {}

    def repair(self) -> str:
        """`moeheal lake repair`: point `current` at the newest complete published set when the set it
        points at is missing or incomplete; say what was done, in one line."""
        link = self.root / "current"
        with self.lock("publish"):
            self._upgrade_locked()
            target = os.readlink(link) if link.is_symlink() else None
            problem = set_problem(link.resolve()) if target is not None else "no current link"
            if problem is None:
                return f"{link} -> {target}: a complete published set; nothing to repair"
            for generation in sorted(published_generations(self.root), key=lambda g: g.seq, reverse=True):
                if set_problem(generation.folder) is None:
                    staged = self.root / "tmp" / f"current.{os.getpid()}.link"
                    staged.unlink(missing_ok=True)
                    staged.symlink_to(Path("published") / generation.folder.name)
                    os.replace(staged, link)
                    return (f"{link} -> published/{generation.folder.name}: the newest complete published set "
                            f"(generation {generation.seq}); it pointed at {target or 'nothing'} ({problem})")
            if target is None:
                return f"{self.root}: nothing published yet; nothing to repair"
            link.unlink()
            return (f"{link} pointed at {target} ({problem}) and published/ holds no complete set: the link is "
                    "removed, and nothing is published until the next run publishes")

    @property
    def report_dir(self) -> Path:
        return self.root / "report"


def read_sources(folder: Path) -> dict[str, list[str]]:
    """The sources record of a published or staged set ({} for a set without one)."""
    path = folder / SOURCES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


# ---- layout version and generations (module level: `moeheal lake` reads them without opening a Lake) ----
def read_layout(root: Path) -> int:
    """The layout version of the lake at `root` (1 without a record: every lake before the record was
    introduced). A version this code cannot read is an InputError saying which moeheal wrote it."""
    path = root / LAYOUT_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        version = record["layout"]
    except FileNotFoundError:
        return 1
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not a lake layout record ({type(exc).__name__}: {exc}); moeheal {CODE_VERSION} "
                         f"reads layout versions {READS_LAYOUTS[0]} to {READS_LAYOUTS[-1]}") from None
    if version not in READS_LAYOUTS:
        raise InputError(f"{root}: lake layout version {version}, written by {record.get('written_by', 'unknown')}; "
                         f"moeheal {CODE_VERSION} reads versions {READS_LAYOUTS[0]} to {READS_LAYOUTS[-1]}: "
                         "upgrade moeheal (`pip install --upgrade moeheal`), or give [lake] root another folder")
    return int(version)


def write_layout(root: Path) -> None:
    atomic_write_bytes(root / LAYOUT_FILE, json.dumps({"layout": LAYOUT_VERSION,
                                                       "written_by": f"moeheal {CODE_VERSION}"}).encode())


@dataclass(frozen=True)
class Generation:
    """A published set: its folder, its sequence number and the set it replaced (a folder name)."""

    folder: Path
    seq: int
    previous: str | None


def set_folders(root: Path) -> list[Path]:
    """Every folder under `published/` (whatever state it is in)."""
    folder = root / "published"
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []


def read_generation(folder: Path) -> dict[str, Any] | None:
    """A set's `generation.json`, or None where it has none (a version-1 set) or it cannot be read."""
    try:
        record = json.loads((folder / GENERATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("seq"), int) else None


def published_generations(root: Path) -> list[Generation]:
    """The published sets that carry a sequence number, in no particular order (sort by `seq`)."""
    found = []
    for folder in set_folders(root):
        record = read_generation(folder)
        if record is not None:
            found.append(Generation(folder, record["seq"], record.get("previous")))
    return found


def sets_newest_first(root: Path) -> list[Path]:
    """The folders in `published/`, newest first, in the order of their sequence numbers as they are
    or as the next write will give them: those without one yet (a version-1 lake; a set published by
    an older moeheal since) get numbers above the others', `current`'s the highest. What `moeheal lake
    du` and `gc` mean by the newest N sets."""
    link = root / "current"
    current = link.resolve() if link.is_symlink() else None
    numbered = sorted(published_generations(root), key=lambda g: g.seq, reverse=True)
    strays = [f for f in set_folders(root) if read_generation(f) is None]
    strays.sort(key=lambda f: (f == current, _staged_time(f), f.name), reverse=True)
    return strays + [g.folder for g in numbered]


def set_problem(folder: Path) -> str | None:
    """Why `folder` is not a complete published set, or None when it is: its `lake.duckdb`, `tables/` and
    `report/`, and every file its `generation.json` lists at the size listed (a version-1 set: the tables
    its views name)."""
    if not folder.is_dir():
        return "missing"
    for name in ("tables", "report"):
        if not (folder / name).is_dir():
            return f"no {name}/"
    if not (folder / "lake.duckdb").is_file():
        return "no lake.duckdb"
    record = read_generation(folder)
    files = record.get("files") if record is not None else None
    for rel, size in (files if isinstance(files, dict) else _set_files(folder)).items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} missing"
        if size is not None and path.stat().st_size != size:
            return f"{rel} is {path.stat().st_size} bytes, {size} when published"
    return None


def _file_sizes(folder: Path) -> dict[str, int]:
    """Every file of a staged set with its size, but `lake.duckdb` (a notebook may write into it)."""
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name not in ("lake.duckdb", GENERATION_FILE)}


def _set_files(folder: Path) -> dict[str, int | None]:
    """A version-1 set's files as its views name them (size as found, None where missing); the tables
    present and those `sources.json` names where `lake.duckdb` cannot be read."""
    names: set[str] = set()
    try:
        con = duckdb.connect(str(folder / "lake.duckdb"), read_only=True)
        try:
            names = {row[0] for row in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        finally:
            con.close()
    except Exception:  # missing, damaged, or held read-write by a notebook
        names = set(read_sources(folder)) if (folder / SOURCES_FILE).is_file() else set()
        names |= {p.stem for p in (folder / "tables").glob("*.parquet")}
    files: dict[str, int | None] = {}
    for name in sorted(names):
        path = folder / "tables" / f"{name}.parquet"
        files[f"tables/{name}.parquet"] = path.stat().st_size if path.is_file() else None
    return files


def _staged_time(folder: Path) -> float:
    """When a version-1 set was most likely published: its `sources.json`'s modification time, else
    the start second in its id (`YYYYmmddTHHMMSS-<hex>`), else 0."""
    try:
        return (folder / SOURCES_FILE).stat().st_mtime
    except OSError:
        pass
    try:
        return time.mktime(time.strptime(folder.name.split("-")[0], "%Y%m%dT%H%M%S"))
    except ValueError:
        return 0.0


def _stage_views(publication: Publication) -> None:
    """The staged set's `lake.duckdb`: a view per table over `published/<id>/tables/<name>.parquet`, relative
    to the lake root, the file this set will hold once published and that never changes. Not `tables/...`:
    that goes through `current`, and DuckDB opens a file by its path once for the footer, when a query binds,
    and again for the data, so a publication in between gave one set's footer and another set's bytes
    (`TProtocolException: Invalid data`). The views bind as they are made, so they are made against a link
    `published/<id>` to the staged folder, removed after."""
    final = Path("published") / publication.id
    bind_root = publication.folder / ".views"
    (bind_root / final).parent.mkdir(parents=True)
    (bind_root / final).symlink_to(Path("..") / "..")  # .views/published/<id> -> the staged folder
    try:
        write_views(publication.folder / "lake.duckdb", bind_root,
                    {name: str(final / "tables" / f"{name}.parquet") for name in publication.table_names()})
    finally:
        shutil.rmtree(bind_root)
    publication.report_dir.mkdir(exist_ok=True)


def _kill_at(step: str) -> None:
    """Fault injection for the tests: SIGKILL this process at `step` when MOEHEAL_KILL_AT names it."""
    if os.environ.get(KILL_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _remove(path: Path) -> None:
    """Remove a file, link or folder if present."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def write_views(path: Path, bind_root: Path, relative_tables: dict[str, str]) -> None:
    """A DuckDB file holding one view per table over a relative path, found under `bind_root` while the
    views are made (they bind then); a reader resolves it from its own working folder."""
    path.unlink(missing_ok=True)
    con = duckdb.connect(str(path))
    try:
        con.execute("SET file_search_path = $folder", {"folder": str(bind_root)})
        for name, rel in relative_tables.items():
            _create_view(con, name, Path(rel))
    finally:
        con.close()


def _open_in_duckdb(database: Path) -> bool:
    """Whether another process has `database` open in DuckDB, which locks the whole file for as long as it
    has it open (shared read-only, exclusive read-write). Asked with F_GETLK, which takes no lock: one
    taken here would make a DuckDB opening the file meanwhile fail. This process's own locks are not seen."""
    try:
        fd = os.open(database, os.O_RDONLY)
    except FileNotFoundError:
        return False
    if sys.platform == "darwin":  # struct flock: l_start, l_len, l_pid, l_type, l_whence
        layout, ask, kind = "qqihh", (0, 0, 0, fcntl.F_WRLCK, os.SEEK_SET), 3
    else:  # Linux: l_type, l_whence, l_start, l_len, l_pid, padding
        layout, ask, kind = "hhqqi4x", (fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0), 0
    try:  # a write lock on the whole file (length 0): any lock another process holds on it conflicts
        held = struct.unpack(layout, fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(layout, *ask)))
        return held[kind] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _create_view(con: duckdb.DuckDBPyConnection, name: str, parquet: Path) -> None:
    """A view over one Parquet file. DDL takes no bound parameters, so the identifier and
    the path literal are quoted here, and only here; table names come from our own files."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"bad table name {name!r}")
    literal = str(parquet).replace("'", "''")
    con.execute(f"CREATE OR REPLACE VIEW \"{name}\" AS SELECT * FROM read_parquet('{literal}')")
