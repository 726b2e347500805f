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
