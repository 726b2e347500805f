"""DeepSeek-V2/V3 (llama.cpp `deepseek2`): conversion, the runner against transformers'
DeepseekV3ForCausalLM (MLA with and without the q LoRA, dense leading layers, biased group-limited
sigmoid routing, the ungated shared expert), healing end to end, and llama.cpp on our files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from moeheal.pipeline.model.arch import ARCHITECTURES
from moeheal.pipeline.config import load_config
from moeheal.pipeline.sources.convert import hf_to_gguf
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.runner import Runner
from bench.inputs.ggufs import train_tiny_bpe
from bench.inputs.healworld import write_world
from tests.test_llamacpp import eval_text, llama_perplexity, our_perplexity
from tests.test_runner import check_against_transformers, tokens_for


def tiny_deepseek_v3(vocab_size: int, seed: int, n_layer: int = 3, d_model: int = 64, q_lora_rank: int | None = 32,
                     kv_lora_rank: int = 32, nope: int = 16, rope: int = 8, v_dim: int = 16, n_expert: int = 8,
                     k: int = 2, n_group: int = 4, topk_group: int = 2, d_expert: int = 32, n_dense: int = 1,
                     yarn: dict | None = None):
    """A seeded random DeepseekV3ForCausalLM, float32, eval mode, with random norms and a random
    correction bias (a zero bias would hide a selection that ignores it)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=96, moe_intermediate_size=d_expert,
        num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=n_expert, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=n_dense, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
        max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0} if yarn is None else
        {"rope_type": "yarn", "rope_theta": 10000.0, **yarn},
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.float().eval()


def convert(tmp: Path, seed: int, matrix_type: str = "f32", **dims) -> tuple[Path, object]:
    tokenizer = train_tiny_bpe(seed=seed)
    hf = tiny_deepseek_v3(tokenizer.get_vocab_size(), seed, **dims)
    path = tmp / f"tiny-deepseek2-{matrix_type}.gguf"
    hf_to_gguf(hf, tokenizer, path, matrix_type=matrix_type)
    return path, hf


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> tuple[Path, object]:
    """3 layers (the first dense), q LoRA, 8 experts in 4 groups (2 kept), top-2, F32."""
    return convert(tmp_path_factory.mktemp("deepseek2"), seed=11)


def test_the_file_holds_what_llama_cpp_writes(v3):
    model = GGUFModel(v3[0])
    hp = model.hp
    assert model.arch is ARCHITECTURES["deepseek2"] and model.moe_layers == (1, 2)
    assert (hp.n_dense_lead, hp.d_ff, hp.q_lora_rank, hp.kv_lora_rank, hp.head_dim, hp.rope_dim, hp.v_head_dim) == \
        (1, 96, 32, 32, 24, 8, 16)
    assert (hp.n_group, hp.n_group_used, hp.expert_weights_scale, hp.norm_topk_prob, hp.d_shexp) == \
        (4, 2, 2.5, True, 32)
    a = "deepseek2"
    assert [model.metadata(f"{a}.{k}") for k in ("attention.head_count_kv", "attention.key_length",
                                                  "attention.value_length", "expert_gating_func",
                                                  "expert_shared_count")] == [1, 32 + 8, 32, 2, 1]
    names = set(model.tensor_names)
    assert {"blk.0.ffn_gate.weight", "blk.1.exp_probs_b.bias", "blk.1.attn_k_b.weight"} <= names
    assert not any(".attn_kv_b." in n or n.startswith("blk.0.ffn_gate_inp") for n in names)
    assert model.shape("blk.1.attn_k_b.weight") == (4, 32, 16)  # (H, kv_lora, nope): ggml ne [nope, kv_lora, H]
    assert model.shape("blk.1.attn_v_b.weight") == (4, 16, 32)  # (H, v, kv_lora)


