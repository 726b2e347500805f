"""The stage runner closes every cache hole the audit found (§1.2, §1.4, addendum)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeheal.pipeline.lake.dag import Stage, run_stage
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.store import Lake


def concat_inputs(out: Path, files: dict[str, Path], gain: float) -> None:
    """A real two-input computation: scaled byte sums of each input, written as JSON."""
    out.mkdir(parents=True)
    result = {k: sum(p.read_bytes()) * gain for k, p in sorted(files.items())}
    (out / "result.json").write_text(json.dumps(result))


STAGE = Stage("concat", "parts", write_parquet)  # keyed on lake/files.py's code; built by the lambdas below


def run(lake: Lake, files: dict[str, Path], gain: float, upstream=None, log=None):
    messages: list[str] = []
    result = run_stage(lake, STAGE, {"gain": gain}, files, upstream or {},
                       lambda out: concat_inputs(out, files, gain), (log or messages.append))
    return result, messages


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    files = {"experts": tmp_path / "experts.bin", "tokens": tmp_path / "tokens.bin"}
    files["experts"].write_bytes(b"\x01\x02\x03" * 100)
    files["tokens"].write_bytes(b"\x07" * 50)
    return files


def test_same_inputs_hit_the_cache(tmp_path, inputs):
    lake = Lake(tmp_path / "lake")
    first, _ = run(lake, inputs, 0.5)
    second, log = run(lake, inputs, 0.5)
    assert not first.cached and second.cached
    assert first.fingerprint == second.fingerprint
    assert any("cache hit" in m for m in log)


def test_knob_change_with_byte_identical_inputs_recomputes(tmp_path, inputs):
    """The gain_gu sweep: the down-scale file was byte-identical, the knob changed."""
    lake = Lake(tmp_path / "lake")
    a, _ = run(lake, inputs, 0.5)
    b, _ = run(lake, inputs, 0.3)
    assert a.fingerprint != b.fingerprint and not b.cached
    assert json.loads((b.path / "result.json").read_text())["tokens"] == pytest.approx(7 * 50 * 0.3)


def test_teacher_swap_with_identical_prefix_recomputes(tmp_path, inputs):
    """Layer 0 identical, a late layer different: a whole-content digest sees it."""
    lake = Lake(tmp_path / "lake")
    a, _ = run(lake, inputs, 1.0)
    data = bytearray(inputs["experts"].read_bytes())
    data[-1] ^= 0xFF
    inputs["experts"].write_bytes(bytes(data))
    b, _ = run(lake, inputs, 1.0)
    assert a.fingerprint != b.fingerprint and not b.cached


def test_token_file_rewritten_under_same_path_recomputes(tmp_path, inputs):
    lake = Lake(tmp_path / "lake")
    a, _ = run(lake, inputs, 1.0)
    stat = inputs["tokens"].stat()
    inputs["tokens"].write_bytes(b"\x08" * 50)  # same size
    os.utime(inputs["tokens"], ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime too
    b, _ = run(lake, inputs, 1.0)
    assert a.fingerprint != b.fingerprint and not b.cached


def test_upstream_change_propagates(tmp_path, inputs):
    lake = Lake(tmp_path / "lake")
    up_a, _ = run(lake, inputs, 1.0)
    up_b, _ = run(lake, inputs, 2.0)
    down_a, _ = run(lake, {"tokens": inputs["tokens"]}, 1.0, upstream={"up": up_a})
    down_b, _ = run(lake, {"tokens": inputs["tokens"]}, 1.0, upstream={"up": up_b})
    assert down_a.fingerprint != down_b.fingerprint


def test_stale_metadata_is_not_trusted(tmp_path, inputs):
    """An output whose provenance manifest does not match its bytes is rebuilt."""
    lake = Lake(tmp_path / "lake")
    a, _ = run(lake, inputs, 1.0)
    (a.path / "result.json").write_text('{"tampered": true}')
    b, _ = run(lake, inputs, 1.0)
    assert not b.cached
    assert "tampered" not in (b.path / "result.json").read_text()


def test_provenance_is_never_older_than_its_data(tmp_path, inputs):
    lake = Lake(tmp_path / "lake")
    a, _ = run(lake, inputs, 1.0)
    record = json.loads(lake.provenance_path(a.fingerprint).read_text())
    assert lake.provenance_path(a.fingerprint).stat().st_mtime >= (a.path / "result.json").stat().st_mtime
    assert record["finished"] >= record["started"]
    assert record["inputs"]["experts"]["sha256"] and record["params"] == {"gain": 1.0}
    assert record["outputs"]["result.json"]["size"] == (a.path / "result.json").stat().st_size


def test_crash_midway_leaves_nothing_a_later_run_accepts(tmp_path, inputs):
    lake = Lake(tmp_path / "lake")

    def crashing(out: Path) -> None:
        out.mkdir(parents=True)
        (out / "result.json").write_text("{half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage(lake, STAGE, {"gain": 1.0}, inputs, {}, crashing, lambda m: None)
    fp_dirs = list((lake.root / "parts").iterdir())
    assert fp_dirs == []  # nothing published
    result, _ = run(lake, inputs, 1.0)
    assert not result.cached
    assert json.loads((result.path / "result.json").read_text())["tokens"] == 350.0


def test_killed_process_leaves_no_published_output(tmp_path, inputs):
    """A process killed (SIGKILL) inside a build: the next run recomputes from scratch."""
    lake_root = tmp_path / "lake"
    script = f"""
import sys, time, os
sys.path.append({str(Path(__file__).resolve().parents[1])!r})
from pathlib import Path
from moeheal.pipeline.lake.dag import Stage, run_stage
from moeheal.pipeline.lake.files import write_parquet
from moeheal.pipeline.lake.store import Lake
def slow(out):
    out.mkdir(parents=True); (out / "result.json").write_text("{{half"); print("started", flush=True); time.sleep(60)
run_stage(Lake({str(lake_root)!r}), Stage("concat", "parts", write_parquet), {{}}, {{}}, {{}}, slow,
          lambda m: None)
"""
    script_file = tmp_path / "slow_stage.py"
    script_file.write_text(script)
    proc = subprocess.Popen([sys.executable, str(script_file)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.kill()
    proc.wait()
    assert list((lake_root / "parts").iterdir()) == []
    assert list((lake_root / "runs").iterdir()) == []
