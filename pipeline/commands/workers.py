"""`moeheal heal --workers N`: the per-layer units on N `heal --shard I/N` processes at once, then the rest.

A heal's per-layer units alternate between host work (reading a layer's rows, packing, writing) and
device work (learned rounding, the routed forwards): one process leaves the device idle while it reads
and the host idle while the device runs. Several shard workers on one lake overlap the two: every
stage is still built once, under its fingerprint's lock, so the bytes are the ones a single process
writes (docs/scale-out.md). The workers do not preallocate device memory, so several share one GPU.
On the 2-core CPU this is how `make heal` runs; on one H100, at 2 layers of the 30B shape, two workers
were no faster than one process and held twice its device memory (docs/real-sizes.md).

Their output is merged line by line and a line another worker already printed is dropped, so a bad
input is one line, not one per worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Device memory is taken as it is needed, not three quarters of it up front by the first process.
SHARED_DEVICE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@dataclass(frozen=True)
class WorkerRun:
    """One shard worker's exit status, wall seconds and output lines."""

    returncode: int
    seconds: float
    lines: list[str]


def share_the_device() -> None:
    """Let this process and its workers share one device: no preallocation (unless the caller chose)."""
    for key, value in SHARED_DEVICE_ENV.items():
        os.environ.setdefault(key, value)


def run_shard_workers(config: Path, workers: int, devices: int = 0,
                      echo: Callable[[str], None] = print) -> list[WorkerRun]:
    """`moeheal heal -c config --shard i/workers` for every i, all at once, until every one has ended.

    `devices` > 0: worker i sees only device i mod `devices` (`CUDA_VISIBLE_DEVICES`), one GPU per
    worker on a machine with several; 0: every worker sees what this process sees. Each line a worker
    prints is passed to `echo` unless some worker printed it before.
    """
    seen: set[str] = set()
    lock = threading.Lock()
    runs: list[WorkerRun | None] = [None] * workers

    def follow(i: int, began: float, worker: subprocess.Popen) -> None:
        lines = []
        assert worker.stdout is not None
        for line in worker.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            with lock:
                if line not in seen:
                    seen.add(line)
                    echo(line)
        runs[i] = WorkerRun(worker.wait(), time.perf_counter() - began, lines)

    started: list[tuple[subprocess.Popen, threading.Thread]] = []
    try:
        for i in range(workers):
            env = {**SHARED_DEVICE_ENV, **os.environ,  # the caller's own choice of preallocation stands
                   **({"CUDA_VISIBLE_DEVICES": str(i % devices)} if devices else {})}
            worker = subprocess.Popen([sys.executable, "-m", "moeheal", "heal", "-c", str(config),
                                       "--shard", f"{i}/{workers}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            reader = threading.Thread(target=follow, args=(i, time.perf_counter(), worker), daemon=True)
            reader.start()
            started.append((worker, reader))
        for worker, reader in started:
            worker.wait()
            reader.join()
    finally:  # interrupted: no worker outlives the command
        for worker, _ in started:
            if worker.poll() is None:
                worker.terminate()
    return [run for run in runs if run is not None]
