"""A heal's per-layer units on an engine of the user's: Ray tasks, or a Slurm array of `--shard` workers.

The units are the (variant, layer) quantize and calibrate stages of every quantized variant
(`HealRun.unit_pairs`): what takes a heal's time at real size, and what runs in parallel. What they
read (the audit, the dumps, the guidance stores, a budget's sensitivity and recipe) comes first. `moeheal plan --units`
lists the units; `--shard I/N` builds every N-th of them from the I-th, a Slurm array task each
(`deploy/slurm/`); `--executor ray` hands them, and what they read, to Ray.

With Ray, each node of that part of the DAG becomes one task, submitted with its upstream nodes'
tasks as arguments, so Ray starts it when they have finished: the DAG's order is Ray's schedule.
A task opens the config in its worker, declares the same node and builds it into the shared lake
(`Executor.result`: its upstream are there by then, so found, not built). A worker that dies in a
unit is Ray's to retry (`max_retries`); a unit is idempotent under its content key, and the lake's
per-fingerprint lock (an flock, released when its holder dies) lets the retry rebuild the unit from
scratch. When every unit is in the lake the driver runs the rest of the heal as one process would:
assembly, e2e, evaluation, comparisons, and the one publication. The lake must be a folder every
worker sees at the same path.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.dag import Node

RAY_MAX_RETRIES = 3  # a task whose worker died is run again this many times
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's nodes on 127.0.0.1 (`import_ray`)
# Memory Ray reserves for a per-layer unit: this many times the float32 size of the layer's routed
# experts (the unit holds the source layer, its codes and the dumps' rows of the layer).
UNIT_MEMORY_FACTOR = 6


def dag_order(targets: list[Node]) -> list[Node]:
    """`targets` and every node they read or follow, each once, upstream first."""
    order: list[Node] = []
    seen: set[str] = set()

    def visit(node: Node) -> None:
        if node.label in seen:
            return
        seen.add(node.label)
        for first in node.after:
            visit(first)
        for upstream in node.upstream_nodes():
            visit(upstream)
        order.append(node)

    for node in targets:
        visit(node)
    return order


def depends_on(node: Node) -> list[str]:
    """The labels of the nodes `node` reads or follows."""
    return sorted({n.label for n in node.after} | {n.label for n in node.upstream_nodes()})


def unit_memory(run: Any, node: Node) -> int:
    """Bytes Ray reserves for a node: a per-layer unit's from its layer's routed experts, 0 (no
    reservation) for the nodes before the units."""
    layer = getattr(node.params, "layer", None)
    if layer is None:
        return 0
    source = run.source
    names = [n for n in source.tensor_names if n.startswith(f"blk.{layer}.") and "_exps." in n]
    return UNIT_MEMORY_FACTOR * 4 * sum(math.prod(source.shape(n)) for n in names)


def import_ray(local: bool = False) -> Any:
    """The `ray` module, or one line naming the extra. With `local` (no cluster address: a Ray of this
    machine alone) Ray is kept on the loopback address: its switch for single-machine use, read when
    it is imported, makes every node's address 127.0.0.1 rather than the host's network address."""
    if local:
        os.environ.setdefault(LOOPBACK_SWITCH, "0")
    try:
        import ray
    except ImportError:
        raise InputError("--executor ray: Ray is not installed (pip install 'moeheal[ray]')") from None
    return ray


def build_node(config: str, label: str, *upstream_done: str) -> str:
    """A Ray task's body: node `label` of the config's heal, built into the lake (or found there);
    returns its fingerprint. `upstream_done` are the fingerprints of the tasks it waited for."""
    from moeheal.pipeline.config import load_config
    from moeheal.pipeline.heal import HealRun

    run = HealRun(load_config(Path(config)), log=lambda line: print(line, flush=True))
    node = {n.label: n for n in dag_order(run.unit_nodes())}[label]
    result = run.executor.result(node)
    return result.fingerprint if result is not None else ""


def heal_units_on_ray(run: Any, address: str | None, gpus_per_unit: float | None,
                      log: Callable[[str], None] = print) -> list[str]:
    """Every unit of `run` (and what the units read) built as Ray tasks in the DAG's order, on a local
    Ray (`address` None) or the cluster at `address`; returns the labels built, in submission order."""
    ray = import_ray(local=address is None)
    if not ray.is_initialized():  # the workers' JAX on the driver's platform (a test's CPU, say)
        env = {k: os.environ[k] for k in ("JAX_PLATFORMS",) if k in os.environ}
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env} if env else None)
    if gpus_per_unit is None:
        gpus_per_unit = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    task = ray.remote(max_retries=RAY_MAX_RETRIES)(build_node)
    nodes = dag_order(run.unit_nodes())
    refs: dict[str, Any] = {}
    for node in nodes:
        unit = getattr(node.params, "layer", None) is not None
        options = {"name": node.label, "num_cpus": 1, "num_gpus": gpus_per_unit if unit else 0.0}
        memory = unit_memory(run, node)
        if memory:
            options["memory"] = memory
        refs[node.label] = task.options(**options).remote(str(run.cfg.path), node.label,
                                                          *[refs[d] for d in depends_on(node)])
    pending, started, done = list(refs.values()), time.monotonic(), 0
    while pending:
        finished, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(finished)
        except ray.exceptions.RayTaskError as exc:  # bad input in a task: its one line, exit 2
            if isinstance(exc.cause, InputError):
                raise InputError(str(exc.cause)) from None
            raise
        done += 1
        log(f"ray: {done}/{len(refs)} stages in the lake ({time.monotonic() - started:.0f} s)")
    return list(refs)
