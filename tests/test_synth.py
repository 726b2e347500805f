"""`moeheal synth`: real shapes and metadata, weights that follow the demo fit, determinism, split files.

The real-shape checks use `--zeros` files (sparse: every shape and key of the
real model, no weights drawn); the weight checks use a shrunk vocabulary and
expert count, so the whole module writes a few tens of MB.
"""

from __future__ import annotations

import filecmp
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from scipy import stats

from moeheal.pipeline.commands.cli import main
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.sources.synth import (
    BORROWED_ROLES, DEMO_MODEL, DEMO_VOCAB, LIKE, NORM_STD, ROLE_FITS, fit_roles, load_demo_vocabulary, plan_tensors,
    role_of, tensor_values, write_synth,
)

Q8_0, F32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32

# The published configs' numbers, written out independently of synth.LIKE.
REAL = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, d_model=2048, n_head=32, n_head_kv=4, head_dim=128,
                          n_expert=128, n_expert_used=8, d_expert=768, d_shexp=0, rope_theta=1e6,
                          vocab_size=151936, norm_topk_prob=True, context_length=40960),
    "qwen3-235b": dict(arch="qwen3moe", n_layer=94, d_model=4096, n_head=64, n_head_kv=4, head_dim=128,
                       n_expert=128, n_expert_used=8, d_expert=1536, d_shexp=0, rope_theta=1e6,
                       vocab_size=151936, norm_topk_prob=True, context_length=40960),
    "qwen3-next-80b": dict(arch="qwen3next", n_layer=48, d_model=2048, n_head=16, n_head_kv=2, head_dim=256,
                           n_expert=512, n_expert_used=10, d_expert=512, d_shexp=512, rope_theta=1e7,
                           vocab_size=151936, norm_topk_prob=True, context_length=262144, rope_dim=64,
                           ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
                           ssm_inner_size=4096),
}
FIRST_LAYERS = {"qwen3-next-80b": 4}  # the fewest layers that keep a full-attention one; 1 for the others
SMALL = dict(n_layer=4, vocab_size=1024, n_expert=8)  # shrunk for the weight checks


@pytest.fixture(scope="module")
def next_small(tmp_path_factory) -> Path:
    """4-layer qwen3-next-80b (3 gated DeltaNet layers, 1 gated full attention, a shared expert: every
    weight role of the demo fit but ffn_norm), 8 experts, 1024 tokens, q8_0."""
    return write_synth(tmp_path_factory.mktemp("synth") / "next.gguf", "qwen3-next-80b", **SMALL).paths[0]


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory) -> Path:
    """1-layer qwen3-30b-a3b, 2 experts, 512 tokens: the smallest file, for byte comparisons."""
    return write_synth(tmp_path_factory.mktemp("synth") / "q3.gguf", "qwen3-30b-a3b", n_layer=1,
                       vocab_size=512, n_expert=2).paths[0]


@pytest.mark.parametrize("like", list(REAL))
def test_real_shapes_and_metadata(like: str, tmp_path: Path) -> None:
    """Every shape and key of the real model; the real 151,936-token vocabulary once (gguf-py takes
    seconds to read its arrays), a 512-token one for the other two."""
    n_layer = FIRST_LAYERS.get(like, 1)
    whole_vocabulary = like == "qwen3-30b-a3b"
    vocab_size = None if whole_vocabulary else 512
    result = write_synth(tmp_path / f"{like}.gguf", like, n_layer=n_layer, zeros=True, vocab_size=vocab_size)
    model = GGUFModel(result.paths[0])
    real = {**REAL[like], "n_layer": n_layer, "vocab_size": vocab_size or REAL[like]["vocab_size"]}
    assert model.arch.name == real.pop("arch")
    assert {key: getattr(model.hp, key) for key in real} == pytest.approx(real)
    hp = model.hp
    assert model.shape("blk.0.ffn_gate_exps.weight") == (hp.n_expert, hp.d_expert, hp.d_model)
    assert model.shape("blk.0.ffn_down_exps.weight") == (hp.n_expert, hp.d_model, hp.d_expert)
    sizes = model.tensor_sizes()
    assert sizes["blk.0.ffn_up_exps.weight"][0] == Q8_0 and sizes["token_embd.weight"][0] == Q8_0
    assert sizes["blk.0.ffn_gate_inp.weight"][0] == F32
    assert "synthetic" in model.metadata("general.name")
    if like == "qwen3-next-80b":  # layers 0-2 gated DeltaNet, layer 3 gated full attention
        assert hp.recurrent_layers == (True, True, True, False) and sizes["blk.0.post_attention_norm.weight"][0] == F32
        assert model.shape("blk.3.attn_q.weight") == (2 * 16 * 256, 2048)  # query and output gate per head
        assert model.shape("blk.0.attn_qkv.weight") == (2 * 16 * 128 + 32 * 128, 2048)
        assert model.shape("blk.0.ssm_conv1d.weight") == (8192, 4) and sizes["blk.0.ssm_conv1d.weight"][0] == F32
        assert model.shape("blk.0.ssm_out.weight") == (2048, 4096) and model.shape("blk.0.ssm_ba.weight") == (64, 2048)
    else:
        assert model.shape("blk.0.attn_q.weight") == (hp.n_head * hp.head_dim, hp.d_model)
        assert sizes["blk.0.ffn_norm.weight"][0] == F32
    if whole_vocabulary:
        text = "The experts route every token. 東京 🙂"
        tok = model.tokenizer()
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
        assert tok.token_to_id("<|im_end|>") == 151645 == model.metadata("tokenizer.ggml.eos_token_id")


