"""`moeheal.open_lake`: the published tables as polars LazyFrames, pinned to one published set.
(The heal world's lake and its exported bundle are read in tests/test_heal.py.)"""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pytest

import moeheal
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.store import Lake


def publish(lake: Lake, **tables: pa.Table) -> None:
    publication = lake.begin_publication()
    for name, table in tables.items():
        publication.write_table(name, table)
    lake.publish(publication)


def test_frames_read_the_set_published_when_the_lake_was_opened(tmp_path):
    lake = Lake(tmp_path / "lake")
    publish(lake, variants=pa.table({"variant": ["reference", "v1"], "bpw": [8.5, 2.1]}))
    frames = moeheal.open_lake(lake.root)
    publish(lake, variants=pa.table({"variant": ["reference", "v1", "v2"], "bpw": [8.5, 2.1, 2.3]}))
    assert list(frames) == ["variants"] and isinstance(frames["variants"], pl.LazyFrame)
    assert frames["variants"].filter(pl.col("bpw") < 8).collect()["variant"].to_list() == ["v1"]  # the first set
    assert moeheal.open_lake(lake.root)["variants"].collect().height == 3  # the new one, opened anew


def test_a_folder_without_published_tables_is_one_input_error(tmp_path):
    Lake(tmp_path / "lake")  # a lake no run has published to
    for folder in (tmp_path / "lake", tmp_path / "absent"):
        with pytest.raises(InputError) as err:
            moeheal.open_lake(folder)
        assert str(folder) in str(err.value) and "\n" not in str(err.value)