def test_split_kv_b_is_the_transposed_key_rows_and_the_value_rows(v3):
    path, hf = v3
    model = GGUFModel(path)
    kv_b = hf.model.layers[1].self_attn.kv_b_proj.weight.detach().numpy().reshape(4, 16 + 16, 32)  # (H, nope+v, r)
    np.testing.assert_array_equal(model.tensor("blk.1.attn_k_b.weight"), kv_b[:, :16].transpose(0, 2, 1))
    np.testing.assert_array_equal(model.tensor("blk.1.attn_v_b.weight"), kv_b[:, 16:])


def check_deepseek2(path: Path, hf) -> None:
    """`check_against_transformers`, and the shared expert ungated (gate 1) beside every MoE layer."""
    model = GGUFModel(path)
    tokens, caps, _ = check_against_transformers(model, hf)
    B, T = tokens.shape
    for cap in caps.values():
        assert cap.hh.shape == (B, T, model.hp.d_shexp) and np.all(cap.shexp_gate == 1.0)


def test_v3_logits_routing_and_routed_output_match_transformers(v3):
    check_deepseek2(*v3)


# DeepSeek-V3's own YaRN settings (factor 40 over a 4096-token pretraining context).
V3_YARN = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
           "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def v3_yarn(tmp_path_factory) -> tuple[Path, object]:
    """The V3 form with DeepSeek-V3's YaRN rope scaling, F32."""
    return convert(tmp_path_factory.mktemp("deepseek2_yarn"), seed=16, yarn=V3_YARN)


def test_yarn_rope_scaling_matches_transformers(v3_yarn):
    model = GGUFModel(v3_yarn[0])
    hp = model.hp
    assert (hp.rope_scaling_factor, hp.rope_orig_ctx, hp.yarn_log_mul) == pytest.approx((40.0, 4096, 1.0))
    assert model.metadata("deepseek2.rope.scaling.type") == "yarn"
    check_deepseek2(*v3_yarn)


def test_v2_lite_form_without_q_lora_matches_transformers(tmp_path):
    path, hf = convert(tmp_path, seed=12, q_lora_rank=None, n_layer=2, n_group=1, topk_group=1)
    model = GGUFModel(path)
    assert model.hp.q_lora_rank == 0 and "blk.0.attn_q.weight" in model.tensor_names
    check_deepseek2(path, hf)


def test_the_bias_and_the_groups_decide_the_selection(v3):
    """Against a float64 NumPy reference of DeepSeek-V3's selection: the group limit and the bias
    each change the chosen experts of some tokens, and the weights stay the unbiased scores."""
    model = GGUFModel(v3[0])
    arch, hp = model.arch, model.hp
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 64, 8)).astype(np.float32)
    bias = (0.3 * rng.normal(size=8)).astype(np.float32)

    def reference(bias: np.ndarray, n_group_used: int) -> tuple[np.ndarray, np.ndarray]:
        s = 1 / (1 + np.exp(-logits.astype(np.float64)))  # (B, T, E)
        b = (s + bias).reshape(2, 64, 4, 2)  # (B, T, G, 2)
        kept = np.argsort(-np.sort(b, -1)[..., -2:].sum(-1), -1, kind="stable")[..., :n_group_used]  # (B, T, Gu)
        mask = np.zeros((2, 64, 4), bool)
        np.put_along_axis(mask, kept, True, -1)
        experts = np.argsort(-np.where(mask[..., None], b, -np.inf).reshape(2, 64, 8), -1, kind="stable")[..., :2]
        experts = np.sort(experts, -1)  # (B, T, 2) by expert id
        w = np.take_along_axis(s, experts, -1)
        return experts, w / w.sum(-1, keepdims=True) * 2.5

    experts, weights = arch.route_layer({"exp_probs_b.bias": bias}, logits, hp)
    order = np.argsort(np.asarray(experts), -1)
    want_e, want_w = reference(bias, 2)
    assert np.array_equal(np.sort(np.asarray(experts), -1), want_e)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1), want_w, rtol=1e-5)
    assert not np.array_equal(want_e, reference(np.zeros(8, np.float32), 2)[0])  # the bias matters here
    assert not np.array_equal(want_e, reference(bias, 4)[0])  # and so does the group limit


