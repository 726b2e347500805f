"""Real sizes. Quantize and calibrate per (variant, layer): resume at the layer reached, recompute
only what a knob touches, and assemble the same GGUF the all-layers stages wrote. Dumps in
bfloat16: read back exactly as the float32 dump rounded, and healing from them moves little."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter

from moeheal.kernels import decode
from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import WRITER_OWNED_KEYS, add_kv, file_type_kv
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.stages import quantize
from moeheal.pipeline.data.dumps import ARRAYS, open_dump
from bench.inputs.ggufs import make_tiny_gguf
from bench.inputs.healworld import write_world

N_LAYER = 3
VARIANT = """
[[variant]]
name = "v1"
ridge_rho = 6.0
"""


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)

    def computed(self) -> list[str]:
        return sorted(m.split("]")[0][1:] for m in self if "computing" in m)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A three-layer world whose dumps are in its lake already (copies of it reuse them)."""
    root = tmp_path_factory.mktemp("units")
    model = make_tiny_gguf(root / "ref.gguf", arch="qwen2moe", seed=5, n_layer=N_LAYER, d_model=256, n_expert=8,
                           k=2, matrix_type="q8_0", d_expert=256, d_shexp=256)
    config = write_world(root, model=model, variants=VARIANT)
    config.write_text(config.read_text().replace("tokens = 1024", "tokens = 512"))
    run = HealRun(load_config(config), log=Log())
    for trace in run.traces_present():
        run.result(run.dump(trace))
    return config


def copy_world(config: Path, dest: Path) -> Path:
    shutil.copytree(config.parent, dest, symlinks=True)  # the lake's links, dangling before a publish
    return dest / config.name


@pytest.fixture(scope="module")
def assembled(world, tmp_path_factory) -> Path:
    """A copy of the world whose lake also holds every variant's units and assembled GGUF, built in
    one process: the single-process result the tests below compare with, or start from."""
    config = copy_world(world, tmp_path_factory.mktemp("assembled") / "w")
    run = HealRun(load_config(config), log=Log())
    for variant in run.all_quantized_variants():
        run.result(run.assemble(variant))
    return config


def statuses(config: Path) -> dict[str, str]:
    return {p.stage: p.status for p in HealRun(load_config(config), plan=True).plan()}


def units(stage: str, variant: str, layers=range(N_LAYER)) -> list[str]:
    return [f"{stage}:{variant}:{layer}" for layer in layers]


def test_plan_lists_every_layer_unit(world):
    planned = statuses(world)
    for variant in ("unhealed", "v1"):
        for label in units("quantize", variant) + units("calibrate", variant) + [f"assemble:{variant}"]:
            assert label in planned
    assert "quantize:v1" not in planned and "calibrate:v1" not in planned


def test_a_killed_quantize_resumes_at_the_layer_it_reached(world, tmp_path, monkeypatch):
    """Killed in the build of layer 2: layers 0 and 1 stay in the lake, and the next run builds only
    the units of layer 2 (and the assembly)."""
    config = copy_world(world, tmp_path / "w")
    real = quantize.quantize_layer
    built: list[int] = []

    def killed_at_layer_2(out, source, dump_root, params, layer, formats, *rest, **kw):
        if layer == 2:
            raise RuntimeError("killed")
        built.append(layer)
        real(out, source, dump_root, params, layer, formats, *rest, **kw)

    monkeypatch.setattr(quantize, "quantize_layer", killed_at_layer_2)
    run = HealRun(load_config(config), log=Log())
    with pytest.raises(RuntimeError, match="killed"):
        run.result(run.assemble(run.cfg.variants[0]))
    assert built == [0, 1]
    planned = statuses(config)
    assert [planned[u] for u in units("quantize", "v1")] == ["cached", "cached", "compute"]
    assert [planned[u] for u in units("calibrate", "v1")] == ["cached", "cached", "compute"]
    assert planned["assemble:v1"] == "compute"

    def recorded(out, source, dump_root, params, layer, formats, *rest, **kw):
        built.append(layer)
        real(out, source, dump_root, params, layer, formats, *rest, **kw)

    monkeypatch.setattr(quantize, "quantize_layer", recorded)
    built.clear()
    log = Log()
    resumed = HealRun(load_config(config), log=log)
    resumed.result(resumed.assemble(resumed.cfg.variants[0]))
    assert built == [2]
    assert log.computed() == ["assemble:v1", "calibrate:v1:2", "quantize:v1:2"]


