"""Publishing that cannot lose a set, and the lake's layout version.

The published sets are ordered by a sequence number each gets under the publish lock, never by a
folder's modification time or a clock; a publishing process killed at any step leaves the old set or
the new one; a `current` link that points at nothing is refused by every command (exit 2, one line)
and mended by `moeheal lake repair`; a lake records its layout version, a version-1 lake (the layout
up to 0fb9cec, tests/fixtures/lake-v1) is read, and upgraded on its first write, and one from a newer
version is refused. The first two tests fail on the code at 0fb9cec (they use only what it had).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.lake import store
from moeheal.pipeline.lake.store import KEEP_GENERATIONS, Lake

REPO = Path(__file__).resolve().parents[1]
FIXTURE_V1 = Path(__file__).parent / "fixtures" / "lake-v1"


def publish(lake: Lake, token: str) -> Path:
    """A set whose table `t` holds `token`; returns its folder."""
    publication = lake.begin_publication()
    publication.write_table("t", pa.table({"token": [token]}))
    return lake.publish(publication)


def current_token(root: Path) -> str:
    return pq.read_table(root / "current" / "tables" / "t.parquet").column("token")[0].as_py()


def published_names(root: Path) -> set[str]:
    return {p.name for p in (root / "published").iterdir()}


def test_a_notebook_writing_into_an_older_set_does_not_get_a_newer_one_pruned(tmp_path):
    """A notebook that opened `lake.duckdb` read-write writes into the folder of the set that was
    current then; at 0fb9cec that made it the newest by modification time, and the next publication
    pruned the set before the current one instead: a finished run's set, lost with one newer set."""
    lake = Lake(tmp_path / "lake")
    publish(lake, "p1")
    notebook = duckdb.connect(str(lake.root / "current" / "lake.duckdb"))  # the file of p1's set, read-write
    time.sleep(0.01)
    p2 = publish(lake, "p2")
    time.sleep(0.01)
    notebook.execute("CREATE TABLE scratch AS SELECT 1 AS x")  # its WAL lands in p1's folder
    notebook.close()
    time.sleep(0.01)
    p3 = publish(lake, "p3")
    assert {p2.name, p3.name} <= published_names(lake.root)  # p2 had only p3 newer than it
    assert len(published_names(lake.root)) == KEEP_GENERATIONS
    assert current_token(lake.root) == "p3"


@contextmanager
def overlapping_publication(root: Path, token: str):
    """While the block runs, a publication by another process whose lock does not exclude ours starts
    and finishes the moment ours renames its `current` link (a lake on a file system whose flock each
    host keeps to itself: NFS mounted with local_lock, Lustre's localflock); just before it, a notebook
    writes into the current set's folder."""
    script = ("import sys, contextlib, pyarrow as pa\n"
              "from moeheal.pipeline.lake.store import Lake\n"
              "Lake.lock = lambda self, name, on_wait=None: contextlib.nullcontext()\n"
              "lake = Lake(sys.argv[1]); p = lake.begin_publication()\n"
              "p.write_table('t', pa.table({'token': [sys.argv[2]]})); lake.publish(p)\n")
    real_replace = os.replace
    done: list[bool] = []

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == root / "current" and not done:
            done.append(True)
            con = duckdb.connect(str(root / "current" / "lake.duckdb"))
            con.execute("CREATE TABLE scratch AS SELECT 1 AS x")
            con.close()
            subprocess.run([sys.executable, "-P", "-c", script, str(root), token], cwd=REPO, check=True)
        return real_replace(src, dst, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Lake, "lock", lambda self, name, on_wait=None: _no_lock())
        patch.setattr(os, "replace", replace)
        yield
    assert done


@contextmanager
def _no_lock():
    yield