def test_weights_follow_the_demo_fit(next_small: Path) -> None:
    """Per role (its first tensor: every layer draws a role alike): std as fitted (rescaled to the
    fan-in), the Student-t's tail quantile, and its excess kurtosis where it is finite enough to
    estimate (df >= 10); norms near 1."""
    model = GGUFModel(next_small)
    first_of_role = {}
    for name in model.tensor_names:
        first_of_role.setdefault(role_of(name), name)
    for role, name in first_of_role.items():
        x = model.tensor(name).ravel().astype(np.float64)
        if role == "norm":
            assert abs(x.mean() - 1) < 0.02 and abs(x.std() - NORM_STD) < 0.02, name
            continue
        if BORROWED_ROLES.get(role, role) not in ROLE_FITS or x.size < 1_000_000:
            continue
        fit = ROLE_FITS[BORROWED_ROLES.get(role, role)]
        std = fit.std if role == "token_embd" else fit.std * math.sqrt(fit.fan_in / model.shape(name)[-1])
        assert x.std() == pytest.approx(std, rel=0.03), name
        df = fit.df if math.isfinite(fit.df) else 1e9
        tail = std * math.sqrt((df - 2) / df) * stats.t.ppf(0.9995, df)
        assert np.quantile(np.abs(x), 0.999) == pytest.approx(tail, rel=0.1), name
        if fit.df >= 10:
            assert stats.kurtosis(x) == pytest.approx(fit.excess_kurtosis, abs=0.05 + 0.2 * fit.excess_kurtosis), name


def test_qwen3next_synth_runs_forward_and_keeps_a_full_attention_layer(next_small: Path, tmp_path: Path) -> None:
    model = GGUFModel(next_small)
    assert model.arch.name == "qwen3next" and model.hp.n_expert_used == 8  # top-10 capped by --experts 8
    a = model.tensor("blk.0.ssm_a")
    assert np.all((a <= -0.01) & (a >= -16)) and not model.tensor("blk.0.ssm_dt.bias").any()
    logits = Runner(model).forward(np.arange(16, dtype=np.int32).reshape(2, 8))
    assert logits.shape == (2, 8, 1024) and np.all(np.isfinite(logits)) and logits.std() > 0
    with pytest.raises(InputError, match="first 3 layers of qwen3-next-80b are all linear attention; keep at least 4"):
        write_synth(tmp_path / "x.gguf", "qwen3-next-80b", n_layer=3, zeros=True)


def test_the_packaged_vocabulary_is_the_demo_models() -> None:
    """synth reads the demo vocabulary from package data (demo/corpus/bundle.py writes it): kept current."""
    assert load_demo_vocabulary(DEMO_VOCAB) == load_demo_vocabulary(DEMO_MODEL)


def test_role_fits_are_the_demo_models() -> None:
    fitted = fit_roles(GGUFModel(DEMO_MODEL))
    assert set(fitted) == set(ROLE_FITS)
    for role, fit in fitted.items():
        committed = ROLE_FITS[role]
        assert (fit.df, fit.std, fit.fan_in) == pytest.approx((committed.df, committed.std, committed.fan_in),
                                                              rel=2e-3), role


def test_same_seed_same_bytes_and_tensors_regenerate_alone(qwen3_small: Path, tmp_path: Path) -> None:
    again = write_synth(tmp_path / "again.gguf", "qwen3-30b-a3b", n_layer=1, vocab_size=512, n_expert=2).paths[0]
    assert filecmp.cmp(qwen3_small, again, shallow=False)
    workers = write_synth(tmp_path / "workers.gguf", "qwen3-30b-a3b", n_layer=1, vocab_size=512, n_expert=2,
                          jobs=2).paths[0]  # chunks drawn by two processes, written in order
    assert filecmp.cmp(qwen3_small, workers, shallow=False)
    other = write_synth(tmp_path / "other.gguf", "qwen3-30b-a3b", n_layer=1, vocab_size=512, n_expert=2, seed=1)
    assert not filecmp.cmp(qwen3_small, other.paths[0], shallow=False)
    model = GGUFModel(qwen3_small)
    plan = {t.name: t for t in plan_tensors(LIKE["qwen3-30b-a3b"], 1, 2, 512, Q8_0)}
    router = plan["blk.0.ffn_gate_inp.weight"]
    np.testing.assert_array_equal(tensor_values(router, seed=0), model.tensor(router.name))
    up = plan["blk.0.ffn_up_exps.weight"]  # (E, f, d) q8_0
    values = tensor_values(up, seed=0).reshape(-1, up.shape[-1])  # (E*f, d)
    np.testing.assert_array_equal(quantize(values, Q8_0), model.raw(up.name).data.reshape(values.shape[0], -1))


