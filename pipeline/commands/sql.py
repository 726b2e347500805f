"""`moeheal sql`: ad-hoc queries over the lake's views, printed or saved."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.csv as pacsv

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.store import Lake


def run_user_sql(lake: Lake, query: str, fmt: str, out: str | None) -> int:
    """Run a SELECT (or a .sql file) against the lake and print it as a table or CSV."""
    if query.endswith(".sql"):
        path = Path(query)
        if not path.is_file():
            raise InputError(f"{path}: SQL file not found")
        query = path.read_text(encoding="utf-8")
    con = lake.connect()
    try:
        try:
            relation = con.sql(query)
        except Exception as exc:  # duckdb.Error subclasses: report as bad input
            raise InputError(f"sql: {str(exc).splitlines()[0]}") from None
        if relation is None:
            return 0
        if fmt == "parquet":
            if not out:
                raise InputError("sql: --format parquet needs --out FILE")
            write_parquet(Path(out), relation.to_arrow_table())
        elif fmt == "csv":
            sys.stdout.flush()
            pacsv.write_csv(relation.to_arrow_table(), sys.stdout.buffer)
        else:
            relation.show(max_rows=10_000, max_width=10_000)
    finally:
        con.close()
    return 0
