"""`moeheal lake du` and `gc`, the lake's heal lock, and the free-space check before large stages.

The walk-through (bench/tools/lake_walkthrough.py, recorded in docs/reference.md) runs once on the
smallest healed world: heal, one knob changed and healed again, gc, and a heal that computes nothing.
The other tests work on copies of what it leaves.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from bench.inputs.healworld import V1, write_world
from bench.tools.lake_walkthrough import Step, walk
from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.lake import gc, space
from moeheal.pipeline.lake.store import Lake

ROW = re.compile(r"^(\S+(?: \S+)*)\s+(\S+/)\s+(\d+)\s+([\d,]+)\s+(\d+)\s+([\d,]+)$")


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> tuple[list[Step], Path]:
    folder = tmp_path_factory.mktemp("walk")
    return walk(folder), folder


def du_rows(out: str) -> dict[str, tuple[int, int, int, int]]:
    """`lake du`'s rows: what -> (count, bytes, read, gc frees)."""
    rows = {}
    for line in out.splitlines():
        if m := ROW.match(line):
            rows[m[1]] = (int(m[3]), int(m[4].replace(",", "")), int(m[5]), int(m[6].replace(",", "")))
    return rows


def figure(pattern: str, out: str) -> int:
    return int(re.search(pattern, out)[1].replace(",", ""))


def total_bytes(out: str) -> int:
    return figure(r"all stage outputs\s+\d+\s+([\d,]+)", out)


def test_walkthrough_frees_the_old_knobs_outputs_and_the_next_heal_computes_nothing(walked) -> None:
    steps, folder = walked
    heal, du0, reheal, du1, dry, dry_kept, gc_yes, du2, last, plan = steps
    assert [s.rc for s in steps] == [0] * len(steps), [s.out for s in steps if s.rc]
    rows0, rows1, rows2 = du_rows(du0.out), du_rows(du1.out), du_rows(du2.out)
    assert all(frees == 0 and count == read for name, (count, _, read, frees) in rows0.items()
               if name not in ("tmp", "published sets")), du0.out
    # the knob moved v1's calibrate units (one per layer of the world's two) and what reads them; the
    # unhealed baseline's units stay read
    units = rows0["calibrate"][0]
    assert rows1["calibrate"][:3:2] == (units + 2, units) and rows1["calibrate"][3] > 0
    assert rows1["assemble"][:3:2] == (rows0["assemble"][0] + 1, rows0["assemble"][0])
    assert rows1["quantize"] == rows0["quantize"]  # quantization does not read ridge_rho
    freed = figure(r"would free ([\d,]+) bytes", dry.out)
    assert freed == figure(r"gc would free ([\d,]+) bytes", du1.out) == figure(r"freed ([\d,]+) bytes", gc_yes.out) > 0
    assert total_bytes(du1.out) - total_bytes(du2.out) == freed
    assert figure(r"would free ([\d,]+) bytes", dry_kept.out) == 0  # the previous set names every old output
    assert all(frees == 0 and count == read for name, (count, _, read, frees) in rows2.items()
               if name not in ("tmp", "published sets")), du2.out
    assert " computing " not in last.out and " cache hit " in last.out
    assert re.search(r" 0 to compute", plan.out)
    lake = folder / "lake"
    sources = json.loads((lake / "current" / "sources.json").read_text())
    named = {fp for fps in sources.values() for fp in fps}
    outputs = {gc.fingerprint_of(p.name) for d in gc.OUTPUT_FOLDERS for p in (lake / d).iterdir()}
    assert named & outputs and all((lake / "runs" / f"{fp}.json").exists() for fp in outputs)


def copy_world(walked, dest: Path) -> Path:
    """The walked world (config, model, lake) copied, links kept; its config."""
    _, folder = walked
    shutil.copytree(folder, dest, symlinks=True)
    return dest / "heal.toml"


