"""Progress bars for long stages (tqdm on a terminal, silent in pipes and tests)."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None) -> Iterable[T]:
    """Wrap `items` in a progress bar drawn on stderr when it is a terminal."""
    return tqdm(items, desc=desc, unit=unit, total=total, leave=False, disable=not sys.stderr.isatty())
