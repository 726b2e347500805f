"""Scale-out on engines that are not ours (docs/scale-out.md): Ray tasks over the per-layer units in the
DAG's order, and Slurm array tasks over `--shard` (run here as local processes with Slurm's variables
set). Each gives the single-process run's published tables and GGUF files, byte for byte; a Ray worker
killed in the middle of a unit is retried and changes nothing.

Every heal here runs in a child process with the caller's thread settings, not pinned: Ray gives a
one-CPU task one BLAS thread (`OMP_NUM_THREADS=1`), a plain process gets every core, and the lakes
still match byte for byte, because a unit's host linear algebra runs on one BLAS thread whatever its
environment (`kernels.threads`, docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.commands.workers import run_shard_workers
from bench.inputs.ggufs import make_tiny_gguf
from bench.inputs.healworld import write_world

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "deploy" / "slurm"
VARIANT = """
[[variant]]
name = "v1"
ridge_rho = 6.0
"""
# The variables that would pin the BLAS thread count: left to the machine, as a plain run leaves them.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Ray's nodes on 127.0.0.1 (pipeline/lake/scaleout.py, `import_ray`): the tests' cluster stays on loopback.
ENV = {**{k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}, "JAX_PLATFORMS": "cpu",
       "MOEHEAL_PLOTS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A three-layer world and its single-process heal (lake `lake`); other lakes are siblings."""
    root = tmp_path_factory.mktemp("scaleout")
    model = make_tiny_gguf(root / "ref.gguf", arch="qwen2moe", seed=5, n_layer=3, d_model=256, n_expert=8,
                           k=2, matrix_type="q8_0", d_expert=256, d_shexp=256)
    config = write_world(root, model=model, variants=VARIANT, moce_bonus=(0.0,))
    heal(config)
    return config


def with_lake(config: Path, name: str) -> Path:
    """The same world publishing into lake `name` (the same model and corpus paths, so every table can match)."""
    other = config.with_name(f"heal-{name}.toml")
    other.write_text(config.read_text().replace('root = "lake"', f'root = "{name}"'))
    return other


