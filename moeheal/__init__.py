"""moeheal: heal 2-bit Mixture-of-Experts GGUF models from calibration activations, and prove it.

The installed distribution is one import namespace: ``moeheal.pipeline``
(orchestration), ``moeheal.kernels`` (pure array math) and ``moeheal.sql``
(the queries, shipped as package data). In a checkout they are the top-level
folders ``pipeline/``, ``kernels/`` and ``sql/``, mapped by ``package-dir``.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars

try:
    __version__ = version("moeheal")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"


def open_lake(path: str | os.PathLike[str]) -> dict[str, polars.LazyFrame]:
    """The published tables of a lake root or an exported bundle, {name: polars.LazyFrame}
    (`moeheal.pipeline.lake.frames.open_lake`; imported on first use, as polars is not light)."""
    from moeheal.pipeline.lake.frames import open_lake as _open_lake

    return _open_lake(path)