# A variant with the shared-expert ridge: the ungated shared expert's down projection is refitted.
DEEPSEEK_VARIANTS = """
[[variant]]
name = "v1"
beta_gate_up = 0.5
beta_down = 0.5
ridge_rho = 6.0
round = "ls"
[[variant]]
name = "v2"
round = "gptq"
gptq_damp = 1.0
[[variant]]
name = "b"
budget_bpw = 3.0
formats = ["q2_k", "q3_k"]
"""


@pytest.fixture(scope="module")
def healed_deepseek2(tmp_path_factory) -> tuple[Path, HealRun]:
    """A tiny DeepSeek-V3 (first layer dense) healed end to end: 256 wide, so every routed row is
    whole TQ2_0 blocks; Q8_0 source; MoCE bonus 0 only (this family's routing is not MoCE's)."""
    root = tmp_path_factory.mktemp("deepseek2_world")
    source, _ = convert(root, seed=13, matrix_type="q8_0", d_model=256, d_expert=256, kv_lora_rank=64, nope=32,
                        rope=16, v_dim=32, q_lora_rank=64)
    run = HealRun(load_config(write_world(root, model=source, variants=DEEPSEEK_VARIANTS, moce_bonus=(0.0,))),
                  log=lambda m: None)
    run.heal()
    return source, run


def test_healing_skips_the_dense_layer_and_the_assembled_gguf_runs(healed_deepseek2):
    source, run = healed_deepseek2
    src = GGUFModel(source)
    for variant in run.cfg.variants:
        healed = GGUFModel(run.result(run.assemble(variant)).path)
        assert healed.arch is ARCHITECTURES["deepseek2"] and healed.metadata("moeheal.variant") == variant.name
        if not variant.budgeted:
            assert [healed.raw(f"blk.{i}.ffn_down_exps.weight").ggml_type.name for i in (1, 2)] == ["TQ2_0"] * 2
        for name in ("blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.1.attn_k_b.weight"):
            assert healed.raw(name).ggml_type == src.raw(name).ggml_type  # dense FFN and attention kept
            np.testing.assert_array_equal(healed.tensor(name), src.tensor(name))
        tokens = tokens_for(healed, batch=1, length=16)
        assert np.all(np.isfinite(Runner(healed).forward(tokens)))
    metrics = run.calibrated_table(run.cfg.healed_variants, "layer_metrics").to_pylist()
    assert sorted({r["layer"] for r in metrics}) == [1, 2]
    ridge = [r for r in metrics if r["variant"] == "v1" and r["split"] == "in_sample"]
    assert all(r["resid_ridge"] < r["resid_alpha"] for r in ridge)  # the ungated shared ridge helps in sample


def test_the_budget_recipe_and_the_expert_cache_cover_the_moe_layers(healed_deepseek2):
    """The budget's recipe names the MoE layers' routed tensors only; evaluation counts the expert
    cache at bonus 0 on the family's own routing, where cache-aware routing's hits are LRU's."""
    from moeheal.pipeline.publish.tables import read_parts

    _, run = healed_deepseek2
    budget = next(v for v in run.cfg.variants if v.budgeted)
    assert sorted({int(name.split(".")[1]) for name in run.recipe_formats(budget)}) == [1, 2]
    rows = read_parts(run.result(run.evaluate(budget)), "hitrate").to_pylist()
    assert rows and {r["moce_bonus"] for r in rows} == {0.0}
    assert all(r["hit_rate"] == r["hit_rate_lru"] <= r["hit_rate_belady"] for r in rows)