def test_split_reads_as_the_unsplit_file(qwen3_small: Path, tmp_path: Path) -> None:
    split = write_synth(tmp_path / "split.gguf", "qwen3-30b-a3b", n_layer=1, vocab_size=512, n_expert=2,
                        split_max_size=4_000_000)
    n = len(split.paths)
    assert n > 2 and [p.name for p in split.paths] == [f"split-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    whole, parts = GGUFModel(qwen3_small), GGUFModel(split.paths[0])
    assert parts.tensor_names == whole.tensor_names and parts.shards == split.paths
    for name in whole.tensor_names:
        np.testing.assert_array_equal(parts.raw(name).data, whole.raw(name).data)
    assert parts.metadata("split.count") == n and parts.metadata("split.tensors.count") == len(whole.tensor_names)
    assert not any(key.startswith("split.") for key in parts.metadata_fields())  # a copy is one file

    with pytest.raises(InputError, match="open it by its first shard"):
        GGUFModel(split.paths[1])
    split.paths[2].unlink()
    with pytest.raises(InputError, match=rf"{split.paths[2].name}: shard 3 of {n} .* is missing"):
        GGUFModel(split.paths[0])
    other = write_synth(tmp_path / "other.gguf", "qwen3-30b-a3b", n_layer=1, vocab_size=512, n_expert=2,
                        split_max_size=8_000_000)
    assert len(other.paths) != n
    shutil.copyfile(other.paths[1], split.paths[1])  # a shard of another split of the same model
    with pytest.raises(InputError, match=rf"{split.paths[1].name}: key split.count: {len(other.paths)}, expected {n}"):
        GGUFModel(split.paths[0])


def test_cli(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli.gguf"
    assert main(["synth", "--like", "qwen3-235b", "--layers", "1", "--out", str(out), "--zeros",
                 "--split-max-size", "2G"]) == 0
    summary = capsys.readouterr().out
    assert "cli-00001-of-0000" in summary and "tensors" in summary and " s" in summary
    for bad in (["--like", "qwen3-31b"], ["--like", "qwen3-235b", "--layers", "95"],
                ["--like", "qwen3-235b", "--type", "q4_0"], ["--like", "qwen3-235b", "--split-max-size", "5X"],
                ["--like", "qwen3-235b", "--vocab", "100"], ["--like", "qwen3-235b", "--seed", "-1"]):
        assert main(["synth", *bad, "--out", str(tmp_path / "bad.gguf")]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _llama_binary(name: str) -> Path:
    binary = Path(os.environ.get("LLAMA_CPP_DIR", ""), "bin", name)
    if not binary.is_file():
        pytest.skip(f"{binary} not built")
    return binary


def _run(argv: list[str]) -> None:
    run = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=300)  # logs cut UTF-8
    assert run.returncode == 0, (run.stdout + run.stderr)[-2000:]


@pytest.mark.llamacpp
def test_llama_quantize_accepts_a_synth(next_small: Path, tmp_path: Path) -> None:
    """llama.cpp reads the file as a model of its architecture: llama-quantize to Q2_K succeeds."""
    out = tmp_path / "q2_k.gguf"
    _run([str(_llama_binary("llama-quantize")), "--allow-requantize", str(next_small), str(out), "Q2_K"])
    assert GGUFModel(out).tensor_sizes()["blk.0.ffn_up_exps.weight"][0] == GGMLQuantizationType.Q2_K


@pytest.mark.llamacpp
def test_llama_cpp_runs_a_split_synth(next_small: Path, tmp_path: Path) -> None:
    """llama.cpp loads and runs both architectures (qwen3next's gated DeltaNet included), the qwen3moe
    one from split shards."""
    split = write_synth(tmp_path / "split.gguf", "qwen3-30b-a3b", n_layer=1, vocab_size=512, n_expert=2,
                        split_max_size=8_000_000)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the model routes every token to two experts."] * 40))
    for model in (split.paths[0], next_small):
        _run([str(_llama_binary("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "64",
              "--chunks", "1", "-t", "2"])
