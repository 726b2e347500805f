"""Stages as declarations, and the one runner that caches, locks and builds them.

A `Stage` is what a stage is: its name, where its output lives, its build
function, the type of its parameters and the files it writes. The build
function lives in the stage's module, whose import closure and queries are the
stage's code identity (`pipeline/lake/codeid.py`), so the code that computes an
output is always in its fingerprint. A `Node` is one invocation of a stage:
its label (`quantize:v2:3`), one parameters object (a frozen dataclass of
exactly the knobs that reach the computation), its input files and the nodes
it reads. The parameters object is the only thing of the configuration that
is hashed and the only thing of it the build function receives:

    build(out, params, inputs, log)

where `inputs` maps each input file's and each upstream node's name to its
path. So key and computation agree by construction, not by hand; and the
executor records which fields a build reads and fails one that never read a
hashed knob (which would recompute where the output cannot change). A field
marked `metadata={"fingerprint": False}` is a setting that cannot change the
output (how many tokens a forward pass holds, how an error names the
variant): the build reads it, the fingerprint does not.

`Executor.result(node)` derives the fingerprint from the parameters, the
content digests of the input files, the upstream fingerprints and the code,
before anything is built, and hands the build to the lake, which skips it when
a complete output with that fingerprint exists and otherwise builds it under
tmp/ and publishes it atomically. With `plan=True` it only says whether the
output exists: `moeheal plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from moeheal.pipeline.lake.codeid import code_identity
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.fingerprint import content_digest, fingerprint
from moeheal.pipeline.lake.store import Lake, StageResult

Build = Callable[[Path, Any, Mapping[str, Path], Callable[[str], None]], None]


@dataclass(frozen=True)
class Stage:
    """What a stage is: its name, where its output lives, the module that computes it, and (for a
    stage of the DAG) its build function, the type of its parameters and the files it writes."""

    name: str
    kind: str  # lake folder: dumps, quant, models, parts
    suffix: str  # ".zarr", ".gguf", "" (a folder)
    module: str  # e.g. "moeheal.pipeline.stages.dump": its import closure is the stage's code
    resumable: bool = False  # True: a killed build's partial work is handed back to `build`
    build: Build | None = None  # a function of `module`: build(out, params, inputs, log)
    params: type | None = None  # the frozen dataclass `build` receives
    outputs: tuple[str, ...] = ()  # files every build writes into its folder ("{layer}": the params' field)
    check: Callable[[Path], None] | None = None  # raises on an output no run may go past (the audit's leaks)

    def __post_init__(self) -> None:
        for fn in (self.build, self.check):  # the code that computes an output is in its fingerprint
            if fn is not None and fn.__module__ != self.module:
                raise ValueError(f"stage {self.name}: {fn.__name__} is not in {self.module}")

    def code(self) -> str:
        return code_identity(self.module)


@dataclass(frozen=True, eq=False)
class Use:
    """An upstream node read by a node: its whole output, or one file of it."""

    node: Node
    file: str = ""

    def path(self, result: StageResult) -> Path:
        return result.path / self.file if self.file else result.path


@dataclass(frozen=True, eq=False)
class Node:
    """One invocation of a stage: the data `Executor` needs to plan, fingerprint and build it."""

    label: str  # "dump:calibration", "assemble:v2", "quantize:v2:3" (a per-layer unit)
    stage: Stage
    params: Any  # an instance of `stage.params`
    inputs: Mapping[str, Path] = field(default_factory=dict)  # files, fingerprinted by content
    upstream: Mapping[str, Use | Node] = field(default_factory=dict)  # fingerprinted by fingerprint
    after: tuple[Node, ...] = ()  # run (and checked) first, not read: the audit before any dump
    skip: str = ""  # why it cannot run here (llama-check without llama.cpp): planned `skipped`, else logged

    def __post_init__(self) -> None:  # a node read whole is `Use(node)`
        object.__setattr__(self, "upstream", {k: u if isinstance(u, Use) else Use(u) for k, u in self.upstream.items()})
        if self.stage.params is not None and not isinstance(self.params, self.stage.params):
            raise TypeError(f"{self.label}: parameters {type(self.params).__name__}, "
                            f"declared {self.stage.params.__name__}")
        if set(self.inputs) & set(self.upstream):
            raise ValueError(f"{self.label}: {sorted(set(self.inputs) & set(self.upstream))} named twice")


@dataclass(frozen=True)
class PlannedStage:
    """One stage invocation as `moeheal plan` shows it."""

    stage: str  # the node's label
    fingerprint: str
    status: str  # "cached", "compute" or "skipped" (a check whose tool is not installed: llama-check)
    upstream: tuple[str, ...] = ()  # the labels this invocation reads
    name: str = ""  # the stage it is an invocation of ("import-dump" for `dump:calibration` when imported)


def hashed_fields(params: Any) -> list[str]:
    """The fields of a parameters dataclass that reach the fingerprint."""
    return [f.name for f in dataclasses.fields(params) if f.metadata.get("fingerprint", True)]


def param_record(params: Any) -> dict[str, Any]:
    """A stage's parameters as a plain dict: a dataclass's hashed fields without the ones set to None
    (a knob that cannot reach the computation is None and stays out of the fingerprint)."""
    if dataclasses.is_dataclass(params):
        record = dataclasses.asdict(params)
        return {k: record[k] for k in hashed_fields(params) if record[k] is not None}
    return dict(params)


def recording(params: Any, read: set[str]) -> Any:
    """A copy of a parameters dataclass that adds the name of every field read from it to `read`."""
    if not dataclasses.is_dataclass(params):
        return params
    names = {f.name for f in dataclasses.fields(params)}

    class Recorded(type(params)):  # type: ignore[misc]
        def __getattribute__(self, name: str) -> Any:
            if name in names:
                read.add(name)
            return object.__getattribute__(self, name)

    Recorded.__name__ = Recorded.__qualname__ = type(params).__name__
    return Recorded(**{name: getattr(params, name) for name in names})


def stage_fingerprint(stage: Stage, params: Any, inputs: Mapping[str, Path],
                      upstream: Mapping[str, StageResult]) -> tuple[str, dict[str, Any]]:
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


def run_stage(lake: Lake, stage: Stage, params: Any, inputs: Mapping[str, Path],
              upstream: Mapping[str, StageResult], build: Callable[[Path], None],
              log: Callable[[str], None] = print, label: str | None = None) -> StageResult:
    """Run `build(work_path)` unless an output with the same fingerprint is complete; `label` names
    the invocation in the log (`quantize:v1:3`, one unit of a stage run per layer)."""
    fp, provenance = stage_fingerprint(stage, params, inputs, upstream)
    return lake.materialize(stage.name, stage.kind, fp, stage.suffix, build, provenance, log,
                            resume=stage.resumable, label=label)


def plan_stage(lake: Lake, stage: Stage, params: Any, inputs: Mapping[str, Path],
               upstream: Mapping[str, StageResult]) -> StageResult:
    """The result `run_stage` would return, without building: `cached` says whether it exists."""
    fp, _ = stage_fingerprint(stage, params, inputs, upstream)
    cached = lake.is_complete(stage.kind, fp, stage.suffix)
    return StageResult(stage.name, fp, lake.output_path(stage.kind, fp, stage.suffix), cached=cached)


class Executor:
    """Runs (or, with `plan=True`, plans) nodes: each once per run, upstream first.

    Building is generic: the input files and the upstream outputs are resolved
    to paths, the node's parameters and those paths go to its stage's build
    function, the declared outputs are checked, and the stage's check (if any)
    runs on the output whether it was built or found. `nodes` lists every node
    reached, in DAG order.
    """

    def __init__(self, lake: Lake, log: Callable[[str], None] = print, plan: bool = False):
        self.lake, self.log, self.planning = lake, log, plan
        self.planned: list[PlannedStage] = []
        self.nodes: list[Node] = []
        self._results: dict[str, StageResult | None] = {}

    def result(self, node: Node) -> StageResult | None:
        """The node's output (None for a skipped node), built unless it is in the lake."""
        if node.label in self._results:
            return self._results[node.label]
        for first in node.after:
            self.result(first)
        up = {key: self.result(use.node) for key, use in node.upstream.items()}
        assert all(r is not None for r in up.values()), f"{node.label} reads a skipped stage"
        stage, labels = node.stage, tuple(sorted({use.node.label for use in node.upstream.values()}))
        result: StageResult | None
        if self.planning:
            result = plan_stage(self.lake, stage, node.params, node.inputs, up)
            status = "skipped" if node.skip else "cached" if result.cached else "compute"
            self.planned.append(PlannedStage(node.label, result.fingerprint, status, labels, stage.name))
            result = None if node.skip else result
        elif node.skip:
            self.log(f"[{node.label}] skipped: {node.skip}")
            result = None
        else:
            paths = {**node.inputs, **{key: use.path(up[key]) for key, use in node.upstream.items()}}
            try:
                result = run_stage(self.lake, stage, node.params, node.inputs, up,
                                   lambda out: self.build(node, out, paths), self.log, node.label)
            except InputError as exc:  # the one line a user reads names the invocation: stage, variant, layer
                raise type(exc)(f"{node.label}: {exc}") from None
            if stage.check is not None:
                stage.check(result.path)
        self.nodes.append(node)
        self._results[node.label] = result
        return result

    def build(self, node: Node, out: Path, paths: Mapping[str, Path]) -> None:
        """The node's build, then two checks: it read every hashed knob of its parameters (else the
        fingerprint would move where the output cannot), and it wrote every file its stage declares."""
        build = node.stage.build
        assert build is not None, f"{node.label}: stage {node.stage.name} declares no build"
        read: set[str] = set()
        build(out, recording(node.params, read), paths, self.log)
        unread = sorted(set(param_record(node.params)) - read)
        if unread:
            raise RuntimeError(f"{node.label}: {build.__name__} never read {', '.join(unread)} of its parameters, "
                               "which are in its fingerprint")
        names = [name.format(**param_record(node.params)) for name in node.stage.outputs]
        missing = [name for name in names if not (out / name).exists()]
        if missing:
            raise RuntimeError(f"{node.label}: {node.stage.build.__name__} did not write {', '.join(missing)}")
