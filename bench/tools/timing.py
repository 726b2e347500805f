"""Shared timing for the benchmarks: the fastest of several calls, so noise only adds."""

from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest of `repeats` timed calls, in seconds of `clock` (warm up separately if the first compiles).

    `clock=time.process_time` gives CPU seconds of every thread: on a shared
    machine the wall clock also counts other people's work, CPU time does not.
    """
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)
