"""Stages: declared inputs in, one content-addressed output out.

A stage declares what it reads (files and folders, upstream stages, parameters)
and the code it runs (its own function plus the modules and helpers it calls).
`run_stage` digests every input file *before* the build starts, derives the
fingerprint, and hands the build to the lake, which skips it when a complete
output with that fingerprint exists and otherwise builds it under tmp/ and
publishes it atomically. Whether work is "done" is never decided from a file
merely existing under some path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from moeheal.pipeline.fingerprint import content_digest, fingerprint
from moeheal.pipeline.lake import Lake, StageResult


@dataclass(frozen=True)
class Stage:
    """What a stage is: its name, where its output lives, and the code that defines it."""

    name: str
    kind: str  # lake folder: dumps, quant, models, parts
    suffix: str  # ".zarr", ".gguf", "" (a folder)
    code: tuple[Callable[..., Any] | ModuleType, ...]
    resumable: bool = False  # True: a killed build's partial work is handed back to `build`

    def source(self) -> str:
        return "\n".join(inspect.getsource(obj) for obj in self.code)


def stage_fingerprint(stage: Stage, params: dict[str, Any], inputs: dict[str, Path],
                      upstream: dict[str, StageResult]) -> tuple[str, dict[str, Any]]:
    """The fingerprint and the provenance record of one stage invocation."""
    digests = {key: content_digest(path) for key, path in sorted(inputs.items())}
    upstream_fps = {key: result.fingerprint for key, result in sorted(upstream.items())}
    fp = fingerprint(stage.name, stage.source(), params, digests, upstream_fps)
    provenance = {
        "params": params,
        "inputs": {k: {"path": str(inputs[k]), "sha256": d} for k, d in digests.items()},
        "upstream": {k: {"stage": upstream[k].stage, "fingerprint": f} for k, f in upstream_fps.items()},
    }
    return fp, provenance


def run_stage(lake: Lake, stage: Stage, params: dict[str, Any], inputs: dict[str, Path],
              upstream: dict[str, StageResult], build: Callable[[Path], None],
              log: Callable[[str], None] = print) -> StageResult:
    """Run `build(work_path)` unless an output with the same fingerprint is complete."""
    fp, provenance = stage_fingerprint(stage, params, inputs, upstream)
    return lake.materialize(stage.name, stage.kind, fp, stage.suffix, build, provenance, log,
                            resume=stage.resumable)
