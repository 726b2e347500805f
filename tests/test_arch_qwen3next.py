"""Qwen3-Next (llama.cpp `qwen3next`): gated full attention and gated DeltaNet layers with a shared
expert, against transformers' Qwen3NextForCausalLM (its pure-torch delta rule), a float64 NumPy
delta rule, llama.cpp, and through healing."""

from __future__ import annotations

import copy
import os
import subprocess
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from moeheal.kernels.moce import lru_hits, make_routing_hook
from moeheal.pipeline.model.arch import ARCHITECTURES
from moeheal.pipeline.model.arch.qwen3next import gated_delta_rule
from moeheal.pipeline.config import load_config
from moeheal.pipeline.sources.convert import hf_to_gguf
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import write_gguf
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.runner import LayerCapture, Runner
from bench.inputs.ggufs import train_tiny_bpe
from bench.inputs.healworld import write_world
from tests.test_llamacpp import eval_text, llama_perplexity, our_perplexity
from tests.test_runner import numpy_moe, rel_err, tokens_for, transformers_run

# A variant with a ridge: Qwen3-Next has a shared expert, so healing runs importance, GPTQ, alpha and the ridge.
RIDGE_VARIANT = """
[[variant]]
name = "v1"
beta_gate_up = 0.5
beta_down = 0.5
ridge_rho = 6.0
round = "gptq"
gptq_damp = 1.0
"""


def tiny_qwen3next(vocab_size: int, seed: int, d_model: int = 64, n_layer: int = 4, n_expert: int = 8, k: int = 2,
                   d_expert: int = 32, d_shexp: int = 64, interval: int = 2, **overrides):
    """A seeded random Qwen3NextForCausalLM, float32, eval mode: layers 1 and 3 of 4 full attention
    (`interval`), 2 key / 4 value heads of linear attention, RoPE on a quarter of each head."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=96, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=n_expert,
        num_experts_per_tok=k, moe_intermediate_size=d_expert, shared_expert_intermediate_size=d_shexp,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                       "partial_rotary_factor": 0.25},
        full_attention_interval=interval, rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=0, pad_token_id=0, **overrides)
    config._attn_implementation = "eager"
    model = Qwen3NextForCausalLM(config)
    # Zero-centred norms initialise to 0 (gated ones to 1); randomise them so a missed +1 would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model.float().eval()


@pytest.fixture(scope="module")
def qwen3next(tmp_path_factory) -> tuple[Path, object]:
    """A random 4-layer Qwen3-Next (hidden 64, 8 experts, top-2) and its F32 GGUF."""
    tokenizer = train_tiny_bpe(seed=6)
    hf = tiny_qwen3next(tokenizer.get_vocab_size(), seed=6)
    path = tmp_path_factory.mktemp("qwen3next") / "tiny-qwen3next-f32.gguf"
    hf_to_gguf(hf, tokenizer, path, matrix_type="f32")
    return path, hf


def test_qwen3next_is_written_as_llama_cpp_writes_it(qwen3next):
    path, hf = qwen3next
    model = GGUFModel(path)
    assert model.arch is ARCHITECTURES["qwen3next"] and model.has_shared_expert
    hp = model.hp
    assert hp.recurrent_layers == (True, False, True, False) and hp.rope_dim == 4 and hp.head_dim == 16
    assert (hp.ssm_conv_kernel, hp.ssm_state_size, hp.ssm_group_count, hp.ssm_time_step_rank,
            hp.ssm_inner_size) == (4, 16, 2, 4, 64)
    # transformers keeps layer_types, not the interval, so the converter writes its default 4 and the
    # layer pattern as attention.recurrent_layers, which llama.cpp and we read first
    assert model.metadata("qwen3next.full_attention_interval") == 4 and hp.norm_topk_prob
    assert sorted(n[len("blk.0."):] for n in model.tensor_names if n.startswith("blk.0.")) == sorted([
        "attn_norm.weight", "post_attention_norm.weight", "attn_qkv.weight", "attn_gate.weight",
        "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_ba.weight", "ssm_norm.weight", "ssm_out.weight",
        "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
        "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"])
    assert model.shape("blk.1.attn_q.weight") == (2 * 4 * 16, 64)  # query and output gate per head
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    la = "model.layers.0.linear_attn."
    np.testing.assert_array_equal(model.tensor("blk.0.ssm_a"), -torch.exp(hf.state_dict()[la + "A_log"]).numpy())
    np.testing.assert_array_equal(model.tensor("blk.1.attn_q_norm.weight"),
                                  state["model.layers.1.self_attn.q_norm.weight"] + 1)  # zero-centred: +1 baked in
    np.testing.assert_array_equal(model.tensor("blk.0.ssm_norm.weight"), state[la + "norm.weight"])  # as is
    # qkvz per key head [q(16), k(16), v(2x16), z(2x16)] -> [q heads | k heads | v heads] and z
    qkvz = state[la + "in_proj_qkvz.weight"].reshape(2, 96, 64)
    np.testing.assert_array_equal(model.tensor("blk.0.attn_qkv.weight")[16:32], qkvz[1, :16])  # q of key head 1
    np.testing.assert_array_equal(model.tensor("blk.0.attn_qkv.weight")[64 + 32:], qkvz[1, 32:64])  # v of head 1
    np.testing.assert_array_equal(model.tensor("blk.0.attn_gate.weight")[:32], qkvz[0, 64:])  # z of key head 0


def float64_copy(hf):
    """The model in float64 (its delta rule still runs in float32 inside): the reference per layer,
    as transformers' float32 chunked delta rule drifts from it more than our scan does."""
    hf64 = copy.deepcopy(hf).double()
    hf64.config._experts_implementation = "eager"  # torch's grouped matmul has no float64
    return hf64


