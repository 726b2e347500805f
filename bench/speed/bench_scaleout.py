"""The per-layer units on Ray, on one and two worker nodes, against one plain process (the baseline,
measured in the same run): wall time, and Ray's overhead per task.

    .venv/bin/python bench/speed/bench_scaleout.py [-c demo/heal.toml] [--variants v2] [--workers 1,2]
                                                   [--json bench/results/scaleout/demo.json]

A copy of the config keeping the named variants (their units: `moeheal plan --units`) gets its
audit and dumps built once; each measurement then starts from a copy of that lake, so it builds the
units and nothing else:
- plain: `moeheal heal --shard 0/1` in a new process (one worker building every unit, JAX compiling
  as a fresh worker does);
- ray, N workers: a local Ray cluster of a head (no CPUs) and N worker nodes of one CPU each
  (`ray.cluster_utils.Cluster`), and `pipeline.lake.scaleout.heal_units_on_ray`, every unit and what it
  reads a task, in the DAG's order.
Ray's overhead per task = (ray on one worker - plain) / tasks: its scheduling, a worker process per
task start-up, the config and models opened again, and JAX compiling afresh in each worker.
Every process runs with OMP_NUM_THREADS=1, as Ray's one-CPU tasks do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after site-packages: DESIGN.md, Imports

from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.heal import HealRun  # noqa: E402

LINKED = ("model", "docs.jsonl", "split.csv", "windows.csv", "peers")


def narrowed_config(config: Path, variants: list[str], work: Path) -> Path:
    """`config` in `work` (its inputs linked) with only the named [[variant]] blocks, no comparisons and
    its lake under `work`."""
    head, *blocks = config.read_text().split("\n[[variant]]\n")
    kept = [b for b in blocks if re.search(r'^name = "([^"]+)"', b, re.M).group(1) in variants]
    head = re.sub(r"compare = \[\[.*?\]\]\n", "", head, flags=re.S)
    head = re.sub(r'root = "[^"]*"', 'root = "lake"', head, count=1)
    for name in LINKED:
        if (config.parent / name).exists():
            (work / name).symlink_to((config.parent / name).resolve())
    out = work / "heal.toml"
    out.write_text("\n[[variant]]\n".join([head, *kept]))
    return out


def with_lake_copy(base: Path, name: str) -> Path:
    """A sibling config whose lake starts as a copy of the base config's (audit and dumps built)."""
    work = base.parent
    shutil.copytree(work / "lake", work / name, symlinks=True)
    out = work / f"heal-{name}.toml"
    out.write_text(base.read_text().replace('root = "lake"', f'root = "{name}"', 1))
    return out


def plain(config: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-m", "moeheal", "heal", "-c", str(config), "--shard", "0/1"],
                   check=True, capture_output=True)
    return time.perf_counter() - started


def on_ray(config: Path, workers: int) -> tuple[float, int]:
    """(wall seconds, tasks) of every unit on a local cluster of `workers` one-CPU nodes."""
    import ray
    from ray.cluster_utils import Cluster

    from moeheal.pipeline.lake.scaleout import heal_units_on_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        run = HealRun(load_config(config), log=lambda line: None)
        started = time.perf_counter()
        tasks = heal_units_on_ray(run, cluster.address, 0.0, log=lambda line: None)
        return time.perf_counter() - started, len(tasks)
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, default=Path("demo/heal.toml"))
    parser.add_argument("--variants", default="v2", help="comma-separated; the unhealed baseline's units always run")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # one BLAS thread as Ray's one-CPU tasks have; Ray on 127.0.0.1 (pipeline/lake/scaleout.py, import_ray)
    os.environ.update({"OMP_NUM_THREADS": "1", "MOEHEAL_PLOTS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    with tempfile.TemporaryDirectory(prefix="moeheal-scaleout-") as tmp:
        base = narrowed_config(args.config.resolve(), args.variants.split(","), Path(tmp))
        run = HealRun(load_config(base), log=lambda line: None)
        run.overlap()
        for trace in run.traces_present():
            run.result(run.dump(trace))
        units = len(run.unit_pairs())
        rows = [{"executor": "plain process", "workers": 1, "wall_s": plain(with_lake_copy(base, "lake-plain"))}]
        for n in (int(w) for w in args.workers.split(",")):
            wall, tasks = on_ray(with_lake_copy(base, f"lake-ray{n}"), n)
            rows.append({"executor": "ray", "workers": n, "wall_s": wall, "tasks": tasks})
    baseline = rows[0]["wall_s"]
    one = next((r for r in rows if r["executor"] == "ray" and r["workers"] == 1), None)
    print(f"{units} units ({args.variants} and unhealed, {run.source.hp.n_layer} layers)")
    print("| executor | workers | wall s | vs plain |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['executor']} | {r['workers']} | {r['wall_s']:.1f} | {r['wall_s'] / baseline:.2f}x |")
    if one is not None:
        overhead = (one["wall_s"] - baseline) / one["tasks"]
        print(f"Ray's overhead per task (one worker against the plain process): {overhead:.2f} s over {one['tasks']} tasks")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "units": units, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
