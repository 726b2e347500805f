"""Shared timing for the benchmarks: the fastest of several calls, so noise only adds."""

from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` timed calls, in seconds (warm up separately if the first compiles)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
