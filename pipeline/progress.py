"""Progress for long stages: a bar on a terminal, a line at least every 30 s in logs and pipes."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LOG_EVERY_S = 30.0


def progress(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None) -> Iterable[T]:
    """Wrap `items` in a progress bar on a terminal; elsewhere print `desc: i/n unit` lines to stderr."""
    if sys.stderr.isatty():
        return tqdm(items, desc=desc, unit=unit, total=total, leave=False)
    return _logged(items, desc, unit, total)


def _logged(items: Iterable[T], desc: str, unit: str, total: int | None) -> Iterator[T]:
    """Yield `items`, printing how far it got whenever LOG_EVERY_S passed since the last line, and at the end."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    of = f"/{total}" if total is not None else ""
    start = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= LOG_EVERY_S:
            print(f"{desc}: {done}{of} {unit} ({now - start:.0f} s)", file=sys.stderr, flush=True)
            last = now
    if time.monotonic() - start >= LOG_EVERY_S:
        print(f"{desc}: done, {done} {unit} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


class Phases:
    """Wall seconds of a unit's steps, for one log line (`quantize layer 3: read 1.2 s, ...`): where a
    unit's time goes on the host that ran it, which a profiler's overhead would distort. Each step ends
    when the device work of what it returns has (`jax.block_until_ready`), so an asynchronous
    program's seconds count to the step that launched it, not to the first step that waits for it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, name: str, *results: object) -> None:
        """Close step `name` (its seconds added to any earlier ones of that name) once `results` are ready."""
        import jax  # here, not at the top: `moeheal --help` does not load JAX

        jax.block_until_ready(results)
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def __str__(self) -> str:
        total = sum(self.seconds.values())
        return ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items()) + f" (total {total:.2f} s)"
