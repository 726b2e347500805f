"""Mixtral (llama.cpp `llama` with experts): conversion as llama.cpp's LlamaModel writes it, the
runner against transformers' MixtralForCausalLM, healing, synth, and llama.cpp running the files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from tokenizers import Tokenizer, trainers
from transformers import MixtralConfig, MixtralForCausalLM

from moeheal.kernels.decode import dequantize
from moeheal.kernels.encode import quantize
from moeheal.kernels.importance import gate_up_importance
from moeheal.pipeline.model import layers as M
from moeheal.pipeline.publish import tables
from moeheal.pipeline.model.arch import ARCHITECTURES
from moeheal.pipeline.config import load_config
from moeheal.pipeline.sources.convert import hf_to_gguf, permute_rope_rows
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import copy_gguf, write_gguf
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.data.dumps import open_dump
from moeheal.pipeline.sources.synth import write_synth
from moeheal.pipeline.gguf.tokenizer import decode, encode
from bench.inputs.ggufs import sample_texts
from bench.inputs.healworld import write_world
from tests.test_llamacpp import eval_text, llama_perplexity, our_perplexity
from tests.test_runner import check_against_transformers, tokens_for

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Mixtral's tokenizer; <0x00>..<0xFF> follow
# A family without a shared expert heals by importance, GPTQ and alpha (no ridge knob); a budget over
# every tensor measures attention too, through the family's RoPE.
MIXTRAL_VARIANTS = """
[[variant]]
name = "v1"
round = "gptq"
gptq_damp = 1.0
[[variant]]
name = "b_all"
budget_bpw = 3.8
formats = ["tq2_0", "q2_k", "q3_k", "iq4_nl"]
budget_roles = "all"
"""


def train_tiny_spm(seed: int, vocab_size: int = 600) -> Tokenizer:
    """Mixtral's tokenizer.json shape, small: BPE with byte fallback, spaces as "▁" with one prepended,
    trained on words cut at "▁" and then used without a pre-tokenizer (as SentencePiece runs)."""
    escape = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, escape]}
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": {}, "merges": []}
    tok = Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": True},
        "post_processor": None, "decoder": decoder, "model": model}))
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPM_SPECIALS + byte_pieces, limit_alphabet=120,
                                  show_progress=False)
    tok.train_from_iterator(sample_texts(400, seed), trainer=trainer)
    tok.pre_tokenizer = None
    return tok


def tiny_mixtral(vocab_size: int, seed: int, n_layer: int = 2, d_model: int = 64, n_expert: int = 8, k: int = 2,
                 d_expert: int = 32, **config):
    """A seeded random transformers MixtralForCausalLM, float32, eval mode, norms randomised."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_expert, num_hidden_layers=n_layer,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=n_expert, num_experts_per_tok=k,
                    max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2)
    model = MixtralForCausalLM(MixtralConfig(**{**settings, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.float().eval()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> tuple[Path, object, Tokenizer]:
    """A random 2-layer Mixtral (hidden 64, 4 heads of 16, 2 KV heads, 8 experts top-2), F32 GGUF."""
    tokenizer = train_tiny_spm(seed=6)
    hf = tiny_mixtral(tokenizer.get_vocab_size(), seed=6)
    path = tmp_path_factory.mktemp("mixtral") / "tiny-mixtral-f32.gguf"
    hf_to_gguf(hf, tokenizer, path, matrix_type="f32")
    return path, hf, tokenizer


# ---- the file -----------------------------------------------------------------


def test_mixtral_is_written_as_llama_with_experts(mixtral):
    path, hf, _ = mixtral
    model = GGUFModel(path)
    assert model.arch is ARCHITECTURES["llama"] and not model.has_shared_expert
    hp = model.hp
    assert (hp.n_layer, hp.d_model, hp.n_head, hp.n_head_kv, hp.head_dim) == (2, 64, 4, 2, 16)
    assert (hp.n_expert, hp.n_expert_used, hp.d_expert, hp.d_shexp, hp.norm_topk_prob) == (8, 2, 32, 0, True)
    assert (hp.rope_theta, hp.rms_eps) == (1e6, pytest.approx(1e-5))
    # LlamaModel's keys: experts sized by feed_forward_length, no expert_feed_forward_length, no key_length
    assert model.metadata("llama.feed_forward_length") == 32
    assert model.metadata("llama.expert_feed_forward_length") is None
    assert model.metadata("llama.vocab_size") == hp.vocab_size and model.metadata("llama.rope.dimension_count") == 16
    assert model.metadata("llama.attention.key_length") is None
    assert sorted(n for n in model.tensor_names if n.startswith("blk.0.")) == sorted(
        f"blk.0.{t}" for t in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                               "attn_output.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
                               "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
    # the SentencePiece vocabulary, as llama.cpp writes Mixtral's
    assert (model.metadata("tokenizer.ggml.model"), model.metadata("tokenizer.ggml.pre")) == ("llama", "default")
    assert model.metadata("tokenizer.ggml.tokens")[:4] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert model.metadata("tokenizer.ggml.token_type")[:4] == [2, 3, 3, 6]
    assert (model.metadata("tokenizer.ggml.bos_token_id"), model.metadata("tokenizer.ggml.eos_token_id")) == (1, 2)


def test_q_and_k_rows_are_permuted_within_each_head_and_nothing_else(mixtral):
    """Row 2i of a head is transformers' row i, row 2i+1 its row i + hd/2 (llama.cpp's LlamaModel.permute)."""
    path, hf, _ = mixtral
    model = GGUFModel(path)
    hd = model.hp.head_dim
    layer = hf.model.layers[1].self_attn
    for name, proj, heads in (("attn_q", layer.q_proj, 4), ("attn_k", layer.k_proj, 2)):
        ref = proj.weight.detach().numpy()  # (heads * hd, d)
        got = model.tensor(f"blk.1.{name}.weight")
        for h in range(heads):
            np.testing.assert_array_equal(got[h * hd:(h + 1) * hd:2], ref[h * hd:h * hd + hd // 2])
            np.testing.assert_array_equal(got[h * hd + 1:(h + 1) * hd:2], ref[h * hd + hd // 2:(h + 1) * hd])
        np.testing.assert_array_equal(permute_rope_rows(ref, heads), got)
    np.testing.assert_array_equal(model.tensor("blk.1.attn_v.weight"), layer.v_proj.weight.detach().numpy())


def test_adjacent_pair_rope_on_permuted_rows_is_rotate_half_on_the_originals():
    """float64 NumPy rotate_half (transformers') on x, against our adjacent-pair RoPE on permuted x."""
    rng = np.random.default_rng(0)
    B, T, H, hd = 2, 7, 3, 8
    x = rng.standard_normal((B, T, H, hd))  # (B, T, H, hd)
    inv_freq = 1.0 / (1e4 ** (np.arange(0, hd, 2) / hd))  # (hd/2,)
    angles = np.arange(T)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = np.concatenate([np.cos(angles)] * 2, -1), np.concatenate([np.sin(angles)] * 2, -1)  # (T, hd)
    rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)  # (B, T, H, hd)
    ref = x * cos[None, :, None] + rotated * sin[None, :, None]  # (B, T, H, hd)
    perm = permute_rope_rows(np.arange(H * hd), H).reshape(H, hd) % hd  # each head's dimension order
    c, s = M.rope_tables(T, hd, 1e4)
    got = np.asarray(M.apply_rope_pairs(jnp.asarray(x[..., perm[0]], jnp.float32), c, s))  # (B, T, H, hd)
    np.testing.assert_allclose(got, ref[..., perm[0]], atol=1e-5)
    neox = np.asarray(M.apply_rope(jnp.asarray(x[..., perm[0]], jnp.float32), c, s))
    assert np.abs(neox - ref[..., perm[0]]).max() > 1e-2  # the default rotation would be wrong here


def test_logits_routing_and_expert_output_match_transformers(mixtral):
    path, hf, _ = mixtral
    tokens, caps, ref = check_against_transformers(GGUFModel(path), hf)
    B, T = tokens.shape
    assert sorted(caps) == [0, 1]
    for i, cap in caps.items():
        r = ref[i]
        np.testing.assert_allclose(cap.mixed.reshape(B * T, -1), r["mixed"].reshape(B * T, -1), atol=1e-4)
        np.testing.assert_allclose(cap.router_logits.reshape(B * T, -1), r["router_logits"], atol=1e-4)
        np.testing.assert_allclose(cap.weights.reshape(B * T, -1).sum(1), 1.0, atol=1e-6)  # renormalised over two
        assert cap.hh.shape == (B, T, 0) and np.all(cap.shexp_gate == 1.0)


def test_the_gguf_tokenizer_gives_the_ids_of_the_exported_one(mixtral):
    path, _, tokenizer = mixtral
    ours = GGUFModel(path).tokenizer()
    for text in sample_texts(40, seed=99) + ["  two  spaces\n\nand 東京 🙂 ∑ inside"]:
        ids = encode(ours, text)
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids, text
        assert decode(ours, ids) == text
    special = "text <s> and </s> more"  # specials match whole; the text after one gets its own "▁"
    assert encode(ours, special) == tokenizer.encode(special, add_special_tokens=False).ids
    assert encode(ours, special).count(1) == 1


# ---- what is refused ----------------------------------------------------------


def test_a_dense_llama_file_is_refused_for_its_missing_expert_count(mixtral, tmp_path):
    """A `llama` GGUF with dense FFNs (Llama 2/3) is not a MoE: refused at open, naming the key."""
    src = GGUFModel(mixtral[0])
    kv = [(key, src.metadata(key), field.types[-1]) for key, field in src.metadata_fields().items()
          if not key.startswith("GGUF.") and key not in ("general.architecture", "llama.expert_count",
                                                         "llama.expert_used_count")]
    rng = np.random.default_rng(0)
    d, f = src.hp.d_model, src.hp.d_expert

    def tensors():
        for name in src.tensor_names:
            if "_exps" in name or "ffn_gate_inp" in name:
                continue
            yield name, src.tensor(name), src.raw(name).ggml_type
        for i in range(src.hp.n_layer):
            for short, shape in (("ffn_gate", (f, d)), ("ffn_up", (f, d)), ("ffn_down", (d, f))):
                yield f"blk.{i}.{short}.weight", rng.standard_normal(shape).astype(np.float32), \
                    src.raw("blk.0.attn_q.weight").ggml_type

    path = tmp_path / "dense-llama.gguf"
    write_gguf(path, "llama", kv, tensors())
    with pytest.raises(InputError, match=r"^dense-llama\.gguf: key llama\.expert_count: missing$"):
        GGUFModel(path)


def test_an_expert_width_other_than_feed_forward_length_is_refused(mixtral, tmp_path):
    path = tmp_path / "width.gguf"
    copy_gguf(GGUFModel(mixtral[0]), path, extra_kv=[("llama.feed_forward_length", 96, GGUFValueType.UINT32)])
    with pytest.raises(InputError, match=r"^width\.gguf: key llama\.feed_forward_length: 96, but the tensors say 32$"):
        GGUFModel(path)


def test_a_file_that_turns_off_renormalisation_is_refused(mixtral, tmp_path):
    """llama.cpp's llama graph renormalises whatever the key says: our runner must not differ from it."""
    path = tmp_path / "norm.gguf"
    copy_gguf(GGUFModel(mixtral[0]), path, extra_kv=[("llama.expert_weights_norm", False, GGUFValueType.BOOL)])
    with pytest.raises(InputError, match=r"^norm\.gguf: key llama\.expert_weights_norm: False, but llama\.cpp's "
                                         r"llama graph always renormalises the top-k weights$"):
        GGUFModel(path)
    copy_gguf(GGUFModel(mixtral[0]), path, extra_kv=[("llama.expert_weights_norm", True, GGUFValueType.BOOL)])
    assert GGUFModel(path).hp.norm_topk_prob


@pytest.mark.parametrize("option, message", [
    ({"sliding_window": 16}, r"config sliding_window: 16 is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     r"config rope_parameters\.rope_type: 'linear' is not supported"),
])
def test_mixtral_options_we_do_not_run_are_refused_at_conversion(option, message, tmp_path):
    tokenizer = train_tiny_spm(seed=1, vocab_size=400)
    hf = tiny_mixtral(tokenizer.get_vocab_size(), seed=1, n_layer=1, **option)
    with pytest.raises(InputError, match=message):
        hf_to_gguf(hf, tokenizer, tmp_path / "refused.gguf", matrix_type="f32")
    assert not (tmp_path / "refused.gguf").exists()


# ---- healing and llama.cpp ------------------------------------------------------


@pytest.fixture(scope="module")
def healed_mixtral(tmp_path_factory) -> tuple[Path, HealRun]:
    """A tiny Mixtral healed end to end (256 wide, heads of 64, so every row is whole TQ2_0 blocks)."""
    root = tmp_path_factory.mktemp("mixtral_world")
    tokenizer = train_tiny_spm(seed=7)
    hf = tiny_mixtral(tokenizer.get_vocab_size(), seed=7, d_model=256, n_expert=8, k=2, d_expert=256)
    hf_to_gguf(hf, tokenizer, root / "ref.gguf", matrix_type="q8_0")
    hf_to_gguf(hf, tokenizer, root / "ref-f32.gguf", matrix_type="f32")  # for llama.cpp's exact comparison
    run = HealRun(load_config(write_world(root, model=root / "ref.gguf", variants=MIXTRAL_VARIANTS)),
                  log=lambda m: None)
    run.heal()
    return root / "ref.gguf", run


def test_mixtral_heals_by_alpha_and_gptq_without_a_ridge(healed_mixtral):
    _, run = healed_mixtral
    variant = run.cfg.variants[0]
    metrics = run.calibrated_table([variant], "layer_metrics").to_pylist()
    assert run.calibrated_table([variant], "ridge_cv").num_rows == 0  # no shared expert, no ridge
    assert {m["layer"] for m in metrics} == {0, 1}
    for m in metrics:
        assert m["resid_ridge"] == m["resid_alpha"] and m["alpha"] != 1.0
        if m["split"] == "in_sample":  # alpha is the least-squares scale on these rows: it cannot do worse
            assert m["resid_alpha"] <= m["resid_alpha1"]
    healed = GGUFModel(run.result(run.assemble(variant)).path)
    assert healed.arch is ARCHITECTURES["llama"] and healed.metadata("moeheal.variant") == "v1"
    assert healed.raw("blk.0.ffn_down_exps.weight").ggml_type.name == "TQ2_0"
    np.testing.assert_array_equal(healed.tensor("blk.0.attn_q.weight"), GGUFModel(healed_mixtral[0]).tensor(
        "blk.0.attn_q.weight"))  # attention is copied, still in llama.cpp's row order
    tokens = tokens_for(healed, batch=1, length=16)
    assert np.all(np.isfinite(Runner(healed).forward(tokens)))


@pytest.mark.llamacpp
def test_llama_cpp_agrees_on_our_mixtral_and_runs_its_quantized_and_healed_files(healed_mixtral, tmp_path):
    """llama-perplexity on our converted Mixtral agrees with our runner (F32 and Q8_0 files);
    llama-quantize reads it, and llama.cpp runs its Q4_K_M and our healed file."""
    source, run = healed_mixtral
    text = eval_text(tmp_path, run.cfg.path.parent / "docs.jsonl", chunks=2)
    # Q8_0: llama.cpp rounds activations to 8 bits for its dot products (the OLMoE test's 0.05 nats).
    # F32: no such rounding, so 0.005 nats (measured 0.0007); our runner with NEOX RoPE on these
    # permuted rows is 0.096 nats off.
    for gguf, tolerance in ((source, 0.05), (source.with_name("ref-f32.gguf"), 0.005)):
        theirs = llama_perplexity(gguf, text, chunks=2)
        ours = our_perplexity(GGUFModel(gguf), text.read_text(encoding="utf-8"), chunks=2)
        assert np.log(ours) == pytest.approx(np.log(theirs), abs=tolerance), gguf.name
    quantized = tmp_path / "q4_k_m.gguf"
    binary = Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-quantize"
    out = subprocess.run([str(binary), "--allow-requantize", str(source), str(quantized), "Q4_K_M"],
                         capture_output=True, text=True, errors="replace", timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
    healed = run.result(run.assemble(run.cfg.variants[0])).path
    assert all(np.isfinite(llama_perplexity(gguf, text, chunks=2)) for gguf in (quantized, healed))


def numpy_attention(params: dict, x: np.ndarray, hp) -> np.ndarray:
    """float64 causal attention of one sequence x (T, d) as llama.cpp's llama graph runs it on the
    file's (permuted) q/k rows: dimensions 2i and 2i+1 of a head rotate together."""
    T, H, Hkv, hd = x.shape[0], hp.n_head, hp.n_head_kv, hp.head_dim
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    q = (x @ w["attn_q.weight"].T).reshape(T, H, hd)  # (T, H, hd)
    k = (x @ w["attn_k.weight"].T).reshape(T, Hkv, hd)  # (T, Hkv, hd)
    v = (x @ w["attn_v.weight"].T).reshape(T, Hkv, hd)  # (T, Hkv, hd)
    angle = np.arange(T)[:, None, None] * hp.rope_theta ** (-np.arange(0, hd, 2) / hd)  # (T, 1, hd/2)

    def rope(z: np.ndarray) -> np.ndarray:
        out = np.empty_like(z)  # (T, heads, hd)
        out[..., 0::2] = z[..., 0::2] * np.cos(angle) - z[..., 1::2] * np.sin(angle)
        out[..., 1::2] = z[..., 1::2] * np.cos(angle) + z[..., 0::2] * np.sin(angle)
        return out

    q, k = rope(q), rope(k)
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)  # (T, H, hd): head h reads h // G
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)  # (H, T, T)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # (H, T, T)
    heads = np.einsum("hts,shd->thd", probs, v).reshape(T, H * hd)  # (T, H*hd)
    return heads @ w["attn_output.weight"].T  # (T, d)


def test_a_budget_over_every_tensor_measures_attention_through_the_familys_rope(healed_mixtral):
    """budget_roles = "all" runs for Mixtral: one attention row of the sensitivity table recomputed in
    float64 NumPy with adjacent-pair RoPE (the quantized attn_q with the importance of its calibration
    inputs, the change of the attention output over the unseen sequences, over the layer's ||yr||^2),
    and the assembled file carries the allocation's attention formats and runs."""
    _, run = healed_mixtral
    b_all = next(v for v in run.cfg.variants if v.name == "b_all")
    hp = run.source.hp
    cal, unseen = open_dump(run.result(run.dump("calibration")).path), open_dump(run.result(run.dump("unseen")).path)
    params = {k: v for k, v in run.source.layer(1).items() if k.startswith("attn_") and k != "attn_norm.weight"}
    importance = gate_up_importance(np.mean(np.square(cal["1"]["attn_in"][:], dtype=np.float64), axis=0),
                                    b_all.beta_gate_up)
    w = params["attn_q.weight"]
    w_q = dequantize(quantize(w, "q2_k", importance), "q2_k", w.shape)
    x = unseen["1"]["attn_in"][:].astype(np.float64)  # (N, d)
    starts = list(unseen.attrs["seq_starts"]) + [x.shape[0]]
    change = sum(float(np.sum((numpy_attention({**params, "attn_q.weight": w_q}, x[s:e], hp)
                               - numpy_attention(params, x[s:e], hp)) ** 2)) for s, e in zip(starts, starts[1:]))
    expected = change / float(np.sum(np.square(unseen["1"]["yr"][:], dtype=np.float64)))
    key = tables.measurement_key([run.result(unit) for unit in run.sensitivities(b_all).values()])
    row = next(r for r in run.lake.read_table("sensitivity").to_pylist()
               if r["sensitivity"] == key and (r["layer"], r["role"], r["format"]) == (1, "attn_q", "q2_k"))
    assert row["rel_err"] == pytest.approx(expected, rel=1e-5)  # NEOX RoPE here would be 3e-3 off
    healed = GGUFModel(run.result(run.assemble(b_all)).path)
    chosen = {r["role"]: r["format"] for r in tables.compute(run, "recipe").to_pylist()
              if r["variant"] == "b_all" and r["layer"] == 1 and r["chosen_by"] == "allocation"}
    assert {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_down_exps"} <= set(chosen)
    assert healed.raw("blk.1.attn_q.weight").ggml_type.name == chosen["attn_q"].upper()
    assert np.all(np.isfinite(Runner(healed).forward(tokens_for(healed, batch=1, length=16))))


# ---- synth ------------------------------------------------------------------------

# Mixtral-8x7B's published config, written out independently of synth.LIKE.
MIXTRAL_8X7B = dict(n_layer=32, d_model=4096, n_head=32, n_head_kv=8, head_dim=128, n_expert=8, n_expert_used=2,
                    d_expert=14336, d_shexp=0, rope_theta=1e6, rms_eps=1e-5, vocab_size=32000, norm_topk_prob=True,
                    context_length=32768)


def test_synth_mixtral_has_the_real_shapes_keys_and_a_sentencepiece_vocabulary(tmp_path):
    model = GGUFModel(write_synth(tmp_path / "mixtral.gguf", "mixtral-8x7b", n_layer=1, zeros=True).paths[0])
    assert model.arch is ARCHITECTURES["llama"]
    assert {key: getattr(model.hp, key) for key in MIXTRAL_8X7B} == pytest.approx({**MIXTRAL_8X7B, "n_layer": 1})
    assert model.shape("blk.0.ffn_gate_exps.weight") == (8, 14336, 4096)
    assert model.shape("blk.0.attn_k.weight") == (1024, 4096)
    assert model.shape("blk.0.attn_output.weight") == (4096, 4096)
    assert not any("norm" in n and "attn_" in n and n != "blk.0.attn_norm.weight" for n in model.tensor_names)
    assert (model.metadata("llama.feed_forward_length"), model.metadata("llama.vocab_size"),
            model.metadata("llama.rope.dimension_count")) == (14336, 32000, 128)
    assert model.metadata("llama.expert_feed_forward_length") is None
    assert model.metadata("llama.expert_weights_norm") is None and model.metadata("llama.attention.key_length") is None
    tokens = model.metadata("tokenizer.ggml.tokens")
    assert model.metadata("tokenizer.ggml.model") == "llama" and len(tokens) == 32000
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[258] == "<0xFF>"
    assert (model.metadata("tokenizer.ggml.bos_token_id"), model.metadata("tokenizer.ggml.eos_token_id")) == (1, 2)
    tok = model.tokenizer()
    text = "The experts route every token. 東京 🙂"
    ids = encode(tok, text)
    assert decode(tok, ids) == text and len(ids) < len(text.encode())  # pieces merge; the rest falls back to bytes


@pytest.fixture(scope="module")
def mixtral_synth(tmp_path_factory) -> Path:
    """1 layer of mixtral-8x7b with 2 experts and 512 pieces (q8_0, about 400 MB)."""
    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return write_synth(out, "mixtral-8x7b", n_layer=1, vocab_size=512, n_expert=2).paths[0]


def test_a_tiny_mixtral_synth_runs_in_our_runner(mixtral_synth):
    model = GGUFModel(mixtral_synth)
    assert (model.hp.n_expert, model.hp.n_expert_used, model.hp.vocab_size, model.hp.d_expert) == (2, 2, 512, 14336)
    logits = Runner(model).forward(tokens_for(model, batch=1, length=8))
    assert logits.shape == (1, 8, 512) and np.all(np.isfinite(logits))


@pytest.mark.llamacpp
def test_llama_cpp_runs_a_tiny_mixtral_synth(mixtral_synth, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the model routes every token to two experts."] * 40))
    binary = Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-perplexity"
    out = subprocess.run([str(binary), "-m", str(mixtral_synth), "-f", str(text), "-c", "64", "--chunks", "1",
                          "-t", "2"], capture_output=True, text=True, errors="replace", timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
