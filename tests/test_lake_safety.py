"""The lake under stress: two runs at once, a full disk, a read-only lake, a crashed lock holder.

Real processes and real file systems: the concurrent runs are two `moeheal heal`
processes, the full disk a small tmpfs, the read-only lake a read-only bind
mount (both need root, as CI has; skipped otherwise).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.lake.store import Lake
from bench.inputs.healworld import V1, write_world

REPO = Path(__file__).resolve().parents[1]


def published(lake: Path) -> dict[str, str]:
    """SHA-256 of every published file (tables, report, DuckDB file) through the `current` link."""
    root = lake.resolve()
    files = sorted(p for name in ("tables", "report") for p in (root / name).resolve().rglob("*") if p.is_file())
    files.append((root / "lake.duckdb").resolve())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def heal_process(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-m", "moeheal", "heal", "-c", str(config)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def evaluated_parts(config: Path, variant: str) -> Path:
    """Where this config's evaluate stage of `variant` keeps its rows (planned, nothing run)."""
    planned = {p.stage: p for p in HealRun(load_config(config), log=lambda m: None, plan=True).plan()}
    return load_config(config).lake_root / "parts" / planned[f"evaluate:{variant}"].fingerprint


def sibling_config(config: Path, dest: Path, old: str, new: str) -> Path:
    """A copy of the world without its lake, one knob changed, publishing into the same lake."""
    shutil.copytree(config.parent, dest, ignore=shutil.ignore_patterns("lake"))
    lake = load_config(config).lake_root
    text = (dest / config.name).read_text().replace('root = "lake"', f'root = "{lake}"')
    assert old in text
    (dest / config.name).write_text(text.replace(old, new))
    return dest / config.name


@pytest.fixture
def mount_point(tmp_path):
    """Yields a function mounting a file system at a fresh folder; everything is unmounted after."""
    mounted: list[Path] = []

    def mount(*args: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir(exist_ok=True)
        result = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount here: {result.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_two_runs_on_one_lake_same_and_different_configs(tmp_path):
    config = write_world(tmp_path / "a", variants=V1, moce_bonus=(0.0,))  # one variant: three processes heal it
    other = sibling_config(config, tmp_path / "b", 'name = "v1"\nbeta_gate_up = 0.5', 'name = "v1"\nbeta_gate_up = 0.8')
    procs = [heal_process(config), heal_process(config), heal_process(other)]
    outs = [p.communicate(timeout=900) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
        assert "Traceback" not in err
    lake = load_config(config).lake_root
    # the published set is one run's, whole: v1's rows are exactly one config's evaluate output
    token_kld = pq.read_table(lake / "tables" / "token_kld.parquet")
    published_v1 = token_kld.filter(token_kld.column("variant").to_numpy(zero_copy_only=False) == "v1")
    candidates = [pq.read_table(evaluated_parts(c, "v1") / "token_kld.parquet") for c in (config, other)]
    assert sum(published_v1.equals(c) for c in candidates) == 1
    views = duckdb.connect(str(lake / "lake.duckdb"), read_only=True)
    views.execute(f"SET file_search_path = '{lake}'")
    assert views.execute("SELECT count(*) FROM comparisons").fetchone()[0] > 0
    assert not list((lake / "tmp").glob("*.lock")) and not list((lake / "tmp").glob("publish-*"))


def test_processes_opening_one_new_lake_at_once_all_succeed(tmp_path):
    """Array tasks of one heal open a lake nobody has made yet at the same instant; each makes the
    published-set links only where another has not, so none fails on a link that appeared under it."""
    roots = [tmp_path / f"lake{i}" for i in range(40)]
    start = time.time() + 4.0  # every child has imported moeheal by then
    # Asleep until just before the instant, then spinning to it: six children spinning the whole wait
    # took both cores of a CI machine for seconds, from the other test worker too.
    script = ("import sys, time; from moeheal.pipeline.lake.store import Lake\n"
              "roots, start = sys.argv[2:], float(sys.argv[1])\n"
              "time.sleep(max(0.0, start - 0.05 - time.time()))\n"
              "while time.time() < start: pass\n"
              "for root in roots: Lake(root)")
    children = [subprocess.Popen([sys.executable, "-P", "-c", script, str(start), *map(str, roots)], cwd=REPO,
                                 stderr=subprocess.PIPE, text=True) for _ in range(6)]
    errors = [child.communicate(timeout=120)[1] for child in children]
    assert [child.returncode for child in children] == [0] * len(children), "\n".join(errors)
    for root in roots:
        assert all((root / name).is_symlink() for name in ("tables", "lake.duckdb", "report"))
        assert not list((root / "tmp").glob("*.lock"))


def test_a_killed_lock_holder_does_not_block(tmp_path):
    lake = Lake(tmp_path / "lake")
    holder = subprocess.Popen([sys.executable, "-P", "-c", (
        "import sys, time; from moeheal.pipeline.lake.store import Lake\n"
        f"with Lake({str(lake.root)!r}).lock('run'):\n    print('held', flush=True); time.sleep(60)")],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    told: list[str] = []
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with lake.lock("run", on_wait=told.append):
        pass
    assert time.monotonic() - start < 5
    assert not (lake.root / "tmp" / "run.lock").exists()


def test_full_disk_mid_stage_changes_nothing_published(healed_world, tmp_path, mount_point, capsys):
    config, _ = healed_world  # its lake is copied onto the small disk, not written
    lake = load_config(config).lake_root
    used = sum(max(p.lstat().st_blocks * 512, 4096) for p in lake.rglob("*"))  # what tmpfs will charge
    disk = mount_point("-t", "tmpfs", "-o", f"size={used + (512 << 10)}", "tmpfs")
    shutil.copytree(lake, disk / "lake", symlinks=True)
    moved = sibling_config(config, tmp_path / "full", 'name = "v1"\nbeta_gate_up = 0.5',
                           'name = "v1"\nbeta_gate_up = 0.9')
    moved.write_text(moved.read_text().replace(f'root = "{lake}"', f'root = "{disk / "lake"}"'))
    before = published(disk / "lake")
    capsys.readouterr()
    assert main(["heal", "-c", str(moved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and str(disk) in err[0]
    assert published(disk / "lake") == before
    tmp = disk / "lake" / "tmp"
    assert not list(tmp.glob("publish-*")) and not list(tmp.glob("*.lock"))
    # no half-built output kept (`pins/`, the readers' pin locks, comes with the copied lake when a test
    # before this one read the shared world)
    assert not [p for p in tmp.iterdir() if not p.name.startswith("dumps-") and p.name != "pins"]


def test_read_only_lake_is_refused_with_the_path(healed_world, tmp_path, mount_point, capsys):
    config, _ = healed_world  # mounted read-only at another folder; the original stays writable
    lake = load_config(config).lake_root
    before = published(lake)
    ro = mount_point("--bind", "-o", "ro", str(lake))
    moved = sibling_config(config, tmp_path / "ro", 'name = "v1"\nbeta_gate_up = 0.5',
                           'name = "v1"\nbeta_gate_up = 0.9')
    moved.write_text(moved.read_text().replace(f'root = "{lake}"', f'root = "{ro}"'))
    capsys.readouterr()
    assert main(["heal", "-c", str(moved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Read-only file system" in err[0] and str(ro) in err[0]
    assert published(lake) == before