@pytest.mark.llamacpp
def test_llama_cpp_runs_our_deepseek2_ggufs(healed_deepseek2, v3, v3_yarn, tmp_path):
    """llama-perplexity runs our converted F32 (with and without YaRN) and Q8_0 files and agrees with
    our runner; llama-quantize
    reads the Q8_0 source and makes the budget variant's mix from our recipe and imatrix; llama-perplexity
    runs its Q4_K_M and every healed file."""
    source, run = healed_deepseek2
    text = eval_text(tmp_path, run.cfg.path.parent / "docs.jsonl", chunks=2)
    for gguf in (v3[0], v3_yarn[0], source):
        theirs = llama_perplexity(gguf, text, chunks=2)
        ours = our_perplexity(GGUFModel(gguf), text.read_text(encoding="utf-8"), chunks=2)
        assert np.log(ours) == pytest.approx(np.log(theirs), abs=0.05)  # llama.cpp rounds activations to 8 bits
    quantized = tmp_path / "q4_k_m.gguf"
    binary = Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-quantize"
    out = subprocess.run([str(binary), "--allow-requantize", str(source), str(quantized), "Q4_K_M"],
                         capture_output=True, text=True, errors="replace", timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
    budget = next(v for v in run.cfg.variants if v.budgeted)
    recipe = tmp_path / "b-llama.gguf"
    argv = run.llama_quantize_command(budget.name, run.write_imatrix(tmp_path / "imatrix.gguf"), recipe,
                                      binary=str(binary))
    out = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]  # llama-quantize takes our recipe and imatrix
    theirs, ours = GGUFModel(recipe), GGUFModel(run.result(run.assemble(budget)).path)
    assert {n: t for n, (t, _, _) in theirs.tensor_sizes().items() if "_exps." in n} == \
        {n: t for n, (t, _, _) in ours.tensor_sizes().items() if "_exps." in n}  # the same mix
    healed = [run.result(run.assemble(v)).path for v in run.cfg.variants]
    assert all(np.isfinite(llama_perplexity(gguf, text, chunks=2)) for gguf in (quantized, *healed))


# ---- what the family refuses ------------------------------------------------------------------

def test_a_file_with_linear_rope_scaling_is_refused(tmp_path):
    from gguf import GGUFValueType

    tokenizer = train_tiny_bpe(seed=14)
    hf = tiny_deepseek_v3(tokenizer.get_vocab_size(), 14, n_layer=2)
    path = tmp_path / "linear.gguf"
    hf_to_gguf(hf, tokenizer, path, matrix_type="f32",
               extra_kv=[("deepseek2.rope.scaling.type", "linear", GGUFValueType.STRING)])
    with pytest.raises(InputError, match=r"linear.gguf: key deepseek2.rope.scaling.type: 'linear' rope scaling is not"):
        GGUFModel(path)


@pytest.mark.parametrize("drop, why", [
    ("deepseek2.expert_gating_func", r"key deepseek2.expert_gating_func: missing; only sigmoid gating"),
    ("deepseek2.attention.key_length_mla", r"key deepseek2.attention.key_length_mla: missing"),
    ("deepseek2.rope.scaling.yarn_log_multiplier", r"key deepseek2.rope.scaling.yarn_log_multiplier: missing"),
])
def test_a_file_without_sigmoid_gating_the_mla_sizes_or_yarn_mscale_is_refused(tmp_path, monkeypatch, drop, why):
    """Without expert_gating_func llama.cpp routes by softmax; without the MLA sizes it cannot
    decompress the heads; without YaRN's log multiplier its attention scale is not transformers':
    each is an InputError naming the file and the key, not a guess."""
    from moeheal.pipeline.sources import convert as C

    written = C.metadata_kv
    monkeypatch.setattr(C, "metadata_kv", lambda record: [kv for kv in written(record) if kv[0] != drop])
    tokenizer = train_tiny_bpe(seed=15)
    path = tmp_path / "dropped.gguf"
    hf = tiny_deepseek_v3(tokenizer.get_vocab_size(), 15, n_layer=2, yarn=V3_YARN)
    hf_to_gguf(hf, tokenizer, path, matrix_type="f32")
    with pytest.raises(InputError, match="dropped.gguf: " + why):
        GGUFModel(path)


