"""Run the project's SQL files against a DuckDB connection.

Every query the pipeline runs lives in `sql/<stem>.sql`, one query per file, so
that a reviewer can read (and re-run with `duckdb lake/lake.duckdb`) exactly
what produced a table. Values reach the SQL only as DuckDB named parameters
(`$name`), never by pasting text, so a doc id or a seed can never change the
meaning of a query.
"""

from importlib.resources import files
from importlib.resources.abc import Traversable

import duckdb
import pyarrow as pa

from moeheal.pipeline.errors import InputError

SQL_DIR: Traversable = files("moeheal.sql")  # package data, wherever moeheal is installed


def sql_path(stem: str) -> Traversable:
    """Path of `sql/<stem>.sql`; a stem that is not a plain file name is refused."""
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        raise InputError(f"sql/{stem}.sql: name: not a plain query name")
    path = SQL_DIR / f"{stem}.sql"
    if not path.is_file():
        raise InputError(f"{path}: file: no such query")
    return path


def run_sql(con: duckdb.DuckDBPyConnection, stem: str, **params: object) -> pa.Table:
    """Execute `sql/<stem>.sql` with named parameters and return its rows as Arrow."""
    query = sql_path(stem).read_text(encoding="utf-8")
    return con.sql(query, params=params or None).to_arrow_table()