def heal(config: Path, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-P", "-m", "moeheal", "heal", "-c", str(config), *extra],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def published(lake: Path) -> dict[str, bytes]:
    """Every published table and every GGUF of the lake, by name."""
    tables = {p.name: p.read_bytes() for p in (lake / "tables").resolve().glob("*.parquet")}
    models = {p.relative_to(lake).as_posix(): p.read_bytes() for p in (lake / "models").rglob("*.gguf")}
    assert tables and models
    return tables | models


def assert_same_lake(a: Path, b: Path) -> None:
    """Byte for byte, but the `variants` table's `gguf` column: a healed file's path, in its own lake."""
    ours, theirs = published(a), published(b)
    assert sorted(ours) == sorted(theirs)
    assert [name for name in ours if ours[name] != theirs[name] and name != "variants.parquet"] == []
    rows = [pq.read_table((lake / "tables" / "variants.parquet").resolve()).to_pylist() for lake in (a, b)]
    for row, other in zip(*rows, strict=True):
        assert {**row, "gguf": ""} == {**other, "gguf": ""}
        assert row["gguf"].replace(str(a.resolve()), "LAKE") == other["gguf"].replace(str(b.resolve()), "LAKE")


# ---- units ----------------------------------------------------------------------------------------
def test_plan_units_lists_every_layer_of_every_variant(world, capsys):
    assert main(["plan", "-c", str(world), "--units", "--format", "json"]) == 0
    units = json.loads(capsys.readouterr().out)
    assert [(u["variant"], u["layer"]) for u in units] == [(v, l) for v in ("v1", "unhealed") for l in range(3)]
    assert units[1]["stages"] == ["quantize:v1:1", "calibrate:v1:1"]
    assert {u["status"] for u in units} == {"cached"}
    fresh = with_lake(world, "lake-unplanned")
    assert main(["plan", "-c", str(fresh), "--units"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "6 units: 0 cached, 6 to compute"


# ---- --workers ------------------------------------------------------------------------------------
def test_heal_with_two_workers_gives_the_single_process_lake(world):
    """`heal --workers 2`: two `--shard` processes build the units, each once, then the rest in the command."""
    config = with_lake(world, "lake-workers")
    done = heal(config, "--workers", "2")
    assert "shard 0/2:" in done.stdout and "shard 1/2:" in done.stdout
    built = [line for line in done.stdout.splitlines() if "computing" in line and "quantize:v1:" in line]
    assert len(built) == 3, built  # every layer's unit once, by one worker or the other
    assert_same_lake(world.parent / "lake", config.parent / "lake-workers")


def test_workers_echo_a_line_both_printed_once(tmp_path):
    """Both workers fail on the same bad input: its line is echoed once, and both exit 2."""
    echoed: list[str] = []
    missing = tmp_path / "missing.toml"
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        runs = run_shard_workers(missing, 2, echo=echoed.append)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert [r.returncode for r in runs] == [2, 2]
    errors = [line for line in echoed if line.startswith("moeheal: error:")]
    assert len(errors) == 1 and str(missing) in errors[0], echoed
    assert all(errors[0] in r.lines for r in runs)


@pytest.mark.parametrize("extra, named", [(["--workers", "2", "--shard", "0/2"], "--shard"),
                                          (["--workers", "0"], "--workers 0")])
def test_workers_with_a_shard_or_none_are_refused(world, capsys, extra, named):
    assert main(["heal", "-c", str(world), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


# ---- Slurm ----------------------------------------------------------------------------------------
def test_slurm_array_tasks_as_processes_give_the_single_process_lake(world):
    """heal_units.sbatch run as three array tasks at once (SLURM_ARRAY_TASK_ID 0..2 of 3), then
    publish.sbatch, as Slurm would after `--dependency=afterok`."""
    config = with_lake(world, "lake-slurm")
    env = {**ENV, "MOEHEAL_CONFIG": str(config), "MOEHEAL": str(Path(sys.executable).with_name("moeheal")),
           "SLURM_ARRAY_TASK_COUNT": "3"}
    tasks = [subprocess.Popen(["bash", str(SLURM / "heal_units.sbatch")], env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for task in tasks:
        out, err = task.communicate(timeout=900)
        assert task.returncode == 0, err[-3000:]
        assert "units in the lake" in out
    done = subprocess.run(["bash", str(SLURM / "publish.sbatch")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "computing" not in "".join(line for line in done.stderr.splitlines() if "quantize:" in line)
    assert_same_lake(world.parent / "lake", config.parent / "lake-slurm")


def test_slurm_array_task_without_its_variables_says_so(world):
    done = subprocess.run(["bash", str(SLURM / "heal_units.sbatch")], env={**ENV, "MOEHEAL_CONFIG": str(world)},
                          capture_output=True, text=True)
    assert done.returncode != 0 and "SLURM_ARRAY_TASK_ID" in done.stderr


# ---- Ray ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of a head and two worker nodes (one CPU each), on loopback."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is imported: before it
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    assert cluster.address.startswith("127.0.0.1:")
    yield cluster
    cluster.shutdown()


def test_ray_executor_on_two_workers_retries_a_killed_one_and_gives_the_single_process_lake(world, ray_cluster):
    """The heal's units on two Ray workers, the worker building `quantize:v1:1` killed (SIGKILL) while it
    holds the unit's lock: Ray runs the task again, the unit is rebuilt from scratch, every stage ends in
    the lake and the lake is the single-process one (one heal for both: Ray's start is most of its time)."""
    config = with_lake(world, "lake-ray-killed")
    planned = subprocess.run([sys.executable, "-P", "-m", "moeheal", "plan", "-c", str(config), "--format", "json"],
                             capture_output=True, text=True, env=ENV, check=True)
    victim = next(p["fingerprint"] for p in json.loads(planned.stdout) if p["stage"] == "quantize:v1:1")
    lock = config.parent / "lake-ray-killed" / "tmp" / f"{victim}.lock"
    driver = subprocess.Popen([sys.executable, "-P", "-m", "moeheal", "heal", "-c", str(config), "--executor", "ray",
                               "--ray-address", ray_cluster.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV)
    killed, deadline = None, time.monotonic() + 600
    while killed is None and driver.poll() is None and time.monotonic() < deadline:
        try:
            pid = int(lock.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            pid = 0
        if pid:
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.005)
    out, err = driver.communicate(timeout=900)
    assert killed is not None, "the unit finished before it could be killed"
    assert driver.returncode == 0, err[-3000:]
    assert "ray: 18/18 stages in the lake" in out + err  # 6 units x 2 stages, and what they read
    assert_same_lake(world.parent / "lake", config.parent / "lake-ray-killed")


def test_ray_executor_without_ray_is_one_line_and_exit_2(world, tmp_path):
    """In a Python where `import ray` fails (a module of that name that raises), one line, exit 2."""
    (tmp_path / "ray.py").write_text("raise ImportError('no ray here')\n")
    done = subprocess.run([sys.executable, "-P", "-m", "moeheal", "heal", "-c", str(world), "--executor", "ray"],
                          capture_output=True, text=True, env={**ENV, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "moeheal[ray]" in done.stderr


def test_ray_and_shard_together_are_refused(world, capsys):
    assert main(["heal", "-c", str(world), "--executor", "ray", "--shard", "0/2"]) == 2
    assert "--shard" in capsys.readouterr().err



def test_slurm_submit_sizes_the_array_from_the_units_and_queues_publish_after_it(world, tmp_path):
    """submit.sh with an `sbatch` that records its arguments: an array of one task per unit still to
    compute (a fresh lake: all 6), then publish.sbatch with `--dependency=afterok` on the array's id."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" >> {calls}\necho $((41 + $(wc -l < {calls})))\n')
    fake.chmod(0o755)
    config = with_lake(world, "lake-submit")
    env = {**ENV, "PATH": f"{fake.parent}:{os.environ['PATH']}",
           "MOEHEAL": str(Path(sys.executable).with_name("moeheal"))}
    done = subprocess.run(["bash", str(SLURM / "submit.sh"), str(config)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    array, publish = calls.read_text().splitlines()
    assert "--array=0-5" in array.split() and array.endswith("heal_units.sbatch")
    assert "--dependency=afterok:42" in publish.split() and publish.endswith("publish.sbatch")
    assert "6 tasks for 6 units" in done.stdout