def test_a_calibrate_knob_recomputes_calibrate_units_and_assembly_only(assembled, tmp_path):
    config = copy_world(assembled, tmp_path / "w")
    config.write_text(config.read_text().replace("ridge_rho = 6.0", "ridge_rho = 1.0"))
    planned = statuses(config)
    assert all(planned[u] == "cached" for u in units("quantize", "v1"))
    assert all(planned[u] == "compute" for u in units("calibrate", "v1"))
    log = Log()
    run = HealRun(load_config(config), log=log)
    run.result(run.assemble(run.cfg.variants[0]))
    assert log.computed() == ["assemble:v1", *units("calibrate", "v1")]


def reference_assembly(path: Path, source: GGUFModel, calibrated: list[Path], variant: str, knobs: dict) -> None:
    """The assembly as the all-layers stage wrote it, independently of the streaming copy: every
    replaced tensor loaded from the per-layer outputs at once and handed to gguf-py's in-memory
    writer (add_tensor, then write_tensors_to_file)."""
    extra = [("moeheal.variant", variant, None),
             ("moeheal.params", json.dumps({"variant": variant, "knobs": knobs}, sort_keys=True), None),
             ("moeheal.source_sha256", source.digest(), None)]
    replaced = {}
    for layer, unit in enumerate(calibrated):
        with np.load(unit / f"layer_{layer}.npz") as data:
            for name in (k.removesuffix(".format") for k in data.files if k.endswith(".format")):
                fmt = decode.format_of(str(data[f"{name}.format"]))
                replaced[f"blk.{layer}.{name}.weight"] = (data[name], fmt.ggml_type)
    extra += file_type_kv(source, {name: replaced[name][1] if name in replaced else source.raw(name).ggml_type
                                   for name in source.tensor_names})  # the experts' type, as llama-quantize names it
    writer = GGUFWriter(path, source.arch.name)
    for key, field in source.metadata_fields().items():
        if key not in WRITER_OWNED_KEYS and key not in {k for k, _, _ in extra}:
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            add_kv(writer, key, source.metadata(key), field.types[0], sub_type)
    for key, value, vtype in extra:
        add_kv(writer, key, value, vtype)
    for name in source.tensor_names:
        data, ggml_type = replaced.get(name) or (source.raw(name).data, source.raw(name).ggml_type)
        writer.add_tensor(name, data, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_assembly_is_byte_identical_to_an_all_at_once_assembly(assembled, tmp_path):
    run = HealRun(load_config(assembled), log=Log())
    for variant in run.all_quantized_variants():
        ours = run.result(run.assemble(variant)).path
        theirs = tmp_path / f"{variant.name}.gguf"
        reference_assembly(theirs, run.source, [u.path for u in run.calibrated_layers(variant)], variant.name,
                           variant.knobs())
        assert ours.read_bytes() == theirs.read_bytes(), variant.name


def shard_process(config: Path, shard: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeheal", "heal", "-c", str(config), "--shard", shard],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_shard_workers_build_each_unit_once_and_the_same_gguf(world, assembled, tmp_path):
    """Two `heal --shard` processes at once on one lake (as two GPUs or hosts would run them) share
    the units between them, each built once; the plan then finds every unit cached, and the healed
    GGUFs are byte for byte those of one process."""
    sharded, single = copy_world(world, tmp_path / "sharded"), assembled
    workers = [shard_process(sharded, f"{i}/2") for i in range(2)]
    outputs = [worker.communicate(timeout=600) for worker in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err
    built = [sorted(line.split("]")[0][1:] for line in out.splitlines() if "computing" in line) for out, _ in outputs]
    every_unit = sorted(u for v in ("unhealed", "v1") for stage in ("quantize", "calibrate") for u in units(stage, v))
    assert sorted(built[0] + built[1]) == every_unit  # each unit once, by one of the workers
    assert built[0] and built[1]
    planned = statuses(sharded)
    assert all(planned[u] == "cached" for u in every_unit)
    assert planned["assemble:v1"] == "compute"  # a worker assembles nothing
    runs = [HealRun(load_config(config), log=Log()) for config in (sharded, single)]
    for variant in runs[0].all_quantized_variants():
        assert all(r.result(r.assemble(variant)).path.read_bytes() == runs[0].result(runs[0].assemble(variant)).path
                   .read_bytes() for r in runs[1:])


@pytest.mark.parametrize("shard", ["2/2", "1", "a/b", "1/-2", "0/0"])
def test_a_bad_shard_is_one_line_and_exit_2(world, shard, capsys):
    assert main(["heal", "-c", str(world), "--shard", shard]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--shard {shard}" in err


# ---- bfloat16 dumps -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_world(assembled, tmp_path_factory) -> Path:
    """The world with `dump_dtype = "bfloat16"`, its lake holding the float32 dumps and units beside."""
    config = copy_world(assembled, tmp_path_factory.mktemp("bf16") / "w")
    config.write_text(config.read_text().replace("seed = 0\n[eval]", 'seed = 0\ndump_dtype = "bfloat16"\n[eval]', 1))
    return config


def test_a_bfloat16_dump_reads_back_as_the_float32_dump_rounded(bf16_world):
    bf_config = load_config(bf16_world)
    assert bf_config.dump_dtype == "bfloat16"
    plain = dataclasses.replace(bf_config, dump_dtype="float32")
    for trace in ("calibration", "unseen"):
        bf_run, f32_run = HealRun(bf_config, log=Log()), HealRun(plain, log=Log())
        bf_dump, f32_dump = bf_run.result(bf_run.dump(trace)), f32_run.result(f32_run.dump(trace))
        assert bf_dump.fingerprint != f32_dump.fingerprint and f32_dump.cached
        bf, f32 = open_dump(bf_dump.path), open_dump(f32_dump.path)
        for layer in map(str, range(N_LAYER)):
            for name in ARRAYS:
                theirs = f32[layer][name][:]
                expected = theirs.astype(ml_dtypes.bfloat16).astype(np.float32) if name in ("mixed", "yr", "hh") \
                    else theirs  # routing is stored exactly
                ours = bf[layer][name][:]
                assert ours.dtype == theirs.dtype
                np.testing.assert_array_equal(ours, expected, err_msg=f"{trace} {layer} {name}")


def test_healing_from_a_bfloat16_dump_moves_the_residuals_little(bf16_world):
    """Every residual of layer_metrics within a relative 2^-9 of the float32 dump's.

    bfloat16 keeps 8 significant bits: each dumped activation moves by at most
    2^-9 of itself (round to nearest even). A residual is a ratio of squared
    norms over T x d terms, and unbiased rounding errors average out across
    them, so it moves far less than one element does (measured here: at most
    8e-5 relative, over both variants, three layers and both splits); one unit
    roundoff, 2^-9 = 0.2%, is then a bound with a 25x margin that no healing
    change of substance stays inside. That the values are not all equal shows
    the second run really read the bfloat16 dump.
    """
    config = load_config(bf16_world)
    tables = {}
    for cfg in (config, dataclasses.replace(config, dump_dtype="float32")):
        run = HealRun(cfg, log=Log())
        tables[cfg.dump_dtype] = run.calibrated_table(list(run.all_quantized_variants()), "layer_metrics").to_pylist()
    keys = ("resid_alpha1", "resid_alpha", "resid_oracle", "resid_ridge")
    pairs = [(bf[key], f32[key]) for bf, f32 in zip(tables["bfloat16"], tables["float32"], strict=True) for key in keys]
    assert all(bf == pytest.approx(f32, rel=2.0**-9) for bf, f32 in pairs)
    assert any(bf != f32 for bf, f32 in pairs)
