"""Stages as declarations, and the one runner that caches, locks and builds them.

A stage is one module of `pipeline/stages/`: a frozen dataclass of its
parameters, one build function, and `STAGE = Stage(name, kind, build, ...)`.
The build function's signature is the stage's declaration (as Hamilton or
Dagster assets read theirs):

    def build(out: Path, params: QuantizeParams, *, source: Path, dump: Path | None = None,
              recipe: Path | None = None, log: Log) -> None

its `params` annotation is the type of its parameters, and each keyword-only
parameter is an input: a file or an upstream stage's output, optional where it
defaults to None, one per key where it is a `Mapping`. A `Node` is one
invocation (`quantize:v2:3`): its parameters object, input files and upstream
nodes, named as the build's parameters and checked against them when the node
is declared, so a misspelt, missing or misshaped input fails `moeheal plan`
instead of being silently dropped. The parameters object (exactly the knobs
that reach the computation) is the only thing of the configuration that is
hashed and the only thing of it the build receives; the executor records which
fields a build reads and fails one that never read a hashed knob (which would
recompute where the output cannot change). A field marked
`metadata={"fingerprint": False}` is a setting that cannot change the output
(how many tokens a forward pass holds, how an error names the variant).

The stage's code is its module's import closure (`pipeline/lake/codeid.py`):
one stage per module, so no two stages re-key each other.

`Executor.result(node)` derives the fingerprint from the parameters, the
content digests of the input files, the upstream fingerprints and the code,
before anything is built, and hands the build to the lake, which skips it when
a complete output with that fingerprint exists and otherwise builds it under
tmp/ and publishes it atomically. With `plan=True` it only says whether the
output exists: `moeheal plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

from moeheal.pipeline.data.read_ahead import reading_ahead
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.lake.fingerprint import content_digest, fingerprint
from moeheal.pipeline.lake.stage import Stage
from moeheal.pipeline.lake.store import Lake, StageResult


@dataclass(frozen=True, eq=False)
class Use:
    """An upstream node read by a node: its whole output, or one file of it."""

    node: Node
    file: str = ""

    def path(self, result: StageResult) -> Path:
        return result.path / self.file if self.file else result.path


Upstream = Union[Use, "Node"]


@dataclass(frozen=True, eq=False)
class Node:
    """One invocation of a stage: the data `Executor` needs to plan, fingerprint and build it.

    `inputs` (files, fingerprinted by content) and `upstream` (nodes, fingerprinted by fingerprint)
    are named as the build function's keyword parameters; a node that names one the build does not
    take, leaves out one it requires, or gives one where it takes one per key (or the reverse) is
    refused when declared, before anything runs.
    """

    stage: Stage
    params: Any  # an instance of `stage.params`
    key: tuple[Any, ...] = ()  # what tells this invocation from the stage's others: (variant, layer)
    inputs: Mapping[str, Path | Mapping[Any, Path]] = field(default_factory=dict)
    upstream: Mapping[str, Upstream | Mapping[Any, Upstream]] = field(default_factory=dict)
    after: tuple[Node, ...] = ()  # run (and checked) first, not read: the audit before any dump
    skip: str = ""  # why it cannot run here (llama-check without llama.cpp): planned `skipped`, else logged
    label: str = ""  # "quantize:v2:3": the stage's name and the key, unless given (an imported dump)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", ":".join([self.stage.name, *map(str, self.key)]))
        object.__setattr__(self, "upstream", {k: _uses(u) for k, u in self.upstream.items()})
        if not isinstance(self.params, self.stage.params):
            raise TypeError(f"{self.label}: parameters {type(self.params).__name__}, "
                            f"declared {self.stage.params.__name__}")
        if set(self.inputs) & set(self.upstream):
            raise ValueError(f"{self.label}: {sorted(set(self.inputs) & set(self.upstream))} named twice")
        given = {**self.inputs, **self.upstream}
        declared, build = self.stage.inputs, self.stage.build.__qualname__
        unknown = sorted(set(given) - set(declared))
        missing = sorted(name for name, i in declared.items() if i.required and name not in given)
        shape = sorted(name for name, value in given.items()
                       if name in declared and declared[name].many != isinstance(value, Mapping))
        for what, names in (("takes no input", unknown), ("needs", missing), ("takes one per key or one of", shape)):
            if names:
                raise TypeError(f"{self.label}: {build} {what} {', '.join(names)}")

    def upstream_nodes(self) -> list[Node]:
        """Every node this one reads, in a stable order."""
        return [use.node for value in self.upstream.values()
                for use in (value.values() if isinstance(value, Mapping) else (value,))]


def _uses(value: Upstream | Mapping[Any, Upstream]) -> Use | dict[Any, Use]:
    """A node read whole is `Use(node)`; a mapping of them, each."""
    if isinstance(value, Mapping):
        return {k: v if isinstance(v, Use) else Use(v) for k, v in value.items()}
    return value if isinstance(value, Use) else Use(value)


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
                      upstream: Mapping[str, StageResult | None]) -> tuple[str, dict[str, Any]]:
    """The fingerprint and the provenance record of one stage invocation; a skipped upstream (None,
    read only by a skipped node, which is planned and never built) is left out."""
    record = param_record(params)
    digests = {key: content_digest(path) for key, path in sorted(inputs.items())}
    upstream_fps = {key: result.fingerprint for key, result in sorted(upstream.items()) if result is not None}
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
               upstream: Mapping[str, StageResult | None]) -> StageResult:
    """The result `run_stage` would return, without building: `cached` says whether it exists."""
    fp, _ = stage_fingerprint(stage, params, inputs, upstream)
    cached = lake.is_complete(stage.kind, fp, stage.suffix)
    return StageResult(stage.name, fp, lake.output_path(stage.kind, fp, stage.suffix), cached=cached)


def flat(named: Mapping[str, Any]) -> dict[str, Any]:
    """Inputs or upstream one per name, a per-key one's as `<name>.<key>` (`calibrated.3`): how
    fingerprints and provenance name them."""
    out: dict[str, Any] = {}
    for name, value in named.items():
        out |= {f"{name}.{k}": v for k, v in value.items()} if isinstance(value, Mapping) else {name: value}
    return out


class Executor:
    """Runs (or, with `plan=True`, plans) nodes: each once per run, upstream first.

    Building is generic: the input files and the upstream outputs are resolved
    to paths, the node's parameters and those paths go to its stage's build
    function, the declared outputs are checked, and the stage's check (if any)
    runs on the output whether it was built or found. `nodes` lists every node
    reached, in DAG order.
    """

    def __init__(self, lake: Lake, log: Callable[[str], None] = print, plan: bool = False,
                 before_build: Callable[[Node, Path, Mapping[str, Any]], None] | None = None):
        self.lake, self.log, self.planning = lake, log, plan
        self.before_build = before_build  # told (node, where it builds, its inputs' paths) before it writes
        self.planned: list[PlannedStage] = []
        self.nodes: list[Node] = []
        self._results: dict[str, StageResult | None] = {}
        self._depth = 0  # nested `result` calls: the outermost one holds the dumps' read-ahead

    def result(self, node: Node) -> StageResult | None:
        """The node's output (None for a skipped node), built unless it is in the lake; the outermost
        call reads the dumps' layers ahead (`read_ahead`) while the nodes under it build."""
        if self._depth or self.planning:
            return self._result(node)
        self._depth += 1
        try:
            with reading_ahead():
                return self._result(node)
        finally:
            self._depth -= 1

    def _result(self, node: Node) -> StageResult | None:
        if node.label in self._results:
            return self._results[node.label]
        for first in node.after:
            self.result(first)
        if node.skip and not self.planning:  # nothing it reads is needed: a skipped stage it reads stays unread
            self.log(f"[{node.label}] skipped: {node.skip}")
            self.nodes.append(node)
            self._results[node.label] = None
            return None
        up = {key: self.result(use.node) for key, use in flat(node.upstream).items()}
        files = flat(node.inputs)
        assert node.skip or all(r is not None for r in up.values()), f"{node.label} reads a skipped stage"
        stage, labels = node.stage, tuple(sorted({n.label for n in node.upstream_nodes()}))
        result: StageResult | None
        if self.planning:
            result = plan_stage(self.lake, stage, node.params, files, up)
            status = "skipped" if node.skip else "cached" if result.cached else "compute"
            self.planned.append(PlannedStage(node.label, result.fingerprint, status, labels, stage.name))
            result = None if node.skip else result
        else:
            paths: dict[str, Any] = dict(node.inputs)
            for name, value in node.upstream.items():
                paths[name] = ({k: use.path(up[f"{name}.{k}"]) for k, use in value.items()}
                               if isinstance(value, Mapping) else value.path(up[name]))
            try:
                result = run_stage(self.lake, stage, node.params, files, up,
                                   lambda out: self.build(node, out, paths), self.log, node.label)
            except InputError as exc:  # the one line a user reads names the invocation: stage, variant, layer
                raise type(exc)(f"{node.label}: {exc}") from None
            if stage.check is not None:
                stage.check(result.path)
        self.nodes.append(node)
        self._results[node.label] = result
        return result

    def build(self, node: Node, out: Path, paths: Mapping[str, Any]) -> None:
        """The node's build, then two checks: it read every hashed knob of its parameters (else the
        fingerprint would move where the output cannot), and it wrote every file its stage declares."""
        build = node.stage.build
        if self.before_build is not None:
            self.before_build(node, out, paths)
        read: set[str] = set()
        build(out, recording(node.params, read), **paths, log=self.log)
        unread = sorted(set(param_record(node.params)) - read)
        if unread:
            raise RuntimeError(f"{node.label}: {build.__name__} never read {', '.join(unread)} of its parameters, "
                               "which are in its fingerprint")
        names = [name.format(**param_record(node.params)) for name in node.stage.outputs]
        missing = [name for name in names if not (out / name).exists()]
        if missing:
            raise RuntimeError(f"{node.label}: {node.stage.build.__name__} did not write {', '.join(missing)}")
