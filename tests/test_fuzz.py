"""Damaged inputs: every one is a one-line InputError naming the file, never a traceback.

The seeded generators of `bench/inputs/damage.py` damage each kind of input the way disks,
downloads and hand edits do. Most cases call the validating open/read function in-process; a
sample runs through the command line and also checks the exit code, the single stderr line and
that the published lake is byte-identical afterwards. `bench/tools/fuzz_report.py` runs the same
generators over more seeds and prints totals.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from bench.inputs.damage import (CASES_PER_SEED, CLI_KINDS, all_cases, cli_case, lake_digest, read_whole_dump,
                                 run_case, small_line_limit, write_raw_dump)
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.data.dumps import import_raw_dump


# ---- in-process ----------------------------------------------------------------------------

IN_PROCESS_SEEDS = range(48)  # CASES_PER_SEED each: 432 cases


def test_fuzz_in_process(tiny_qwen2moe, tmp_path):
    with small_line_limit():
        outcomes = [run_case(case) for case in all_cases(tiny_qwen2moe, tmp_path, IN_PROCESS_SEEDS)]
    crashes = [o for o in outcomes if o.result == "crash"]
    assert len(outcomes) == CASES_PER_SEED * len(IN_PROCESS_SEEDS)
    assert not crashes, crashes[:5]
    rejected = {o.kind for o in outcomes if o.result == "rejected"}
    assert {"gguf_flip", "gguf_zero", "gguf_truncate", "zarr_chunk_truncate", "spec_d_mismatch"} <= rejected


def test_messages_name_what_is_wrong(tiny_qwen2moe, tmp_path):
    """A few damages whose exact message is part of the contract."""
    data = bytearray(tiny_qwen2moe.read_bytes())
    model = GGUFModel(tiny_qwen2moe)
    token = model.metadata("tokenizer.ggml.tokens")[300].encode()
    at = data.index(struct.pack("<Q", len(token)) + token) + 8  # the token's first byte
    bad = bytearray(data)
    bad[at] = 0xFF  # not UTF-8
    (tmp_path / "utf8.gguf").write_bytes(bytes(bad))
    with pytest.raises(InputError, match=r"utf8\.gguf: key tokenizer\.ggml\.tokens\[\d+\]: string is not valid UTF-8"):
        GGUFModel(tmp_path / "utf8.gguf")
    merge = model.metadata("tokenizer.ggml.merges")[5]
    at = data.index(struct.pack("<Q", len(merge.encode())) + merge.encode()) + 8
    bad = bytearray(data)
    bad[at:at + len(merge)] = merge.replace(" ", "\x7f", 1).encode()  # still UTF-8, no longer two tokens
    (tmp_path / "merge.gguf").write_bytes(bytes(bad))
    with pytest.raises(InputError, match=r"merge\.gguf: key tokenizer\.ggml\.merges\[5\]: .* not two tokens"):
        GGUFModel(tmp_path / "merge.gguf")
    key = b"qwen2moe.expert_used_count"
    bad = bytearray(data)
    bad[data.index(key) + len(key) - 1] ^= 0x01  # ...count -> ...coune
    (tmp_path / "key.gguf").write_bytes(bytes(bad))
    with pytest.raises(InputError, match=r"key\.gguf: key qwen2moe\.expert_used_coun.: unknown key, one byte away"):
        GGUFModel(tmp_path / "key.gguf")


def test_zarr_chunk_damage_names_layer_and_array(tmp_path):
    spec = write_raw_dump(tmp_path / "raw")
    import_raw_dump(spec, tmp_path / "d.zarr")
    chunk = next((tmp_path / "d.zarr" / "1" / "yr" / "c").rglob("*"))
    while not chunk.is_file():
        chunk = next(chunk.iterdir())
    chunk.write_bytes(chunk.read_bytes()[:-7])
    with pytest.raises(InputError, match=r"d\.zarr: layer 1 yr: cannot decode stored chunk"):
        read_whole_dump(tmp_path / "d.zarr")


# ---- through the command line --------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_world(tmp_path_factory) -> Path:
    """A small heal.toml world whose lake has a published table set and warm corpus/audit caches."""
    from moeheal.pipeline.commands.cli import main
    from moeheal.pipeline.lake.store import Lake
    from bench.inputs.healworld import write_world

    config = write_world(tmp_path_factory.mktemp("fuzz_world"))
    assert main(["audit", "-c", str(config)]) == 0
    Lake(config.parent / "lake").write_table("docs", pa.table({"doc_id": ["published"], "n_tokens": [1]}))
    return config


@pytest.mark.parametrize("index", range(len(CLI_KINDS)))
def test_fuzz_command_line(cli_world, index, capsys):
    from moeheal.pipeline.commands.cli import main

    argv, name, expect = cli_case(cli_world, index)
    before = lake_digest(cli_world.parent / "lake")
    capsys.readouterr()
    try:
        code = main(argv)
    except Exception as exc:  # would be a traceback from the real command
        pytest.fail(f"{CLI_KINDS[index]}: traceback: {type(exc).__name__}: {exc}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code in ((expect,) if expect is not None else (0, 2)), (CLI_KINDS[index], code, err)
    if code:  # a command that fails publishes nothing (one that succeeds publishes what it computed)
        assert len(err) == 1 and err[0].startswith("moeheal: error: ") and name in err[0], err
        assert lake_digest(cli_world.parent / "lake") == before


@pytest.mark.parametrize("index", [0, 1])
def test_fuzz_real_command(cli_world, index):
    """The installed entry point in its own process: exit 2, one stderr line, no traceback."""
    argv, name, expect = cli_case(cli_world, index)
    before = lake_digest(cli_world.parent / "lake")
    proc = subprocess.run([sys.executable, "-P", "-m", "moeheal", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == expect == 2, proc.stderr
    assert len(err) == 1 and name in err[0] and "Traceback" not in proc.stderr, proc.stderr
    assert lake_digest(cli_world.parent / "lake") == before
