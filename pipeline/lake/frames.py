"""The published tables as polars LazyFrames, for notebooks (`moeheal.open_lake`).

DuckDB stays the SQL engine (sql/*.sql, `moeheal sql`); this is the DataFrame side: each table a
`polars.LazyFrame` scanning its Parquet file, so a filter or a column selection reads only what it
needs (a lake's `routing` and `cal_trace` tables run to millions of rows).

Both a lake root and an exported reviewer bundle hold the tables as `tables/<name>.parquet`. In a
lake `tables` is a link to the current published set, which the next run may replace; the link is
resolved here, once, so every frame of one `open_lake` reads the same set (while the lake keeps it:
`lake.KEEP_GENERATIONS` sets). Nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from moeheal.pipeline.errors import InputError


def open_lake(path: str | os.PathLike[str]) -> dict[str, pl.LazyFrame]:
    """{table name: LazyFrame} over `path`'s published tables; `path` is a lake root or an exported
    bundle. A folder without published tables is an InputError naming it."""
    root = Path(path)
    tables = root / "tables"
    if not tables.is_dir():
        raise InputError(f"{root}: no published tables (tables/*.parquet): not a lake with a finished run "
                         "or an exported bundle")
    folder = tables.resolve()  # a lake's link to the current set, pinned
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise InputError(f"{tables}: no *.parquet tables")
    return {file.stem: pl.scan_parquet(file) for file in files}