def unread_output(lake: Path) -> Path:
    """A calibrate unit no config plans: a copy of one, with its provenance, under a new fingerprint."""
    unit = next(p for p in (lake / "quant").iterdir()
                if json.loads((lake / "runs" / f"{p.name}.json").read_text())["stage"] == "calibrate")
    fp = "f" * 64
    shutil.copytree(unit, lake / "quant" / fp)
    shutil.copy(lake / "runs" / f"{unit.name}.json", lake / "runs" / f"{fp}.json")
    return lake / "quant" / fp


def test_gc_keeps_resumable_work_nested_lakes_and_what_a_build_holds(walked, tmp_path, capsys) -> None:
    config = copy_world(walked, tmp_path / "world")
    lake = tmp_path / "world" / "lake"
    planned_dump = next(p for p in (lake / "dumps").iterdir()).name.split(".")[0]
    resumable = lake / "tmp" / f"dumps-{planned_dump}.zarr"
    stale = [lake / "tmp" / f"quant-{'e' * 64}", lake / "tmp" / "publish-20200101T000000-deadbeef",
             lake / "tmp" / f"{'d' * 64}.lock", lake / "runs" / f"{'c' * 64}.json"]
    for path in (resumable, stale[0], stale[1]):
        path.mkdir()
        (path / "part").write_bytes(b"x" * 1000)
    stale[2].write_text("")
    stale[3].write_text("{}")
    pins = lake / "tmp" / "pins"  # the readers' pins of published sets: the lake's own
    pins.mkdir(exist_ok=True)
    (pins / "20200101T000000-deadbeef.lock").write_text("")
    nested = Lake(lake / "ablations" / "a").root / "quant" / ("b" * 64)
    nested.mkdir()
    (nested / "layer_0.npz").write_bytes(b"y" * 5000)
    in_tmp = Lake(lake / "tmp" / "old-copy").root / "parts" / ("a" * 64)
    in_tmp.mkdir()
    held = unread_output(lake)

    with Lake(lake).lock(held.name):  # a build of that fingerprint is under way
        assert main(["lake", "gc", "-c", str(config), "--yes"]) == 0
    out = capsys.readouterr().out
    assert held.exists() and f"left 1 in use (a build holds its lock): {held.name}" in out
    assert resumable.exists() and nested.exists() and in_tmp.exists() and any(pins.iterdir())
    assert not any(p.exists() for p in stale), out
    assert main(["lake", "du", "-c", str(config)]) == 0
    du = capsys.readouterr().out
    assert "not the lake's, left alone: ablations/ (holds lakes)" in du
    assert du_rows(du)["calibrate"][3] > 0
    assert main(["lake", "gc", "-c", str(config), "--yes"]) == 0
    assert not held.exists() and not (lake / "runs" / f"{held.name}.json").exists()
    assert "1 a nested lake" in capsys.readouterr().out


def test_gc_waits_for_a_command_that_writes_the_lake(walked, tmp_path) -> None:
    config = copy_world(walked, tmp_path / "world")
    lake = tmp_path / "world" / "lake"
    unread = unread_output(lake)
    said: list[str] = []
    result: list[str] = []
    with gc.heal_lock(lake.resolve()):  # a heal's whole run holds it shared
        worker = threading.Thread(target=lambda: result.append(gc.gc([config], 1, True, said.append)))
        worker.start()
        deadline = time.time() + 120
        while not said and time.time() < deadline:  # planning the config comes first
            time.sleep(0.2)
        assert said and "gc waits until it ends" in said[0]
        time.sleep(0.5)
        assert unread.exists() and worker.is_alive()
    worker.join(120)
    assert not unread.exists() and "removed: calibrate quant/ 1" in result[0]


