"""Stages: declared inputs in, one content-addressed output out.

A stage is named, has a lake folder and a module: the module's import closure
and the queries it names are the stage's code (`pipeline/codeid.py`), so no
list of functions is kept by hand. An invocation adds its parameters (a typed
dataclass of exactly the knobs that reach the computation), the content
digests of its input files and the fingerprints of its upstream stages.
`run_stage` derives the fingerprint from these before anything is built and
hands the build to the lake, which skips it when a complete output with that
fingerprint exists and otherwise builds it under tmp/ and publishes it
atomically. `plan_stage` derives the same fingerprint and only says whether
the output exists: `moeheal plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moeheal.pipeline.codeid import code_identity
from moeheal.pipeline.fingerprint import content_digest, fingerprint
from moeheal.pipeline.lake import Lake, StageResult


@dataclass(frozen=True)
class Stage:
    """What a stage is: its name, where its output lives, and the module that computes it."""

    name: str
    kind: str  # lake folder: dumps, quant, models, parts
    suffix: str  # ".zarr", ".gguf", "" (a folder)
    module: str  # e.g. "moeheal.pipeline.stages.dump": its import closure is the stage's code
    resumable: bool = False  # True: a killed build's partial work is handed back to `build`

    def code(self) -> str:
        return code_identity(self.module)


@dataclass(frozen=True)
class PlannedStage:
    """One stage invocation as `moeheal plan` shows it."""

    stage: str  # "dump:calibration", "assemble:v2", "quantize:v2:3" (a per-layer unit)
    fingerprint: str
    status: str  # "cached", "compute" or "skipped" (a check whose tool is not installed: llama-check)
    upstream: tuple[str, ...] = ()  # the `stage` labels this invocation reads


def param_record(params: Any) -> dict[str, Any]:
    """A stage's parameters as a plain dict: a dataclass's fields without the ones set to None
    (a knob that cannot reach the computation is None and stays out of the fingerprint)."""
    if dataclasses.is_dataclass(params):
        return {k: v for k, v in dataclasses.asdict(params).items() if v is not None}
    return dict(params)


def stage_fingerprint(stage: Stage, params: Any, inputs: dict[str, Path],
                      upstream: dict[str, StageResult]) -> tuple[str, dict[str, Any]]:
    """The fingerprint and the provenance record of one stage invocation."""
    record = param_record(params)
    digests = {key: content_digest(path) for key, path in sorted(inputs.items())}
    upstream_fps = {key: result.fingerprint for key, result in sorted(upstream.items())}
    fp = fingerprint(stage.name, stage.code(), record, digests, upstream_fps)
    provenance = {
        "params": record,
        "code_identity": stage.code(),
        "inputs": {k: {"path": str(inputs[k]), "sha256": d} for k, d in digests.items()},
        "upstream": {k: {"stage": upstream[k].stage, "fingerprint": f} for k, f in upstream_fps.items()},
    }
    return fp, provenance


def run_stage(lake: Lake, stage: Stage, params: Any, inputs: dict[str, Path],
              upstream: dict[str, StageResult], build: Callable[[Path], None],
              log: Callable[[str], None] = print, label: str | None = None) -> StageResult:
    """Run `build(work_path)` unless an output with the same fingerprint is complete; `label` names
    the invocation in the log (`quantize:v1:3`, one unit of a stage run per layer)."""
    fp, provenance = stage_fingerprint(stage, params, inputs, upstream)
    return lake.materialize(stage.name, stage.kind, fp, stage.suffix, build, provenance, log,
                            resume=stage.resumable, label=label)


def layer_params(params: Any, layer: int) -> dict[str, Any]:
    """The parameters of one layer's unit of a stage run per layer: the stage's knobs and the layer,
    so each unit has its own fingerprint and a knob change reaches exactly the units it reads."""
    return {**param_record(params), "layer": layer}


def plan_stage(lake: Lake, stage: Stage, params: Any, inputs: dict[str, Path],
               upstream: dict[str, StageResult]) -> StageResult:
    """The result `run_stage` would return, without building: `cached` says whether it exists."""
    fp, _ = stage_fingerprint(stage, params, inputs, upstream)
    cached = lake.is_complete(stage.kind, fp, stage.suffix)
    return StageResult(stage.name, fp, lake.output_path(stage.kind, fp, stage.suffix), cached=cached)