@pytest.mark.parametrize("change, why", [
    ({"rope_interleave": False}, "rope_interleave=False is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
     "rope scaling 'linear' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 0.707,
                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
     "only mscale = mscale_all_dim"),
])
def test_the_converter_refuses_what_llama_cpp_would_compute_differently(v3, tmp_path, change, why):
    _, hf = v3
    saved = {key: getattr(hf.config, key) for key in change}
    try:
        for key, value in change.items():
            setattr(hf.config, key, value)
        with pytest.raises(ValueError, match=why):
            hf_to_gguf(hf, train_tiny_bpe(seed=11), tmp_path / "x.gguf", matrix_type="f32")
    finally:
        for key, value in saved.items():
            setattr(hf.config, key, value)


@pytest.mark.parametrize("moce, variants, why", [
    ((0.0, 0.5), DEEPSEEK_VARIANTS, r"\[moce\] bonus: cache-aware routing is not supported for the deepseek2 family"),
    ((0.0,), '[[variant]]\nname = "b"\nbudget_bpw = 3.0\nformats = ["q2_k", "q3_k"]\nbudget_roles = "all"\n',
     r'budget_roles = "all" is not supported for the deepseek2 family'),
])
def test_moce_bonuses_and_whole_file_budgets_are_refused(v3, tmp_path, moce, variants, why):
    config = write_world(tmp_path, model=v3[0], variants=variants, moce_bonus=moce)
    with pytest.raises(InputError, match=why):
        HealRun(load_config(config), log=lambda m: None)


# ---- synth ------------------------------------------------------------------------------------

def test_synth_deepseek_v3_has_the_real_shapes(tmp_path):
    from moeheal.pipeline.sources.synth import write_synth

    model = GGUFModel(write_synth(tmp_path / "v3.gguf", "deepseek-v3", n_layer=4, zeros=True).paths[0])
    hp = model.hp
    assert model.arch is ARCHITECTURES["deepseek2"] and model.moe_layers == (3,)
    assert (hp.d_model, hp.n_head, hp.q_lora_rank, hp.kv_lora_rank, hp.head_dim, hp.rope_dim, hp.v_head_dim) == \
        (7168, 128, 1536, 512, 128 + 64, 64, 128)
    assert (hp.n_expert, hp.n_expert_used, hp.n_group, hp.n_group_used, hp.d_expert, hp.d_shexp, hp.d_ff) == \
        (256, 8, 8, 4, 2048, 2048, 18432)
    assert (hp.vocab_size, hp.expert_weights_scale, hp.norm_topk_prob, hp.n_dense_lead) == (129280, 2.5, True, 3)
    assert (hp.rope_scaling_factor, hp.rope_orig_ctx, hp.yarn_log_mul) == pytest.approx((40.0, 4096, 1.0))
    assert model.shape("blk.3.attn_k_b.weight") == (128, 512, 128)


def test_a_tiny_synth_runs_a_forward_pass(tmp_path):
    """Two layers (one dense, one MoE with 4 experts in one group), a 512-token vocabulary."""
    from moeheal.pipeline.sources.synth import write_synth

    model = GGUFModel(write_synth(tmp_path / "v3.gguf", "deepseek-v3", n_layer=2, vocab_size=512, n_expert=4,
                                  matrix_type="f16", zeros=True).paths[0])
    assert model.moe_layers == (1,) and (model.hp.n_group, model.hp.n_expert_used) == (1, 4)
    caps = {}
    logits = Runner(model).forward(tokens_for(model, batch=1, length=8), capture=True,
                                   on_layer=lambda i, c: caps.__setitem__(i, c))
    assert logits.shape == (1, 8, 512) and np.all(np.isfinite(logits)) and sorted(caps) == [1]
