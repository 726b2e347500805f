"""nvidia-smi's utilisation and memory of GPU 0 sampled in a thread: shared by the benches that time a
GPU run (moeheal's own and the AutoRound peer's, which runs in its own environment, so nothing here
imports JAX or moeheal)."""

from __future__ import annotations

import subprocess
import threading
import time

BUSY_UTIL = 50  # a sample counts as busy above this utilisation (%)


class DeviceSampler:
    """nvidia-smi's utilisation and memory of GPU 0, one sample a second, in a thread (nothing where there
    is no nvidia-smi): utilisation is the share of the second a kernel ran, so summed over a stage's samples
    it is the stage's device-busy seconds."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (time, utilisation %, memory used MiB)
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            fields = [f.strip() for f in line.split(",")]
            if len(fields) == 2 and all(f.replace(".", "").isdigit() for f in fields):
                self.samples.append((time.perf_counter(), float(fields[0]), float(fields[1])))

    def __enter__(self) -> "DeviceSampler":
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "-i", "0", "--query-gpu=utilization.gpu,memory.used",
                                           "--format=csv,noheader,nounits", "-lms", "1000"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread.start()
        except OSError:  # no NVIDIA GPU here
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._thread.join(timeout=5)

    def within(self, start: float, end: float) -> list[tuple[float, float, float]]:
        return [s for s in self.samples if start < s[0] <= end]

    def busy_seconds(self, start: float, end: float) -> float:
        return sum(util / 100 for _, util, _ in self.within(start, end))

    def busy_samples(self, start: float, end: float) -> tuple[int, int]:
        """(samples above `BUSY_UTIL`%, samples) between start and end: the counts whose ratio over a heal
        is its `gpu_busy_fraction`, kept per stage so that a record can extrapolate them in depth."""
        samples = self.within(start, end)
        return sum(util > BUSY_UTIL for _, util, _ in samples), len(samples)
