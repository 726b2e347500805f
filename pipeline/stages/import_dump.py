"""The `import-dump` stage: activations dumped by another engine (raw arrays and a spec), checked and stored
as our Zarr dump."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from moeheal.pipeline.data.dumps import import_raw_dump
from moeheal.pipeline.lake.stage import Log, Stage


@dataclass(frozen=True)
class ImportDumpParams:
    """Nothing: an imported dump is its spec and raw files (the inputs)."""


def build_import_dump(out: Path, params: ImportDumpParams, *, spec: Path, raw: Mapping[str, Path], log: Log) -> None:
    """The import-dump stage: `import_raw_dump` of the `spec`; its `raw` files (`raw_dump_files`) are
    inputs so that their content keys the dump, and the spec names them."""
    import_raw_dump(spec, out)


STAGE = Stage("import-dump", "dumps", build_import_dump, suffix=".zarr", outputs=("routing",))
