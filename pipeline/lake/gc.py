"""What a lake holds, what the given configs still read, and removing the rest: `moeheal lake du` and `gc`.

Nothing in a lake is ever removed by a run: each knob change leaves its old
units (`quant/`), dumps, parts and GGUFs behind, and a killed build its work
under `tmp/`. What a config still reads is what `moeheal plan` lists: every
stage invocation of its heal by fingerprint (`HealRun.plan`, the one planner).
What a published set was computed from is its `sources.json`. `gc` removes
every stage output that no given config plans and no kept published set names
(the newest `--keep-sets`, by default the current one: the set before it names
the outputs a knob change just replaced), with its provenance, and the stale
entries of `tmp/`; it is a dry run unless told `--yes`.

It never removes what a running command may read: every command that writes a
lake holds `heal.lock` at its root shared for its whole run (`heal_lock`), and `gc`
takes it exclusively, so it waits for them and they for it; a stage output or
work folder is removed under its own fingerprint lock (`try_lock`), taken
without waiting, so one being built is left alone. It never descends into a
lake nested in this one (the demo keeps its ablation lakes under its own), and
it leaves the published sets themselves to the lake, which keeps the last two.
Sizes count each file once however many hard links it has (published sets
share unchanged tables).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moeheal.pipeline.config import load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.lake.store import SOURCES_FILE

LOCK_FILE = "heal.lock"  # at the root, beside tmp/ (whose leftovers gc removes): held shared by every command
                         # that writes the lake, exclusively by gc
OUTPUT_FOLDERS = ("dumps", "quant", "models", "parts")
LAYOUT = ("dumps", "quant", "models", "parts", "runs", "tmp", "published", "current", "tables", "lake.duckdb",
          "report", "layout.json", LOCK_FILE)
GENERATION_FILE = "generation.json"  # a published set's record: {"seq": its place in the order of publication, ...}
NO_PROVENANCE = "(no provenance)"  # an output whose build was cut before its record was written
ORPHAN = "(provenance alone)"  # a record whose output is gone


@contextmanager
def heal_lock(root: Path, exclusive: bool = False, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """`heal.lock` at the root of the lake at `root`: shared by a command that writes the lake, for its whole
    run; exclusive for `gc`. flock dies with its holder, so a crashed run never blocks gc. The file is
    never removed (shared holders cannot tell who is last)."""
    path = root / LOCK_FILE
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(f"lake {root}: " + ("a moeheal command is using it; gc waits until it ends" if exclusive
                                            else "moeheal lake gc is removing outputs; waiting"))
            fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def try_lock(path: Path) -> Iterator[bool]:
    """`Lake.lock`'s lock file at `path`, taken without waiting: True while held here (the file is
    removed on release, as `Lake.lock` does), False where another process holds it."""
    while True:
        with open(path, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                if os.fstat(handle.fileno()).st_ino != os.stat(path).st_ino:
                    continue  # unlinked by its previous holder after we opened it
            except FileNotFoundError:
                continue
            try:
                yield True
            finally:
                path.unlink(missing_ok=True)
            return


def is_lake(folder: Path) -> bool:
    """A folder laid out as a lake (`Lake` makes both): one to leave alone inside another."""
    return (folder / "runs").is_dir() and (folder / "published").is_dir()


@dataclass(frozen=True)
class FileRef:
    inode: tuple[int, int]  # (device, inode): one file however many links
    size: int
    links: int


def files_under(path: Path) -> tuple[list[FileRef], bool]:
    """Every file at or under `path` (links not followed), and whether a nested lake was met (not entered)."""
    if path.is_symlink() or not path.exists():
        return [], False
    if not path.is_dir():
        st = path.stat()
        return [FileRef((st.st_dev, st.st_ino), st.st_size, st.st_nlink)], False
    if is_lake(path):
        return [], True
    found, nested = [], False
    for folder, dirs, names in os.walk(path):
        for name in list(dirs):
            if is_lake(Path(folder, name)):
                dirs.remove(name)
                nested = True
        for name in names:
            st = os.lstat(os.path.join(folder, name))
            if not os.path.islink(os.path.join(folder, name)):
                found.append(FileRef((st.st_dev, st.st_ino), st.st_size, st.st_nlink))
    return found, nested


@dataclass(frozen=True)
class Item:
    """One thing gc could remove: a stage output with its provenance record, a lone record, a tmp/ entry."""

    group: str  # the stage that wrote it, NO_PROVENANCE, ORPHAN, "tmp" or "published"
    folder: str  # dumps, quant, models, parts, runs, tmp, published
    fingerprint: str  # "" for a tmp/ entry that is no stage's work, a published set
    paths: tuple[Path, ...]  # the provenance record first: removed before its output
    files: tuple[FileRef, ...]
    nested: bool  # holds a lake: never removed
    read: bool  # a given config plans it (a tmp/ entry: a build of a planned fingerprint, to resume)
    kept: str  # why gc keeps it ("" where it removes it)


def fingerprint_of(name: str) -> str:
    """`<fp>.zarr`, `<fp>.gguf`, `<fp>` -> fp; a tmp/ work folder `<kind>-<fp><suffix>` -> fp; else ""."""
    kind, dash, rest = name.partition("-")
    stem = (rest if dash and kind in OUTPUT_FOLDERS else name).split(".")[0]
    return stem if len(stem) >= 16 and all(c in "0123456789abcdef" for c in stem) else ""


def leftover(name: str) -> bool:
    """A tmp/ entry gc knows the making of, so removes when stale: a stage's work (`<folder>-<fp>`), a
    set staged and never published (`publish-*`), a `Lake.lock` file, a link or file half written (its
    writer died). Anything else there (the readers' pins, `tmp/pins/`) is the lake's own and left."""
    return (bool(fingerprint_of(name)) or name.startswith("publish-") or name.endswith((".lock", ".tmp"))
            or (name.startswith("current.") and name.endswith(".link")))


def provenance_stage(record: Path) -> str:
    try:
        return str(json.loads(record.read_text()).get("stage", NO_PROVENANCE))
    except (OSError, ValueError):
        return NO_PROVENANCE


def publication_order(folder: Path) -> tuple[int, float]:
    """Where a published set comes in the order of publication: by its `generation.json` sequence number,
    a set without one (published by an older moeheal) before every set with one, by its folder's time."""
    try:
        seq = json.loads((folder / GENERATION_FILE).read_text())["seq"]
    except (OSError, ValueError, KeyError, TypeError):
        seq = -1
    return (seq if isinstance(seq, int) else -1), folder.stat().st_mtime


def published_sets(root: Path) -> list[Path]:
    """The published sets, newest first."""
    folder = root / "published"
    sets = [p for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    return sorted(sets, key=publication_order, reverse=True)


def named_by(sets: Iterable[Path]) -> set[str]:
    """Every stage fingerprint (or outside file's digest) the sets' `sources.json` name."""
    named: set[str] = set()
    for folder in sets:
        try:
            sources = json.loads((folder / SOURCES_FILE).read_text())
        except (OSError, ValueError):
            continue
        named |= {fp for fps in sources.values() for fp in fps}
    return named


@dataclass(frozen=True)
class Keep:
    """What gc keeps: the fingerprints the configs plan, those the kept published sets name, and the
    stages a plan could not fingerprint here (llama.cpp's where it is not installed: all theirs are kept)."""

    read: frozenset[str]
    named: frozenset[str]
    skipped: frozenset[str]

    def why(self, stage: str, fingerprint: str) -> str:
        if fingerprint in self.read:
            return "read by the configs"
        if fingerprint in self.named:
            return "named by a kept published set"
        return "of a stage skipped here" if stage in self.skipped else ""


def survey(root: Path, keep: Keep) -> list[Item]:
    """Every stage output, lone provenance record, published set and tmp/ entry of the lake at `root`."""
    items: list[Item] = []
    runs = root / "runs"
    with_output: set[str] = set()
    for folder in OUTPUT_FOLDERS:
        for path in sorted((root / folder).iterdir()) if (root / folder).is_dir() else ():
            fp = fingerprint_of(path.name)
            record = runs / f"{fp}.json"
            stage = provenance_stage(record) if fp and record.exists() else NO_PROVENANCE
            with_output.add(fp)
            files, nested = files_under(path)
            record_files = files_under(record)[0] if fp else []
            items.append(Item(stage, folder, fp, (record, path) if fp else (path,), tuple(record_files + files),
                              nested, fp in keep.read, keep.why(stage, fp)))
    for record in sorted(runs.iterdir()) if runs.is_dir() else ():
        fp = fingerprint_of(record.name)
        if fp not in with_output:
            items.append(Item(ORPHAN, "runs", fp, (record,), tuple(files_under(record)[0]), False,
                              fp in keep.read, keep.why(ORPHAN, fp)))
    for folder in published_sets(root):
        files, nested = files_under(folder)
        items.append(Item("published", "published", "", (folder,), tuple(files), nested, False,
                          "the lake's own: it keeps the last two"))
    for path in sorted((root / "tmp").iterdir()) if (root / "tmp").is_dir() else ():
        fp = fingerprint_of(path.name)
        files, nested = files_under(path)
        read = bool(fp) and fp in keep.read
        kept = "work of a planned stage, to resume" if read else "" if leftover(path.name) else "the lake's own"
        items.append(Item("tmp", "tmp", fp, (path,), tuple(files), nested, read, kept))
    return items


def removable(item: Item) -> bool:
    return not item.kept and not item.nested


def remove(root: Path, item: Item) -> bool:
    """Remove one item under its fingerprint's lock (a lock file itself under its own); False where a
    process holds that lock (being built or read right now), so it stays."""
    target = item.paths[-1]
    if item.folder == "tmp" and target.suffix == ".lock":
        with try_lock(target) as held:  # released, it is unlinked: that is the removal
            return held
    lock = root / "tmp" / f"{item.fingerprint}.lock" if item.fingerprint else None
    if lock is None:
        _remove(target)
        return True
    with try_lock(lock) as held:
        if held:
            for path in item.paths:  # the provenance record first: an output without one is never a cache hit
                _remove(path)
        return held


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


def unique_bytes(files: Iterable[FileRef], seen: set[tuple[int, int]]) -> int:
    """Bytes of the files not in `seen` (which they join): each file once however many links."""
    total = 0
    for f in files:
        if f.inode not in seen:
            seen.add(f.inode)
            total += f.size
    return total


def freed_bytes(items: Iterable[Item]) -> int:
    """Bytes removing `items` gives back: a file only where every one of its links is among them."""
    links: dict[tuple[int, int], int] = {}
    sizes: dict[tuple[int, int], FileRef] = {}
    for item in items:
        for f in item.files:
            links[f.inode] = links.get(f.inode, 0) + 1
            sizes[f.inode] = f
    return sum(f.size for inode, f in sizes.items() if links[inode] >= f.links)


def others(root: Path) -> list[str]:
    """Entries at the lake's top that are not its layout (a nested lake, a user's file): never touched."""
    found = []
    for path in sorted(root.iterdir()):
        if path.name in LAYOUT:
            continue
        _, nested = files_under(path) if path.is_dir() else ([], False)
        found.append(f"{path.name}/ (a lake)" if is_lake(path) else
                     f"{path.name}/ (holds lakes)" if nested else path.name)
    return found


def plan_keep(configs: list[Path], keep_sets: int) -> tuple[Path, Keep]:
    """The lake the configs share, and what gc keeps in it: every fingerprint their plans list
    (`moeheal plan`) and every one the newest `keep_sets` published sets name."""
    loaded = [load_config(path) for path in configs]
    root = loaded[0].lake_root
    for cfg in loaded[1:]:
        if cfg.lake_root != root:
            raise InputError(f"{cfg.path}: [lake] root {cfg.lake_root} is not {loaded[0].path}'s {root}: "
                             "`moeheal lake` reads configs of one lake")
    if keep_sets < 0:
        raise InputError(f"--keep-sets {keep_sets}: expected 0 or more published sets")
    planned = [p for cfg in loaded for p in HealRun(cfg, log=lambda message: None, plan=True).plan()]
    return root, Keep(read=frozenset(p.fingerprint for p in planned if p.status != "skipped"),
                      named=frozenset(named_by(published_sets(root)[:keep_sets])),
                      skipped=frozenset(p.name for p in planned if p.status == "skipped"))


def rows(items: list[Item]) -> list[tuple[str, str, list[Item]]]:
    """(what, folder, items) per stage that wrote them (in folder order), then tmp/, then the published sets."""
    groups: dict[tuple[str, str], list[Item]] = {}
    order = {name: i for i, name in enumerate(OUTPUT_FOLDERS + ("runs", "tmp", "published"))}
    for item in sorted(items, key=lambda i: (order[i.folder], i.group)):
        groups.setdefault((item.group, item.folder), []).append(item)
    return [(what, folder, members) for (what, folder), members in groups.items()]


def du_text(root: Path, items: list[Item], n_configs: int, keep_sets: int) -> str:
    """`moeheal lake du`: per stage its outputs, their bytes (each file once), how many the configs
    read and what gc would free; the published sets and tmp/ apart; what is not the lake's."""
    seen: set[tuple[int, int]] = set()
    lines = [f"{root}: {n_configs} config{'s' * (n_configs != 1)} read it",
             f"{'stage':<20} {'folder':<11} {'count':>6} {'bytes':>15} {'read':>6} {'gc frees':>15}"]

    def line(what: str, folder: str, members: list[Item]) -> str:
        n_bytes = unique_bytes((f for item in members for f in item.files), seen)
        frees = freed_bytes(item for item in members if removable(item))
        return (f"{what:<20} {folder:<11} {len(members):>6} {n_bytes:>15,} "
                f"{sum(item.read for item in members):>6} {frees:>15,}")

    outputs = [item for item in items if item.folder not in ("tmp", "published")]
    lines += [line(what, f"{folder}/", members) for what, folder, members in rows(outputs)]
    total = unique_bytes((f for item in outputs for f in item.files), set())
    lines.append(f"{'all stage outputs':<20} {'':<11} {len(outputs):>6} {total:>15,} "
                 f"{sum(item.read for item in outputs):>6} {freed_bytes(i for i in outputs if removable(i)):>15,}")
    lines.append("")
    for what, folder in (("tmp", "tmp"), ("published sets", "published")):
        lines.append(line(what, f"{folder}/", [item for item in items if item.folder == folder]))
    current = (root / "current").resolve().name if (root / "current").is_symlink() else "none"
    lines.append(f"published: current {current}; gc keeps what the newest {keep_sets} name")
    lines.append(f"gc would free {freed_bytes(item for item in items if removable(item)):,} bytes "
                 "(`moeheal lake gc --yes`)")
    lines += [f"not the lake's, left alone: {entry}" for entry in others(root)]
    return "\n".join(lines)


def gc_text(removed: list[Item], held: list[Item], kept: list[Item], freed: int, dry_run: bool) -> str:
    """`moeheal lake gc`: what it removed (or would), per stage, the bytes freed, and what it kept and why."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb}: {what} {folder}/ {len(members)}, {freed_bytes(members):,} bytes"
             for what, folder, members in rows(removed)]
    reasons: dict[str, int] = {}
    for item in (item for item in kept if item.folder != "published"):
        reason = "a nested lake" if item.nested else item.kept
        reasons[reason] = reasons.get(reason, 0) + 1
    lines.append(f"{'would free' if dry_run else 'freed'} {freed:,} bytes; kept "
                 + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())))
    if held:
        lines.append(f"left {len(held)} in use (a build holds its lock): "
                     + ", ".join(str(item.paths[-1].name) for item in held))
    if dry_run:
        lines.append("dry run: nothing removed; `moeheal lake gc --yes` removes it")
    return "\n".join(lines)


def du(configs: list[Path], keep_sets: int) -> str:
    root, keep = plan_keep(configs, keep_sets)
    return du_text(root, survey(root, keep), len(configs), keep_sets)


def gc(configs: list[Path], keep_sets: int, yes: bool, log: Callable[[str], None]) -> str:
    """Remove (with `yes`) every output no config reads and no kept published set names, and tmp/'s stale
    entries, holding the lake's heal lock exclusively: no command that writes the lake runs meanwhile."""
    root, keep = plan_keep(configs, keep_sets)
    if not yes:
        items = survey(root, keep)
        doomed = [item for item in items if removable(item)]
        return gc_text(doomed, [], [item for item in items if not removable(item)], freed_bytes(doomed), True)
    with heal_lock(root, exclusive=True, on_wait=log):
        items = survey(root, keep)
        removed, held = [], []
        for item in (item for item in items if removable(item)):
            if remove(root, item):
                removed.append(item)
            elif item.paths[-1].suffix != ".lock":  # a lock held is no leftover
                held.append(item)
    return gc_text(removed, held, [item for item in items if not removable(item)], freed_bytes(removed), False)
