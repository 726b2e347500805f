"""`heal.toml` validation: every mistake names its key and file, and exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.config import load_config, without_unmade_peers
from moeheal.pipeline.errors import InputError

BASE = """
[lake]
root = "lake"
[model]
reference = "ref.gguf"
[corpus]
docs = "docs.jsonl"
split = "split.csv"
[calibration]
tokens = 1024
seq_tokens = 256
mix = {{ ops = 0.5 }}
[eval]
windows = "windows.csv"
[[variant]]
name = "v1"
beta_down = 0.25
round = "gptq"
[[variant]]
name = "peer"
gguf = "ref.gguf"
[moce]
bonus = [0.85]
{extra}
"""


def write_config(tmp_path: Path, extra: str = "", text: str | None = None) -> Path:
    for name in ("ref.gguf", "docs.jsonl", "split.csv", "windows.csv"):
        (tmp_path / name).write_text("x")
    path = tmp_path / "heal.toml"
    path.write_text(text if text is not None else BASE.format(extra=extra))
    return path


def test_valid_config_resolves_paths_and_defaults(tmp_path):
    cfg = load_config(write_config(tmp_path))
    assert cfg.reference == (tmp_path / "ref.gguf").resolve() and cfg.source == cfg.reference
    assert cfg.lake_root == (tmp_path / "lake").resolve()
    assert cfg.moce_bonus == (0.0, 0.85)  # bonus 0 is always evaluated: the isolated-MoCE baseline
    v1, peer = cfg.variants
    assert (v1.kind, v1.beta_down, v1.round, v1.beta_gate_up) == ("healed", 0.25, "gptq", 0.5)
    assert peer.kind == "external" and peer.gguf == (tmp_path / "ref.gguf").resolve()
    assert cfg.mix == {"ops": 0.5}


@pytest.mark.parametrize("extra, key", [
    ("[typo]\nx = 1", "[typo]"),
    ("[[variant]]\nname = \"v2\"\nbeta_gu = 0.5", "beta_gu"),
    ("[[variant]]\nname = \"v2\"\nround = \"nearest\"", "round"),
    ("[[variant]]\nname = \"v2\"\nridge_eta = 2.0", "ridge_eta"),
    ("[[variant]]\nname = \"v1\"", "v1"),
    ("[[variant]]\nname = \"unhealed\"", "unhealed"),
    ("[[variant]]\nname = \"x\"\ngguf = \"missing.gguf\"", "gguf"),
    ("[[variant]]\nname = \"x\"\ngguf = \"ref.gguf\"\nalpha = false", "alpha"),
])
def test_bad_values_name_the_key(tmp_path, extra, key):
    with pytest.raises(InputError) as err:
        load_config(write_config(tmp_path, extra))
    assert key in str(err.value) and "heal.toml" in str(err.value)


def test_missing_file_names_key(tmp_path):
    path = write_config(tmp_path)
    (tmp_path / "split.csv").unlink()
    with pytest.raises(InputError, match=r"\[corpus\] split: file not found"):
        load_config(path)


def test_a_peer_not_made_yet_is_left_out_only_where_allowed(tmp_path):
    """Loaded whole, a missing peer is one error naming its key and file; loaded for a command that
    reads no peer, it is left out, with the comparisons that name it."""
    text = BASE.format(extra='[[variant]]\nname = "later"\ngguf = "peers/later.gguf"\n').replace(
        'windows = "windows.csv"', 'windows = "windows.csv"\ncompare = [["v1", "later"], ["v1", "peer"]]')
    path = write_config(tmp_path, text=text)
    with pytest.raises(InputError, match=r"\[variant\[2\]\] gguf: file not found: .*peers/later\.gguf$"):
        load_config(path)
    cfg = without_unmade_peers(load_config(path, peers_may_be_missing=True))
    assert [v.name for v in cfg.variants] == ["v1", "peer"] and cfg.compare == (("v1", "peer"),)
    (tmp_path / "peers").mkdir()
    (tmp_path / "peers" / "later.gguf").write_text("x")
    made = load_config(path)
    assert without_unmade_peers(made) == made and [v.name for v in made.variants] == ["v1", "peer", "later"]


def test_wrong_type_and_bad_mix(tmp_path):
    with pytest.raises(InputError, match=r"\[calibration\] tokens: expected int"):
        load_config(write_config(tmp_path, text=BASE.format(extra="").replace("tokens = 1024", 'tokens = "many"')))
    with pytest.raises(InputError, match=r"mix.ops"):
        load_config(write_config(tmp_path, text=BASE.format(extra="").replace("ops = 0.5", "ops = 1.5")))


def test_cli_exits_2_with_one_line(tmp_path, capsys):
    path = write_config(tmp_path, "[[variant]]\nname = \"v2\"\nbeta_gu = 0.5")
    assert main(["audit", "-c", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moeheal: error:") and "beta_gu" in err[0]


def test_help_lists_the_contract_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("heal", "audit", "dump", "quantize", "calibrate", "eval", "report", "imatrix",
                    "import-dump", "sql", "export"):
        assert command in out


def test_windows_file_or_generation_not_both(tmp_path):
    both = BASE.format(extra="").replace('windows = "windows.csv"',
                                         'windows = "windows.csv"\ngenerate = { eval_per_stratum = 4 }')
    with pytest.raises(InputError, match=r"\[eval\] windows: give either a windows file or a `generate` table"):
        load_config(write_config(tmp_path, text=both))
    generated = BASE.format(extra="").replace('windows = "windows.csv"',
                                              'generate = { eval_per_stratum = 4, ctx_tokens = 32 }')
    cfg = load_config(write_config(tmp_path, text=generated))
    assert cfg.windows is None and cfg.window_generation.eval_per_stratum == 4
    assert (cfg.window_generation.ctx_tokens, cfg.window_generation.scored_tokens) == (32, 64)
    typo = generated.replace("ctx_tokens = 32", "ctx = 32")
    with pytest.raises(InputError, match=r"\[eval.generate\] ctx: unknown key"):
        load_config(write_config(tmp_path, text=typo))


def test_dump_dtype_defaults_to_float32_and_names_a_bad_value(tmp_path):
    assert load_config(write_config(tmp_path)).dump_dtype == "float32"
    with_bf16 = BASE.format(extra="").replace("[calibration]\n", '[calibration]\ndump_dtype = "bfloat16"\n')
    assert load_config(write_config(tmp_path, text=with_bf16)).dump_dtype == "bfloat16"
    with pytest.raises(InputError, match="dump_dtype.*'float16' is not one of float32, bfloat16"):
        load_config(write_config(tmp_path, text=with_bf16.replace("bfloat16", "float16")))