def test_qwen3next_logits_and_routing_match_transformers(qwen3next):
    path, hf = qwen3next
    model = GGUFModel(path)
    tokens = tokens_for(model, length=80)  # past transformers' 64-token chunk of the delta rule
    logits32, _ = transformers_run(hf, tokens)
    ref_logits, ref = transformers_run(float64_copy(hf), tokens)
    caps: dict[int, LayerCapture] = {}
    got = Runner(model).forward(tokens, capture=True, on_layer=lambda i, c: caps.__setitem__(i, c))
    assert rel_err(got, ref_logits) <= 1e-4 and rel_err(got, logits32) <= 1e-4
    B, T = tokens.shape
    assert sorted(caps) == [0, 1, 2, 3]
    for i, cap in caps.items():
        np.testing.assert_allclose(cap.mixed.reshape(B * T, -1), ref[i]["mixed"].reshape(B * T, -1), atol=1e-4)
        ours = np.sort(cap.experts.reshape(B * T, -1), axis=1)
        assert np.array_equal(ours, np.sort(ref[i]["experts"], axis=1)), f"layer {i}: different experts chosen"
        np.testing.assert_allclose(np.sort(cap.weights.reshape(B * T, -1), 1), np.sort(ref[i]["weights"], 1),
                                   atol=1e-4)  # renormalised over the chosen experts
        np.testing.assert_allclose(cap.weights.sum(-1), 1.0, atol=1e-6)
        np.testing.assert_allclose(cap.yr.reshape(B * T, -1), ref[i]["yr"], atol=1e-4 * np.abs(ref[i]["yr"]).max())
        yr64 = numpy_moe(model.layer(i), cap.mixed.reshape(B * T, -1), cap.experts.reshape(B * T, -1),
                         cap.weights.reshape(B * T, -1))
        np.testing.assert_allclose(cap.yr.reshape(B * T, -1), yr64, atol=1e-5 * np.abs(yr64).max())
        assert cap.hh.shape == (B, T, model.hp.d_shexp) and np.all((cap.shexp_gate > 0) & (cap.shexp_gate < 1))