def test_publications_that_overlap_never_leave_current_dangling(tmp_path):
    """What left the data-curve lake's `current` pointing at nothing: two publications at once. Each
    protected only its own set from pruning, which ranked the sets by modification time; the other
    one's brand-new set, older than a set a notebook had just written into, was pruned, and then
    became `current`. Sequence numbers and the chain of `previous` sets never rank a newer set below
    an older one."""
    lake = Lake(tmp_path / "lake")
    publish(lake, "s1")
    time.sleep(0.01)
    publish(lake, "s2")
    time.sleep(0.01)
    with overlapping_publication(lake.root, "other"):
        publish(lake, "mine")
    current = lake.root / "current"
    assert current.resolve().is_dir(), f"current -> {os.readlink(current)}, which does not exist"
    assert current_token(lake.root) in ("mine", "other")
    assert all(store.set_problem(folder) is None for folder in (lake.root / "published").iterdir())


def test_sequence_numbers_order_the_sets_not_ids_or_clocks(tmp_path):
    """A publication staged first (its id's second earlier) that publishes last is the newest; a set
    whose folder time is set ahead, or behind, is ranked by its number all the same."""
    lake = Lake(tmp_path / "lake")
    early = lake.begin_publication()  # a run that starts first ...
    early.write_table("t", pa.table({"token": ["early"]}))
    time.sleep(1.1)  # ids name the second a run started
    late = publish(lake, "late")
    os.utime(late, (time.time() + 3600, time.time() + 3600))  # a clock an hour ahead, or a notebook
    first = lake.publish(early)  # ... and publishes last
    assert first.name < late.name  # its id says older
    records = {p.name: store.read_generation(p) for p in (lake.root / "published").iterdir()}
    assert records[first.name]["seq"] == records[late.name]["seq"] + 1
    assert records[first.name]["previous"] == late.name
    assert current_token(lake.root) == "early"
    os.utime(first, (0, 0))
    third = publish(lake, "third")
    assert published_names(lake.root) == {first.name, third.name}  # `late` goes, whatever the times say


def test_a_reader_keeps_its_set_until_it_closes(tmp_path):
    """`Lake.connect` (what `moeheal sql` reads through) pins the set it resolved: the publications
    meanwhile leave it in place, and the first one after it closes removes it."""
    lake = Lake(tmp_path / "lake")
    pinned = publish(lake, "read")
    con = lake.connect()
    for n in range(3):
        publish(lake, f"later{n}")
    assert pinned.is_dir()
    assert con.sql("SELECT token FROM t").fetchall() == [("read",)]
    con.close()
    publish(lake, "after")
    assert not pinned.exists()
    assert len(published_names(lake.root)) == KEEP_GENERATIONS
    assert not list((lake.root / "tmp").glob("pruned-*"))


def test_a_notebook_reads_the_set_it_opened_by_no_path_through_a_link(tmp_path, monkeypatch):
    """`lake.duckdb`'s views name their own set's files, not `tables/...` through `current`: DuckDB opens a
    file by its path once for the footer, when a query binds, and again for the data, so a publication in
    between read one set's footer against another set's bytes (a notebook's `TProtocolException: Invalid
    data` in the stress test below). A session keeps reading the set it opened, whatever is published."""
    lake = Lake(tmp_path / "lake")
    opened = publish(lake, "p1")
    monkeypatch.chdir(lake.root)  # where a notebook opens it from: the views' paths are relative to the lake
    notebook = duckdb.connect("current/lake.duckdb", read_only=True)
    try:
        (view, sql), = notebook.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal").fetchall()
        path = lake.root / sql.split("read_parquet('")[1].split("'")[0]
        assert view == "t" and path == opened / "tables" / "t.parquet"
        assert os.path.realpath(path) == str(path)  # no link on the way, `current` least of all
        publish(lake, "p2")
        assert notebook.sql("SELECT token FROM t").fetchall() == [("p1",)]
    finally:
        notebook.close()


NOTEBOOK_SCRIPT = """import sys, duckdb
con = duckdb.connect("current/lake.duckdb")  # read-write, from the lake's root, as a notebook opens it
print(con.execute("SELECT token FROM t").fetchall()[0][0], flush=True)
sys.stdin.readline()
con.execute("CREATE TABLE scratch AS SELECT 1 AS x")
print(con.execute("SELECT token FROM t").fetchall()[0][0], flush=True)
con.close()
"""


