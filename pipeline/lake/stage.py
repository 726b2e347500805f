"""What a stage is, as its module declares it: `STAGE = Stage(name, kind, build, ...)`.

Kept apart from the executor (`dag.py`) so that a stage module's import closure,
which is its code identity, holds this small declaration and not the runner.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, get_origin, get_type_hints

from moeheal.pipeline.lake.codeid import code_identity

Log = Callable[[str], None]


@dataclass(frozen=True)
class Input:
    """One input a build function declares as a keyword-only parameter: a file or stage output
    (`Path`), an optional one (`Path | None = None`), or one per key (`Mapping[..., Path]`: an
    assembly's per-layer units, the comparisons' evaluations)."""

    name: str
    required: bool
    many: bool


def build_inputs(build: Callable[..., None]) -> tuple[type, dict[str, Input]]:
    """(the type of `params`, the inputs) a build function declares by its signature:
    `build(out: Path, params: P, *, <input>: Path | None | Mapping[str, Path] ..., log: Log)`."""
    hints = get_type_hints(build)
    signature = inspect.signature(build)
    inputs: dict[str, Input] = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY or name == "log":
            continue
        many = get_origin(hints[name]) in (Mapping, dict)
        inputs[name] = Input(name, parameter.default is inspect.Parameter.empty, many)
    if list(signature.parameters)[:2] != ["out", "params"] or "log" not in signature.parameters:
        raise TypeError(f"{build.__qualname__}: a build is build(out, params, *, <inputs>, log)")
    return hints["params"], inputs


@dataclass(frozen=True)
class Stage:
    """What a stage is: its name, where its output lives, its build function (whose signature
    declares the type of its parameters and its inputs, and whose module's import closure is the
    stage's code) and the files every build writes."""

    name: str
    kind: str  # lake folder: dumps, quant, models, parts
    build: Callable[..., None]
    suffix: str = ""  # ".zarr", ".gguf", "" (a folder)
    outputs: tuple[str, ...] = ()  # files every build writes into its folder ("{layer}": the params' field)
    resumable: bool = False  # True: a killed build's partial work is handed back to `build`
    check: Callable[[Path], None] | None = None  # raises on an output no run may go past (the audit's leaks)

    def __post_init__(self) -> None:
        if self.check is not None and self.check.__module__ != self.module:  # its code is in the fingerprint
            raise ValueError(f"stage {self.name}: {self.check.__name__} is not in {self.module}")

    @property
    def module(self) -> str:
        """The stage's module, e.g. "moeheal.pipeline.stages.dump": its import closure is the stage's code."""
        return self.build.__module__

    @cached_property
    def signature(self) -> tuple[type, dict[str, Input]]:
        return build_inputs(self.build)

    @property
    def params(self) -> type:
        return self.signature[0]

    @property
    def inputs(self) -> dict[str, Input]:
        return self.signature[1]

    def code(self) -> str:
        return code_identity(self.module)
