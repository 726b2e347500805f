"""Stages as declarations: every stage's parameters object is what its build function reads.

A stage's build function receives one parameters object (besides the paths of
its input files and upstream outputs); that object's hashed fields are the
knobs part of its fingerprint. These tests check both directions: on a world
with every kind of variant, every hashed field of every declared invocation
moves the fingerprint (so no knob the build reads is left out of the key);
every hashed field is read by the build (the executor checks that on every
build of every heal, so no knob that cannot change the output recomputes it;
tested here on a stage made to ignore one); and a setting left out of the key
does not change the output.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np
import pytest
import zarr

from moeheal.pipeline.config import load_config
import moeheal.pipeline.stages as stages_package
from moeheal.pipeline.lake.dag import Executor, Node, Stage, Use, flat, hashed_fields, stage_fingerprint
from moeheal.pipeline.lake.stage import Log
from moeheal.pipeline.stages.audit import check_audit
from moeheal.pipeline.lake.dagdraw import to_dot, to_mermaid
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.heal import STAGES, HealRun
from moeheal.pipeline.lake.store import Lake
from bench.inputs.healworld import write_world

# Every kind of variant a config can hold: least squares, GPTQ, learned rounding on healed inputs weighted
# by the reference's Fisher information, a budget over every role, end-to-end tuning; windows generated, the
# unseen dump imported from another engine.
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
inputs = "healed"
learned_loss = "fisher"
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
    upstream = {key: run.executor.result(use.node) for key, use in flat(node.upstream).items()}
    return stage_fingerprint(node.stage, params, flat(node.inputs), upstream)[0]


def test_every_stage_is_declared_with_one_parameters_object(planned):
    """Each stage is one module of pipeline/stages/ whose build takes (out, params, *, <inputs>, log),
    and the config above reaches every stage."""
    modules = {m.name for m in pkgutil.iter_modules(stages_package.__path__)}
    assert {stage.module.rpartition(".")[2] for stage in STAGES} == modules
    assert len({stage.module for stage in STAGES}) == len(STAGES)  # one stage per module
    for stage in STAGES:
        signature = inspect.signature(stage.build)
        assert list(signature.parameters)[:2] == ["out", "params"] and "log" in signature.parameters, stage.name
        assert all(p.kind is p.KEYWORD_ONLY for p in list(signature.parameters.values())[2:]), stage.name
        assert get_type_hints(stage.build)["params"] is stage.params, stage.name
        assert stage.build.__module__ == stage.module and dataclasses.is_dataclass(stage.params), stage.name
        assert stage.params.__dataclass_params__.frozen, stage.name
    assert {node.stage.name for node in planned.executor.nodes} == {stage.name for stage in STAGES}


def test_the_drawn_dag_has_every_declared_stage(planned):
    """`moeheal plan --format dot|mermaid` draws a node per declared stage (the imported unseen dump
    as `import-dump`, though it is read as `dump:unseen`) and the edges its declarations name."""
    dot, mermaid = to_dot(planned.executor.planned), to_mermaid(planned.executor.planned)
    for stage in STAGES:
        assert f'"{stage.name}" [label=' in dot and f'["{stage.name}<br/>' in mermaid, stage.name
    for edge in ('"import-dump" -> "sensitivity"', '"dump" -> "sensitivity"', '"sensitivity" -> "allocate"',
                 '"allocate" -> "quantize"', '"evaluate" -> "comparisons"', '"e2e" -> "evaluate"'):
        assert edge in dot, edge


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

@dataclasses.dataclass(frozen=True)
class GainParams:
    gain: float
    offset: float | None = None  # None: not in the fingerprint, and not read


def build_scaled(out: Path, params: GainParams, *, data: Path, extra: Path | None = None, log: Log) -> None:
    out.mkdir(parents=True)
    (out / "sum.txt").write_text(str(sum(data.read_bytes()) * params.gain))


def build_ignoring_gain(out: Path, params: GainParams, *, data: Path, log: Log) -> None:
    out.mkdir(parents=True)
    (out / "sum.txt").write_text(str(sum(data.read_bytes())))


def build_summing(out: Path, params: GainParams, *, parts: Mapping[int, Path], log: Log) -> None:
    out.mkdir(parents=True)
    (out / "sum.txt").write_text(str(sum(sum(parts[k].read_bytes()) for k in sorted(parts)) * params.gain))


def test_a_build_must_read_every_hashed_knob(tmp_path):
    """The executor records the fields a build reads: a hashed knob it never reads (the fingerprint
    would move where the output cannot) fails the build and publishes nothing; a None one is not hashed."""
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x01\x02" * 10)
    executor = Executor(Lake(tmp_path / "lake"), log=lambda m: None)
    good = Stage("scaled", "parts", build_scaled, outputs=("sum.txt",))
    assert good.params is GainParams and good.module == build_scaled.__module__
    result = executor.result(Node(good, GainParams(2.0), inputs={"data": data}))
    assert (result.path / "sum.txt").read_text() == "60.0"
    bad = Stage("ignoring", "parts", build_ignoring_gain)
    with pytest.raises(RuntimeError, match="never read gain"):
        executor.result(Node(bad, GainParams(2.0), inputs={"data": data}))
    assert not list((tmp_path / "lake" / "parts").glob(f"{stage_fingerprint(bad, GainParams(2.0), {'data': data}, {})[0]}*"))
    with pytest.raises(TypeError, match="declared GainParams"):
        Node(good, {"gain": 2.0})
    with pytest.raises(ValueError, match="not in"):
        Stage("elsewhere", "parts", build_scaled, check=check_audit)


def test_a_node_is_checked_against_its_builds_signature_when_declared(tmp_path):
    """A misspelt input, a missing required one, or one given where the build takes one per key (or
    the reverse) is refused when the node is declared, naming the build and the input; an optional
    input may be left out; a per-key input reaches the build as a mapping and keys the fingerprint."""
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x01\x02" * 10)
    scaled, summing = Stage("scaled", "parts", build_scaled), Stage("summing", "parts", build_summing)
    with pytest.raises(TypeError, match="build_scaled takes no input dat$"):
        Node(scaled, GainParams(1.0), inputs={"dat": data, "data": data})
    with pytest.raises(TypeError, match="build_scaled needs data"):
        Node(scaled, GainParams(1.0), inputs={"extra": data})
    with pytest.raises(TypeError, match="one per key or one of parts"):
        Node(summing, GainParams(1.0), inputs={"parts": data})
    with pytest.raises(TypeError, match="one per key or one of data"):
        Node(scaled, GainParams(1.0), inputs={"data": {0: data}})
    executor = Executor(Lake(tmp_path / "lake"), log=lambda m: None)
    one = Node(scaled, GainParams(1.0), key=("a",), inputs={"data": data})
    node = Node(summing, GainParams(1.0), key=("v",), upstream={"parts": {0: Use(one, "sum.txt"), 1: Use(one, "sum.txt")}})
    assert node.label == "summing:v" and [n.label for n in node.upstream_nodes()] == ["scaled:a", "scaled:a"]
    assert (executor.result(node).path / "sum.txt").read_text() == str(2.0 * sum(b"30.0"))
    assert set(json.loads(executor.lake.provenance_path(executor.result(node).fingerprint).read_text())["upstream"]) == \
        {"parts.0", "parts.1"}


def build_refusing(out: Path, params: GainParams, *, data: Path, log: Log) -> None:
    raise InputError(f"{data}: gain {params.gain} refused")


def test_a_builds_input_error_names_the_invocation(tmp_path):
    """The one line a user reads for bad input found inside a build (a unit's alpha overflowing fp16,
    a corrupt dump chunk) starts with the invocation's label (stage, variant, layer), keeps its type
    and exit code, and publishes nothing."""
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x01")
    executor = Executor(Lake(tmp_path / "lake"), log=lambda m: None)
    stage = Stage("refusing", "parts", build_refusing)
    with pytest.raises(InputError) as err:
        executor.result(Node(stage, GainParams(2.0), key=("v1", 0), inputs={"data": data}))
    assert str(err.value) == f"refusing:v1:0: {data}: gain 2.0 refused"
    assert err.value.exit_code == 2
    assert not list((tmp_path / "lake" / "parts").glob("*"))


def test_unhashed_chunk_size_does_not_change_the_dump(tmp_path):
    """`chunk_tokens`, kept out of the dump's fingerprint, only sets how many sequences a forward pass
    holds: the unseen trace (two sequences) dumped one at a time holds the same arrays."""
    config = write_world(tmp_path / "w", variants="", moce_bonus=(0.0,))
    run = HealRun(load_config(config), log=lambda m: None)
    node = run.dump("unseen")
    assert node.params.chunk_tokens >= 2 * node.params.seq_tokens
    paths = {**node.inputs, **{k: use.path(run.result(use.node)) for k, use in node.upstream.items()}}
    built = run.result(node).path
    one_by_one = tmp_path / "one_by_one.zarr"
    node.stage.build(one_by_one, dataclasses.replace(node.params, chunk_tokens=node.params.seq_tokens), **paths,
                     log=lambda m: None)
    ours, theirs = zarr.open_group(str(built), mode="r"), zarr.open_group(str(one_by_one), mode="r")
    for layer in ("0", "1"):
        for name in ("mixed", "yr", "hh", "experts", "weights"):
            np.testing.assert_array_equal(ours[layer][name][:], theirs[layer][name][:])


def test_a_variant_tuned_end_to_end_shares_every_unit_up_to_its_assembly(tmp_path):
    """Two variants whose knobs differ only in `e2e`: the same quantize and calibrate units (no variant
    name in their keys); each its own assembly (the GGUF names its variant) and the e2e stage after one."""
    twin = '[[variant]]\nname = "{}"\nquant = "q2_k"\nround = "gptq"\n{}'
    config = write_world(tmp_path, variants=twin.format("plain", "") + twin.format("tuned", "e2e = true\n"))
    planned = {p.stage: p.fingerprint for p in HealRun(load_config(config), log=lambda m: None, plan=True).plan()}
    for stage in ("quantize", "calibrate"):
        for layer in (0, 1):
            assert planned[f"{stage}:plain:{layer}"] == planned[f"{stage}:tuned:{layer}"]
    assert planned["assemble:plain"] != planned["assemble:tuned"]
    assert "e2e:tuned" in planned and "e2e:plain" not in planned
