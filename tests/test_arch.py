"""The model families: each one's registry entry, and OLMoE (no shared expert) against transformers,
through healing, and in llama.cpp."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from moeheal.pipeline.model.arch import ARCHITECTURES
from moeheal.pipeline.model.arch.base import sigmoid_topk_route
from moeheal.pipeline.config import load_config
from moeheal.pipeline.sources.convert import hf_to_gguf
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.runner import Runner
from bench.inputs.ggufs import tiny_hf_model, train_tiny_bpe
from bench.inputs.healworld import write_world
from tests.test_llamacpp import eval_text, llama_perplexity, our_perplexity
from tests.test_runner import check_against_transformers, tokens_for

# One variant without a ridge knob: a family without a shared expert heals by importance, GPTQ and alpha.
OLMOE_VARIANT = """
[[variant]]
name = "v1"
round = "gptq"
gptq_damp = 1.0
"""


def test_registry_names_every_family_by_its_llama_cpp_name():
    assert sorted(ARCHITECTURES) == ["deepseek2", "llama", "olmoe", "qwen2moe", "qwen3moe", "qwen3next"]
    assert all(arch.name == name and str(arch) == name for name, arch in ARCHITECTURES.items())
    assert sorted(n for n, a in ARCHITECTURES.items() if a.has_shared_expert) == ["deepseek2", "qwen2moe", "qwen3next"]
    assert {n: a.routing.norm_topk_default for n, a in ARCHITECTURES.items()} == \
        {"deepseek2": False, "llama": True, "olmoe": False, "qwen2moe": False, "qwen3moe": True, "qwen3next": True}


def test_sigmoid_routing_keeps_the_highest_scores_and_renormalises():
    logits = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    experts, weights = sigmoid_topk_route(jnp.asarray(logits), 3, True)
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))  # (5, 8)
    best = np.argsort(-scores, axis=1)[:, :3]  # (5, 3)
    assert np.array_equal(np.sort(np.asarray(experts), 1), np.sort(best, 1))
    chosen = np.take_along_axis(scores, np.asarray(experts), 1)  # (5, 3)
    np.testing.assert_allclose(np.asarray(weights), chosen / chosen.sum(1, keepdims=True), rtol=1e-6)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory) -> tuple[Path, object]:
    """A random 2-layer OLMoE (hidden 128, 8 experts, top-2) and its F32 GGUF."""
    tokenizer = train_tiny_bpe(seed=4)
    hf = tiny_hf_model("olmoe", tokenizer.get_vocab_size(), seed=4, d_model=128, n_expert=8, k=2, d_expert=64)
    path = tmp_path_factory.mktemp("olmoe") / "tiny-olmoe-f32.gguf"
    hf_to_gguf(hf, tokenizer, path, matrix_type="f32")
    return path, hf


def test_olmoe_reads_as_its_family(olmoe):
    model = GGUFModel(olmoe[0])
    assert model.arch is ARCHITECTURES["olmoe"] and not model.has_shared_expert
    assert (model.hp.d_shexp, model.hp.norm_topk_prob, model.hp.n_expert, model.hp.d_expert) == (0, False, 8, 64)
    assert model.shape("blk.0.attn_q_norm.weight") == (model.hp.n_head * model.hp.head_dim,)  # over every head


def test_olmoe_logits_and_routing_match_transformers(olmoe):
    path, hf = olmoe
    tokens, caps, _ = check_against_transformers(GGUFModel(path), hf)  # weights: the chosen softmax probabilities
    B, T = tokens.shape
    for cap in caps.values():
        assert cap.hh.shape == (B, T, 0) and np.all(cap.shexp_gate == 1.0)


@pytest.fixture(scope="module")
def healed_olmoe(tmp_path_factory) -> tuple[Path, HealRun]:
    """A tiny OLMoE healed end to end (256 wide, so every row is whole TQ2_0 blocks)."""
    root = tmp_path_factory.mktemp("olmoe_world")
    tokenizer = train_tiny_bpe(seed=5)
    hf = tiny_hf_model("olmoe", tokenizer.get_vocab_size(), seed=5, d_model=256, n_expert=8, k=2, d_expert=256)
    hf_to_gguf(hf, tokenizer, root / "ref.gguf", matrix_type="q8_0")
    run = HealRun(load_config(write_world(root, model=root / "ref.gguf", variants=OLMOE_VARIANT)), log=lambda m: None)
    run.heal()
    return root / "ref.gguf", run


def test_olmoe_heals_without_a_ridge_and_the_assembled_gguf_loads(healed_olmoe):
    _, run = healed_olmoe
    variant = run.cfg.variants[0]
    assert run.calibrated_table([variant], "ridge_cv").num_rows == 0  # no shared expert, no ridge
    for m in run.calibrated_table([variant], "layer_metrics").to_pylist():
        assert m["resid_ridge"] == m["resid_alpha"]
        if m["split"] == "in_sample":  # alpha is the least-squares scale on these rows: it cannot do worse
            assert m["resid_alpha"] <= m["resid_alpha1"]
    healed = GGUFModel(run.result(run.assemble(run.cfg.variants[0])).path)
    assert healed.arch is ARCHITECTURES["olmoe"] and healed.metadata("moeheal.variant") == "v1"
    assert healed.raw("blk.0.ffn_down_exps.weight").ggml_type.name == "TQ2_0"
    tokens = tokens_for(healed, batch=1, length=16)
    assert np.all(np.isfinite(Runner(healed).forward(tokens)))


@pytest.mark.llamacpp
def test_llama_cpp_quantizes_and_runs_our_olmoe_ggufs(healed_olmoe, tmp_path):
    """llama-quantize reads our converted OLMoE; llama-perplexity runs it (agreeing with our runner),
    its Q4_K_M and our healed file."""
    source, run = healed_olmoe
    quantized = tmp_path / "q4_k_m.gguf"
    binary = Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-quantize"
    out = subprocess.run([str(binary), "--allow-requantize", str(source), str(quantized), "Q4_K_M"],  # source is Q8_0
                         capture_output=True, text=True, errors="replace", timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
    text = eval_text(tmp_path, run.cfg.path.parent / "docs.jsonl", chunks=2)
    theirs = llama_perplexity(source, text, chunks=2)
    ours = our_perplexity(GGUFModel(source), text.read_text(encoding="utf-8"), chunks=2)
    assert np.log(ours) == pytest.approx(np.log(theirs), abs=0.05)  # llama.cpp rounds activations to 8 bits
    healed = run.result(run.assemble(run.cfg.variants[0])).path
    assert all(np.isfinite(llama_perplexity(gguf, text, chunks=2)) for gguf in (quantized, healed))