def test_configs_of_two_lakes_are_one_line_and_exit_2(tmp_path, capsys) -> None:
    a = write_world(tmp_path / "a", variants=V1)
    b = write_world(tmp_path / "b", variants=V1, model=tmp_path / "a" / "ref.gguf")
    assert main(["lake", "gc", "-c", str(a), str(b), "--yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{b}: [lake] root" in err and "one lake" in err
    assert main(["lake", "du", "-c", str(a), "--keep-sets", "-1"]) == 2


def resolved_paths(run: HealRun, node) -> dict:
    """The paths a node's build is handed (what `Executor.build` passes), from a healed lake."""
    paths = dict(node.inputs)
    for name, value in node.upstream.items():
        paths[name] = ({k: use.path(run.result(use.node)) for k, use in value.items()}
                       if isinstance(value, Mapping) else value.path(run.result(value.node)))
    return paths


def test_estimates_from_the_shapes_bound_what_the_stages_wrote(walked) -> None:
    _, folder = walked
    run = HealRun(load_config(folder / "heal.toml"), log=lambda message: None)
    v1 = run.cfg.healed_variants[0]
    for node in (run.dump("calibration"), run.dump("unseen"), run.reference_logits(), run.assemble(v1)):
        estimate = space.ESTIMATES[node.stage.name](node.params, resolved_paths(run, node))
        written = space.tree_bytes(run.result(node).path)
        assert written <= estimate + space.SLACK and estimate <= 1.2 * written, (node.label, estimate, written)


def test_a_stage_that_does_not_fit_stops_before_writing(tmp_path, capsys, monkeypatch) -> None:
    config = write_world(tmp_path / "world", variants=V1)
    monkeypatch.setattr(space, "disk_free", lambda path: 123_456)
    assert main(["heal", "-c", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.match(r"moeheal: error: dump:calibration: needs [\d,]+ bytes in .*lake \(estimated from the shapes\), "
                    r"123,456 free", err), err
    lake = tmp_path / "world" / "lake"
    assert not any((lake / "dumps").iterdir()) and not list((lake / "tmp").glob("dumps-*"))
    assert not any((lake / "published").iterdir())  # nothing published either


def test_an_assembly_that_does_not_fit_names_its_bytes(walked, monkeypatch) -> None:
    _, folder = walked
    run = HealRun(load_config(folder / "heal.toml"), log=lambda message: None)
    node = run.assemble(run.cfg.healed_variants[0])
    paths = resolved_paths(run, node)
    need = space.assembly_bytes(node.params, paths) + space.SLACK
    monkeypatch.setattr(space, "disk_free", lambda path: need - 1)
    with pytest.raises(InputError, match=f"needs {need:,} bytes .* {need - 1:,} free"):
        space.check_room(run.lake.root, node, folder / "absent", paths)
    monkeypatch.setattr(space, "disk_free", lambda path: need)
    space.check_room(run.lake.root, node, folder / "absent", paths)


def test_estimates_of_the_stages_the_small_world_does_not_build(walked) -> None:
    """reference-topk, healed-dump and e2e sized from the walked world's traces, dump and assembly."""
    _, folder = walked
    run = HealRun(load_config(folder / "heal.toml"), log=lambda message: None)
    v1, hp = run.cfg.healed_variants[0], run.source.hp
    traces = run.result(run.traces()).path
    tokens = {t: len(space.trace_tokens(traces, t)[0]) for t in ("calibration", "unseen")}
    topk = run.reference_topk(8)
    assert space.reference_topk_bytes(topk.params, resolved_paths(run, topk)) == \
        (tokens["calibration"] + tokens["unseen"]) * (8 * 8 + space.TOPK_ROW_BYTES)
    first = run.healed_dump(v1, run.source.moe_layers[0])  # reads the traces and the dump only
    row = space.dump_row_bytes(hp, space.dump_arrays(first.params), "float32") + hp.d_model * 4
    assert space.healed_dump_bytes(first.params, resolved_paths(run, first)) == tokens["calibration"] * row
    tuned = run.e2e(v1)
    assert space.e2e_bytes(tuned.params, resolved_paths(run, tuned)) == run.result(run.assemble(v1)).path.stat().st_size
