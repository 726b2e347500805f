"""Stages as declarations: every stage's parameters object is what its build function reads.

A stage's build function receives one parameters object (besides the paths of
its input files and upstream outputs); that object's hashed fields are the
knobs part of its fingerprint. These tests check both directions on small
worlds: every hashed field moves the fingerprint (so no knob the build reads
is left out of the key), every hashed field is read by the build (so no knob
that cannot change the output recomputes it), and a field left out of the key
does not change the output.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from moeheal.pipeline.config import load_config
from moeheal.pipeline.dag import Executor, Node, hashed_fields, stage_fingerprint
from moeheal.pipeline.heal import STAGES, HealRun
from tests.healworld import write_world

# Every kind of variant a config can hold: least squares, GPTQ, learned rounding, a budget over every
# role, end-to-end tuning; windows generated, the unseen dump imported from another engine.
VARIANTS = """
[[variant]]
name = "ls"
round = "ls"
ridge_rho = 6.0
[[variant]]
name = "gptq"
round = "gptq"
gptq_router_weighted = true
[[variant]]
name = "learned"
round = "learned"
learned_steps = 2
[[variant]]
name = "budget"
budget_bpw = 3.8
formats = ["tq2_0", "q2_k", "q3_k", "iq4_nl"]
budget_roles = "all"
[[variant]]
name = "tuned"
quant = "q2_k"
e2e = true
e2e_steps = 2
"""


def imported_unseen_dump(root: Path, model: Any, tokens: int) -> Path:
    """A raw dump spec of the model's widths over `tokens` rows (zeros: planning reads no values)."""
    hp = model.hp
    widths = {"mixed": hp.d_model, "yr": hp.d_model, "hh": hp.d_shexp, "experts": hp.n_expert_used,
              "weights": hp.n_expert_used}
    layers = []
    for layer in range(hp.n_layer):
        for name, width in widths.items():
            np.zeros((tokens, width), np.float32).tofile(root / f"{layer}.{name}.bin")
        layers.append("[[layers]]\n" + "\n".join(f'{n} = "{layer}.{n}.bin"' for n in widths))
    spec = root / "unseen.toml"
    spec.write_text(f'trace = "unseen"\nT = {tokens}\nd = {hp.d_model}\nf = {hp.d_shexp}\nk = {hp.n_expert_used}\n'
                    + "\n".join(layers) + "\n")
    return spec


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> HealRun:
    """Every stage declared by a config with every kind of variant, planned (nothing built)."""
    root = tmp_path_factory.mktemp("declared")
    config = write_world(root, variants=VARIANTS)
    text = config.read_text().replace('windows = "windows.csv"\n', "")
    text = text.replace("[moce]", "[eval.generate]\neval_per_stratum = 2\ncanary_per_stratum = 1\n"
                                  "ctx_tokens = 32\nscored_tokens = 16\n[moce]")
    run = HealRun(load_config(config), log=lambda m: None, plan=True)
    spec = imported_unseen_dump(root, run.reference, 512)
    config.write_text(text.replace("seed = 0\n[eval]", f'seed = 0\nimport_unseen_dump = "{spec}"\n[eval]', 1))
    run = HealRun(load_config(config), log=lambda m: None, plan=True)
    run.plan()
    return run


def changed(value: Any) -> Any:
    """A value of the same kind that differs from `value` (None: a knob that now reaches the stage)."""
    if value is None:
        return 1
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, dict):
        return {**value, "changed": 1}
    if isinstance(value, (list, tuple)):
        return type(value)([*value, "changed"])
    if dataclasses.is_dataclass(value):
        first = hashed_fields(value)[0]
        return dataclasses.replace(value, **{first: changed(getattr(value, first))})
    raise TypeError(f"no changed value for {value!r}")


def fingerprint_of(run: HealRun, node: Node, params: Any) -> str:
    upstream = {key: run.executor.result(use.node) for key, use in node.upstream.items()}
    return stage_fingerprint(node.stage, params, node.inputs, upstream)[0]


def test_every_stage_is_declared_with_one_parameters_object(planned):
    """Each stage's build is a function of its own module taking (out, params, inputs, log), and the
    config above reaches every stage."""
    for stage in STAGES:
        signature = inspect.signature(stage.build)
        assert list(signature.parameters) == ["out", "params", "inputs", "log"], stage.name
        assert signature.parameters["params"].annotation == stage.params.__name__, stage.name
        assert stage.build.__module__ == stage.module and dataclasses.is_dataclass(stage.params), stage.name
        assert stage.params.__dataclass_params__.frozen, stage.name
    assert {node.stage.name for node in planned.executor.nodes} == {stage.name for stage in STAGES}