def numpy_delta_rule(q, k, v, g, beta) -> np.ndarray:
    """float64 gated delta rule, one sequence, head and position at a time."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    B, T, H, dk = k.shape
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            S = np.zeros((dk, v.shape[-1]))
            for t in range(T):
                S = S * np.exp(g[b, t, h])
                S = S + np.outer(k[b, t, h], beta[b, t, h] * (v[b, t, h] - k[b, t, h] @ S))
                out[b, t, h] = q[b, t, h] @ S
    return out


def test_delta_rule_scan_matches_a_float64_loop():
    rng = np.random.default_rng(0)
    B, T, H, dk, dv = 2, 37, 3, 8, 5
    k = rng.standard_normal((B, T, H, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q, v = rng.standard_normal((B, T, H, dk)), rng.standard_normal((B, T, H, dv))
    g, beta = -rng.random((B, T, H)) * 2, rng.random((B, T, H))
    got = gated_delta_rule(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)))
    ref = numpy_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_unsupported_qwen3next_variants_are_refused(tmp_path):
    tokenizer = train_tiny_bpe(seed=6)
    hf = tiny_qwen3next(tokenizer.get_vocab_size(), seed=6, n_layer=2, norm_topk_prob=False)
    with pytest.raises(InputError, match="norm_topk_prob: False is not supported for qwen3next"):
        hf_to_gguf(hf, tokenizer, tmp_path / "x.gguf", matrix_type="f32")


@pytest.fixture(scope="module")
def healed_qwen3next(tmp_path_factory) -> tuple[Path, HealRun]:
    """A tiny Qwen3-Next healed end to end (256 wide, so every expert row is whole TQ2_0 blocks)."""
    root = tmp_path_factory.mktemp("qwen3next_world")
    tokenizer = train_tiny_bpe(seed=7)
    hf = tiny_qwen3next(tokenizer.get_vocab_size(), seed=7, d_model=256, d_expert=256, d_shexp=256)
    hf_to_gguf(hf, tokenizer, root / "ref.gguf", matrix_type="q8_0")
    run = HealRun(load_config(write_world(root, model=root / "ref.gguf", variants=RIDGE_VARIANT)), log=lambda m: None)
    run.heal()
    return root / "ref.gguf", run


def test_qwen3next_heals_with_the_ridge_and_the_assembled_gguf_loads(healed_qwen3next):
    source, run = healed_qwen3next
    healed = GGUFModel(run.result(run.assemble(run.cfg.variants[0])).path)
    assert healed.arch is ARCHITECTURES["qwen3next"] and healed.metadata("moeheal.variant") == "v1"
    assert healed.raw("blk.0.ffn_down_exps.weight").ggml_type.name == "TQ2_0"
    cv = [r for r in run.lake.read_table("ridge_cv").to_pylist() if r["variant"] == "v1"]
    assert {r["layer"] for r in cv} == {0, 1, 2, 3}  # the shared-expert ridge ran in linear and full layers
    metrics = [r for r in run.lake.read_table("layer_metrics").to_pylist() if r["variant"] == "v1"]
    assert {r["layer"] for r in metrics} == {0, 1, 2, 3} and all(np.isfinite(r["resid_ridge"]) for r in metrics)
    ref = GGUFModel(source)
    for name in ("blk.0.attn_qkv.weight", "blk.0.ssm_a", "blk.1.attn_q.weight", "blk.1.ffn_gate_inp.weight"):
        assert healed.raw(name).ggml_type == ref.raw(name).ggml_type  # attention and routers are kept
        np.testing.assert_array_equal(healed.tensor(name), ref.tensor(name))
    tokens = tokens_for(healed, batch=1, length=16)
    assert np.all(np.isfinite(Runner(healed).forward(tokens)))


def test_qwen3next_refuses_budgeting_its_attention(tmp_path):
    tokenizer = train_tiny_bpe(seed=7)
    hf = tiny_qwen3next(tokenizer.get_vocab_size(), seed=7, n_layer=2, d_model=256, d_expert=256, d_shexp=256)
    hf_to_gguf(hf, tokenizer, tmp_path / "ref.gguf", matrix_type="q8_0")
    variant = '[[variant]]\nname = "b"\nbudget_bpw = 3.8\nformats = ["tq2_0", "q2_k", "iq4_nl"]\nbudget_roles = "all"\n'
    config = load_config(write_world(tmp_path, model=tmp_path / "ref.gguf", variants=variant))
    with pytest.raises(InputError, match=r'\[\[variant\]\] b: budget_roles = "all" is not supported for the '
                                         r"qwen3next family"):
        HealRun(config, log=lambda m: None)


@pytest.mark.llamacpp
def test_llama_cpp_quantizes_and_runs_our_qwen3next_ggufs(qwen3next, healed_qwen3next, tmp_path):
    """llama-perplexity runs our converted F32 and Q8_0 Qwen3-Next (agreeing with our runner), the Q4_K_M
    llama-quantize makes of the Q8_0 one, and our healed file."""
    source, run = healed_qwen3next
    quantized = tmp_path / "q4_k_m.gguf"
    binary = Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-quantize"
    out = subprocess.run([str(binary), "--allow-requantize", str(source), str(quantized), "Q4_K_M"],
                         capture_output=True, text=True, errors="replace", timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
    text = eval_text(tmp_path, run.cfg.path.parent / "docs.jsonl", chunks=2)
    for gguf, tol in ((qwen3next[0], 0.005), (source, 0.05)):  # llama.cpp rounds activations to 8 bits for Q8_0
        theirs = llama_perplexity(gguf, text, chunks=2)
        ours = our_perplexity(GGUFModel(gguf), text.read_text(encoding="utf-8"), chunks=2)
        assert np.log(ours) == pytest.approx(np.log(theirs), abs=tol), gguf.name
    healed = run.result(run.assemble(run.cfg.variants[0])).path
    assert all(np.isfinite(llama_perplexity(gguf, text, chunks=2)) for gguf in (quantized, healed))


def test_cache_aware_routing_runs_with_512_experts_top_10(tmp_path):
    """MoCE's routing hook on Qwen3-Next's real routing width (512 experts, top-10): bonus 0 is the
    plain forward pass bit for bit, a bonus raises the hit rate over LRU on plain routing."""
    tokenizer = train_tiny_bpe(seed=8)
    hf = tiny_qwen3next(tokenizer.get_vocab_size(), seed=8, n_expert=512, k=10, d_expert=32)
    hf_to_gguf(hf, tokenizer, tmp_path / "wide.gguf", matrix_type="f32")
    model = GGUFModel(tmp_path / "wide.gguf")
    assert (model.hp.n_expert, model.hp.n_expert_used) == (512, 10)
    runner, tokens = Runner(model), tokens_for(model, batch=2, length=64)
    caps: dict[int, LayerCapture] = {}
    plain = runner.forward(tokens, capture=True, on_layer=lambda i, c: caps.__setitem__(i, c))
    cache = 64
    same = make_routing_hook(cache, 0.0, 10, model.hp.norm_topk_prob)
    np.testing.assert_array_equal(runner.forward(tokens, routing_hook=same), plain)
    hook = make_routing_hook(cache, 0.5, 10, model.hp.norm_topk_prob)
    started = time.perf_counter()
    moce = runner.forward(tokens, routing_hook=hook)
    seconds = time.perf_counter() - started
    assert np.all(np.isfinite(moce)) and rel_err(moce, plain) > 0
    for layer, (hits, misses) in hook.stats.items():
        plain_hits = sum(lru_hits(caps[layer].experts[b], cache).sum() for b in range(2))
        assert hits.sum() > plain_hits and np.all(hits + misses == 10), f"layer {layer}"
    print(f"512 experts top-10, 2 x 64 tokens, 4 layers: cache-aware forward {seconds:.2f} s")


def _copy_with_keys(src: GGUFModel, path: Path, drop: str | None = None, replace: tuple | None = None,
                    add: tuple | None = None) -> Path:
    """`src` rewritten with one key dropped, replaced or added (key, value, item type)."""
    kv = [(key, src.metadata(key), field.types[-1]) for key, field in src.metadata_fields().items()
          if not key.startswith("GGUF.") and key not in ("general.architecture", drop)]
    if replace is not None:
        kv = [replace if k == replace[0] else (k, v, t) for k, v, t in kv]
    kv += [add] if add is not None else []
    write_gguf(path, src.arch.name, kv, ((n, src.raw(n).data, src.raw(n).ggml_type) for n in src.tensor_names))
    return path


def test_damaged_qwen3next_keys_are_input_errors(qwen3next, tmp_path):
    src = GGUFModel(qwen3next[0])
    with pytest.raises(InputError, match="key qwen3next.ssm.group_count: missing"):
        GGUFModel(_copy_with_keys(src, tmp_path / "a.gguf", drop="qwen3next.ssm.group_count"))
    recurrent = ("qwen3next.attention.recurrent_layers", [True] * 4, GGUFValueType.BOOL)
    with pytest.raises(InputError, match="no full-attention layer"):
        GGUFModel(_copy_with_keys(src, tmp_path / "b.gguf", replace=recurrent))
    short = ("qwen3next.attention.recurrent_layers", [True, False], GGUFValueType.BOOL)
    with pytest.raises(InputError, match="key qwen3next.attention.recurrent_layers: need 4 booleans"):
        GGUFModel(_copy_with_keys(src, tmp_path / "s.gguf", replace=short))
    swapped = ("qwen3next.attention.recurrent_layers", [False, True, True, False], GGUFValueType.BOOL)
    with pytest.raises(InputError, match="tensor blk.0.attn_q.weight: missing"):  # layer 0 holds DeltaNet tensors
        GGUFModel(_copy_with_keys(src, tmp_path / "c.gguf", replace=swapped))
    mtp = ("qwen3next.nextn_predict_layers", 1, GGUFValueType.UINT32)  # llama.cpp's default conversion has one
    with pytest.raises(InputError, match="key qwen3next.nextn_predict_layers: 1 multi-token-prediction"):
        GGUFModel(_copy_with_keys(src, tmp_path / "e.gguf", add=mtp))
    inner = ("qwen3next.ssm.inner_size", 60, GGUFValueType.UINT32)
    with pytest.raises(InputError, match="key qwen3next.ssm.inner_size: 60, expected"):
        GGUFModel(_copy_with_keys(src, tmp_path / "d.gguf", replace=inner))
