"""A config whose outside (peer) GGUF is not made yet: the commands that read no peer run, those that
read one stop with one line naming the file and its config key (exit 2).

The world is the healed one, copied with its lake, so the commands that publish carry the healed
set's tables forward: a table computed without the peer is carried, and nothing reads the missing file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config

PEER = '\n[[variant]]\nname = "peer"\ngguf = "peers/peer.gguf"\n'


@pytest.fixture
def world_with_unmade_peer(healed_world, tmp_path) -> Path:
    """The healed world's config with a peer appended whose GGUF does not exist."""
    shutil.copytree(healed_world[0].parent, tmp_path, symlinks=True, dirs_exist_ok=True)  # its lake as it is
    config = tmp_path / "with_peer.toml"
    config.write_text((tmp_path / "heal.toml").read_text() + PEER)
    assert not (tmp_path / "peers" / "peer.gguf").exists()
    return config


def published_tables(lake: Path) -> set[str]:
    return {p.stem for p in (lake / "tables").glob("*.parquet")}


def test_audit_and_dump_run_before_the_peer_is_made(world_with_unmade_peer, capsys):
    config = world_with_unmade_peer
    lake = load_config(config, peers_may_be_missing=True).lake_root
    healed = published_tables(lake)
    assert main(["audit", "-c", str(config)]) == 0
    assert "audit: split clean" in capsys.readouterr().out
    assert main(["dump", "-c", str(config)]) == 0
    assert "calibration:" in capsys.readouterr().out
    # the healed set, computed without the peer, is what this config computes without it: carried whole
    assert published_tables(lake) == healed and "variants" in healed
    variants = pq.read_table(lake / "tables" / "variants.parquet").column("variant").to_pylist()
    assert "peer" not in variants and "v1" in variants


@pytest.mark.parametrize("command", ["heal", "eval", "calibrate", "plan"])
def test_a_command_that_reads_the_peer_names_the_missing_file(world_with_unmade_peer, capsys, command):
    config = world_with_unmade_peer
    lake = load_config(config, peers_may_be_missing=True).lake_root
    current = (lake / "current").resolve()
    assert main([command, "-c", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moeheal: error:")
    assert str(config.parent / "peers" / "peer.gguf") in err[0] and "[variant[2]] gguf: file not found" in err[0]
    assert (lake / "current").resolve() == current  # nothing published