def test_a_set_open_in_a_notebook_stays_until_it_closes(tmp_path):
    """A DuckDB session that opened a set's `lake.duckdb` (another process: a notebook) reads that set's
    files, so pruning leaves the set while DuckDB holds its lock on that file, and the first publication
    after the session closes removes it; the session's reads and writes all succeed meanwhile."""
    lake = Lake(tmp_path / "lake")
    opened = publish(lake, "open")
    notebook = subprocess.Popen([sys.executable, "-P", "-c", NOTEBOOK_SCRIPT], cwd=lake.root, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert notebook.stdout.readline().strip() == "open"
        for n in range(3):
            publish(lake, f"later{n}")
        assert opened.is_dir()
        out, err = notebook.communicate("\n", timeout=120)
    finally:
        notebook.kill()
    assert notebook.returncode == 0, err[-2000:]
    assert out.strip() == "open"
    publish(lake, "after")
    assert not opened.exists()
    assert len(published_names(lake.root)) == KEEP_GENERATIONS
    assert current_token(lake.root) == "after"


KILL_SCRIPT = """import sys, pyarrow as pa
from moeheal.pipeline.lake.store import Lake
lake, table = Lake(sys.argv[1]), pa.table({"token": [sys.argv[3]]})
if sys.argv[2] == "publish":  # a heal's last step
    publication = lake.begin_publication()
    publication.write_table("t", table)
    lake.publish(publication)
else:  # moeheal report, Lake.write_table
    def report(tables, folder):
        folder.mkdir()
        (folder / "report.md").write_text("new")
    lake.republish({"t": table}, report=report)
"""


def killed_at(root: Path, how: str, step: str, token: str) -> int:
    env = {**os.environ, store.KILL_AT: step}
    return subprocess.run([sys.executable, "-P", "-c", KILL_SCRIPT, str(root), how, token], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120).returncode


@pytest.mark.parametrize("how", ["publish", "republish"])
@pytest.mark.parametrize("step, shows", [("moved", "old"), ("linked", "old"), ("switched", "new"),
                                         ("pruning", "new")])
def test_a_publication_killed_at_each_step_leaves_the_old_set_or_the_new(tmp_path, how, step, shows):
    lake = Lake(tmp_path / "lake")
    for token in ("s1", "old"):
        publish(lake, token)
    assert killed_at(lake.root, how, step, "new") == -9  # SIGKILL, by itself, at that step
    assert current_token(lake.root) == shows
    assert all(store.set_problem(folder) is None for folder in (lake.root / "published").iterdir())
    if step == "pruning":
        assert len(published_names(lake.root)) == KEEP_GENERATIONS and list((lake.root / "tmp").glob("pruned-*"))
    Lake(lake.root).write_table("t", pa.table({"token": ["next"]}))  # the lake goes on
    assert current_token(lake.root) == "next"
    assert not list((lake.root / "tmp").glob("pruned-*"))
    records = [store.read_generation(p) for p in (lake.root / "published").iterdir()]
    current = store.read_generation((lake.root / "current").resolve())
    assert current["seq"] == max(r["seq"] for r in records)
    previous = store.read_generation(lake.root / "published" / current["previous"])
    assert pq.read_table(lake.root / "published" / current["previous"] / "tables" / "t.parquet").column(
        "token")[0].as_py() == shows  # the set `next` replaced is the one the lake showed
    assert all(r["seq"] >= previous["seq"] for r in records)  # older sets are gone (a killed one may wait)


# ---- a current link that points at nothing ----------------------------------------------------------
@pytest.fixture
def world(tmp_path, tiny_qwen2moe):
    """A heal.toml on the tiny model (nothing healed), its lake with three sets published."""
    from bench.inputs.healworld import write_world

    config = write_world(tmp_path / "world", model=tiny_qwen2moe, variants='[[variant]]\nname = "v1"\nquant = "q8_0"\n')
    lake = Lake(config.parent / "lake")
    for token in ("s1", "s2", "s3"):
        publish(lake, token)
    return config, lake.root


def tree(root: Path) -> list[tuple[str, str]]:
    return sorted((str(p.relative_to(root)), os.readlink(p) if p.is_symlink() else "")
                  for p in root.rglob("*") if not p.name.endswith(".lock"))


@pytest.mark.parametrize("command", [["sql", "SELECT * FROM t"], ["report"], ["heal"], ["plan"], ["audit"],
                                     ["export", "--out", "EXPORT"], ["eval"]])
def test_every_command_refuses_a_current_that_points_at_nothing(world, command, capsys):
    config, root = world
    shutil.rmtree((root / "current").resolve())  # the data-curve lake's state
    before = tree(root)
    argv = [command[0], "-c", str(config)] + [str(config.parent / a) if a == "EXPORT" else a for a in command[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{root / 'current'}: points at published/" in err[0] and "moeheal lake repair" in err[0]
    assert tree(root) == before  # nothing rebuilt, nothing published


def test_lake_repair_relinks_the_newest_complete_set(world, capsys):
    config, root = world
    s2 = store.read_generation((root / "current").resolve())["previous"]
    shutil.rmtree((root / "current").resolve())
    capsys.readouterr()
    assert main(["lake", "repair", "-c", str(config)]) == 0
    out = capsys.readouterr().out.strip()
    assert f"published/{s2}" in out and "generation 2" in out and "missing" in out
    assert current_token(root) == "s2"
    assert main(["sql", "-c", str(config), "SELECT token FROM t", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"token"', '"s2"']
    assert main(["lake", "repair", "-c", str(config)]) == 0
    assert "nothing to repair" in capsys.readouterr().out
    (root / "published" / s2 / "tables" / "t.parquet").unlink()  # an incomplete set is never linked
    assert main(["lake", "repair", "-c", str(config)]) == 0
    assert "tables/t.parquet missing" in capsys.readouterr().out
    assert not (root / "current").is_symlink()  # nothing complete to link: nothing is published
    assert main(["sql", "-c", str(config), "SELECT 1 AS one", "--format", "csv"]) == 0


# ---- layout versions --------------------------------------------------------------------------------
def copy_v1(tmp_path: Path) -> Path:
    root = tmp_path / "lake"
    shutil.copytree(FIXTURE_V1, root, symlinks=True)
    return root


def test_a_new_lake_records_the_layout_it_is_written_in(tmp_path):
    lake = Lake(tmp_path / "lake")
    assert json.loads((lake.root / "layout.json").read_text())["layout"] == store.LAYOUT_VERSION == 2
    assert lake.layout == 2


def test_a_version_1_lake_is_read_as_it_is(tmp_path, capsys):
    root = copy_v1(tmp_path)

    def files() -> list[tuple[Path, int]]:  # but tmp/, where a reader pins the set it reads
        return [(p, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if "tmp" not in p.relative_to(root).parts]

    before = files()
    lake = Lake(root)
    assert lake.layout == 1
    assert lake.connect().sql("SELECT variant FROM variants ORDER BY variant").fetchall() == [("v1",), ("v2",)]
    assert (root / "report" / "report.md").read_text().startswith("# moeheal report")
    assert files() == before  # nothing written
    assert not (root / "layout.json").exists()


def test_a_version_1_lake_is_upgraded_on_its_first_write(tmp_path):
    """Its sets get sequence numbers in their publication order as best known: `current`'s set last,
    the others by their `sources.json` time (when their last table was staged), not their ids."""
    root = copy_v1(tmp_path)
    old_current = (root / "current").resolve().name
    (other,) = published_names(root) - {old_current}
    stray = root / "published" / "20990101T000000-00000000"  # an id a day ahead, staged earlier
    shutil.copytree(root / "published" / other, stray)
    os.utime(stray / "sources.json", (1, 1))
    os.utime(root / "published" / other / "sources.json", (2, 2))
    assert [p.name for p in store.sets_newest_first(root)] == [old_current, other, stray.name]  # what gc reads
    Lake(root).write_table("docs", pa.table({"doc_id": ["d9"], "role": ["cal"]}))
    assert json.loads((root / "layout.json").read_text())["layout"] == 2
    records = {p.name: store.read_generation(p) for p in (root / "published").iterdir()}
    new = (root / "current").resolve().name
    assert records[old_current]["seq"] == 3 and records[new]["seq"] == 4 and records[new]["previous"] == old_current
    assert set(records) == {old_current, new}  # seq 1 (the stray) and 2 are older than the two kept
    assert records[old_current]["files"] == {"tables/docs.parquet": 720, "tables/variants.parquet": 727}
    assert records[old_current]["previous"] == other


def test_a_killed_upgrade_is_finished_by_the_next_write(tmp_path):
    root = copy_v1(tmp_path)
    old_current = (root / "current").resolve().name
    assert killed_at(root, "republish", "sequencing", "new") == -9
    assert Lake(root).layout == 1 and current_token_v1(root) == ["v1", "v2"]
    Lake(root).write_table("t", pa.table({"token": ["next"]}))
    records = {p.name: store.read_generation(p) for p in (root / "published").iterdir()}
    assert records[old_current]["seq"] == 2
    assert json.loads((root / "layout.json").read_text())["layout"] == 2


def current_token_v1(root: Path) -> list[str]:
    return sorted(pq.read_table(root / "current" / "tables" / "variants.parquet").column("variant").to_pylist())


@pytest.mark.parametrize("record, says", [
    ({"layout": 3, "written_by": "moeheal 9.1.0"}, "lake layout version 3, written by moeheal 9.1.0"),
    ("not json", "not a lake layout record"),
])
def test_a_lake_this_code_cannot_read_is_refused_in_one_line(tmp_path, tiny_qwen2moe, record, says, capsys):
    from bench.inputs.healworld import write_world

    config = write_world(tmp_path / "world", model=tiny_qwen2moe, variants='[[variant]]\nname = "v1"\nquant = "q8_0"\n')
    root = config.parent / "lake"
    root.mkdir()
    (root / "layout.json").write_text(record if isinstance(record, str) else json.dumps(record))
    for argv in (["sql", "-c", str(config), "SELECT 1"], ["heal", "-c", str(config)], ["lake", "repair", "-c", str(config)]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        if isinstance(record, dict):
            assert "pip install --upgrade moeheal" in err[0]
    assert sorted(p.name for p in root.iterdir()) == ["layout.json"]  # nothing written


# ---- everything at once ---------------------------------------------------------------------------
def stress(tmp_path: Path, model: Path, rounds: int, **kwargs):
    from tests.lake_stress import run

    summary = run(tmp_path, model, rounds, **kwargs)
    print(summary.line())
    assert not summary.violations, summary.violations
    assert summary.sets_lost == 0 and summary.rounds == rounds
    return summary


def test_one_lake_under_publishers_readers_and_kills(tmp_path, tiny_qwen2moe):
    """A few rounds of tests/lake_stress.py; `moeheal sql` and `moeheal report` are left to finish once."""
    summary = stress(tmp_path, tiny_qwen2moe, rounds=8, wait_for_commands=True)
    assert summary.sql_reads >= 1 and summary.reports >= 1 and summary.publications >= 1


@pytest.mark.slow
def test_one_lake_under_publishers_readers_and_kills_200_rounds(tmp_path, tiny_qwen2moe):
    """The same for 200 rounds (bench/RESULTS.md, *Reliability: publishing under kills*)."""
    summary = stress(tmp_path, tiny_qwen2moe, rounds=200)
    assert sum(summary.kills.values()) >= 100 and summary.sql_reads >= 1 and summary.reports >= 1