def test_every_hashed_knob_moves_the_fingerprint(planned):
    """For every declared invocation, each hashed field of its parameters changed alone gives a new
    fingerprint; a field kept out of the key gives the same one."""
    checked = 0
    for node in planned.executor.nodes:
        base = fingerprint_of(planned, node, node.params)
        for f in dataclasses.fields(node.params):
            moved = fingerprint_of(planned, node, dataclasses.replace(
                node.params, **{f.name: changed(getattr(node.params, f.name))})) != base
            assert moved == (f.name in hashed_fields(node.params)), (node.label, f.name)
            checked += 1
    assert checked > 200


# ---- what the builds read -------------------------------------------------------------------------

def recorder(params: Any, seen: set[str]) -> Any:
    """A copy of `params` whose class records every field read from it into `seen`."""
    names = {f.name for f in dataclasses.fields(params)}

    class Recorded(type(params)):  # type: ignore[misc]
        def __getattribute__(self, name: str) -> Any:
            if name in names:
                seen.add(name)
            return object.__getattribute__(self, name)

    return Recorded(**{name: getattr(params, name) for name in names})


@pytest.fixture(scope="module")
def read_fields(tmp_path_factory) -> tuple[HealRun, dict[str, tuple[Node, set[str]]]]:
    """A heal of a small world with a budget and an e2e variant, recording the fields each build reads."""
    variants = '[[variant]]\nname = "b"\nbudget_bpw = 2.4\nformats = ["tq2_0", "q2_k"]\ne2e = true\ne2e_steps = 1\n'
    config = write_world(tmp_path_factory.mktemp("reads"), variants=variants, moce_bonus=(0.0,))
    config.write_text(config.read_text().replace("tokens = 1024", "tokens = 256"))  # one sequence: a fast dump
    reads: dict[str, tuple[Node, set[str]]] = {}

    def build(self: Executor, node: Node, out: Path, paths: dict[str, Path]) -> None:
        seen: set[str] = set()
        reads[node.label] = (node, seen)
        node.stage.build(out, recorder(node.params, seen), paths, self.log)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Executor, "build", build)
        run = HealRun(load_config(config), log=lambda m: None)
        run.heal()
    return run, reads


def test_every_hashed_knob_is_read_by_its_build(read_fields):
    """No hashed field is dead weight: each one set is read by the build it keys, so changing it
    can change the output (a field read only to be passed on is read too)."""
    _, reads = read_fields
    assert {node.stage.name for node, _ in reads.values()} >= {
        "corpus", "traces", "windows", "audit", "dump", "sensitivity", "allocate", "quantize", "calibrate",
        "assemble", "e2e", "reference-logits", "evaluate", "comparisons"}
    for label, (node, seen) in reads.items():
        hashed = {name for name in hashed_fields(node.params) if getattr(node.params, name) is not None}
        assert hashed <= seen, (label, hashed - seen)


def test_unhashed_settings_do_not_change_the_output(read_fields, tmp_path):
    """A field kept out of the fingerprint is one the output does not depend on: the dump with a
    different chunk size holds the same arrays, the allocation named differently the same recipe."""
    run, reads = read_fields
    for label, setting in (("dump:unseen", {"chunk_tokens": 256}), ("allocate:b", {"where": "elsewhere"})):
        node, _ = reads[label]
        assert set(setting) == {f.name for f in dataclasses.fields(node.params)} - set(hashed_fields(node.params))
        paths = {**node.inputs, **{k: use.path(run.executor.result(use.node)) for k, use in node.upstream.items()}}
        out = tmp_path / label.replace(":", "_")
        node.stage.build(out, dataclasses.replace(node.params, **setting), paths, lambda m: None)
        built = run.executor.result(node).path
        if node.stage.name == "dump":
            ours, theirs = zarr.open_group(str(built), mode="r"), zarr.open_group(str(out), mode="r")
            for layer in ("0", "1"):
                for name in ("mixed", "yr", "hh", "experts", "weights"):
                    np.testing.assert_array_equal(ours[layer][name][:], theirs[layer][name][:])
        else:
            assert (out / "recipe.parquet").read_bytes() == (built / "recipe.parquet").read_bytes()
