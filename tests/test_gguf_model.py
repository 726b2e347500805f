"""GGUFModel validation and reading, write_gguf / copy_gguf round trips, checked against gguf-py."""

from __future__ import annotations

import hashlib

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf import model as gguf_model
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.gguf.writer import copy_gguf, write_gguf
from bench.inputs.ggufs import garbage_file, truncated_copy

Q8_0 = GGMLQuantizationType.Q8_0


def _all_tensors_except(model: GGUFModel, skip: str):
    for name in model.tensor_names:
        if name != skip:
            raw = model.raw(name)
            yield name, raw.data, raw.ggml_type


def _all_kv(model: GGUFModel):
    return [(key, model.metadata(key), None) for key in model.metadata_fields()
            if not key.startswith("GGUF.") and key != "general.architecture"]


def test_truncated_file_names_file_and_tensor(tiny_qwen2moe, tmp_path):
    bad = truncated_copy(tiny_qwen2moe, tmp_path / "cut.gguf", drop_bytes=1000)
    with pytest.raises(InputError, match=r"cut\.gguf: tensor .*: truncated"):
        GGUFModel(bad)


def test_garbage_file_is_input_error(tmp_path):
    with pytest.raises(InputError, match=r"junk\.gguf: not a readable GGUF"):
        GGUFModel(garbage_file(tmp_path / "junk.gguf"))


def test_missing_file_is_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        GGUFModel(tmp_path / "absent.gguf")


def test_unsupported_arch(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, "falcon", [("falcon.block_count", 1, None)],
               [("token_embd.weight", np.zeros((4, 32), np.float32), GGMLQuantizationType.F32)])
    with pytest.raises(InputError, match=r"falcon\.gguf: general\.architecture: unsupported architecture 'falcon'"):
        GGUFModel(path)


def test_missing_required_tensor(tiny_qwen3moe, tmp_path):
    src = GGUFModel(tiny_qwen3moe)
    path = tmp_path / "no-router.gguf"
    write_gguf(path, src.arch.name, _all_kv(src), _all_tensors_except(src, "blk.1.ffn_gate_inp.weight"))
    with pytest.raises(InputError, match=r"no-router\.gguf: tensor blk\.1\.ffn_gate_inp\.weight: missing"):
        GGUFModel(path)


def test_tensor_type_gguf_py_cannot_dequantize(tiny_qwen3moe, tmp_path):
    src = GGUFModel(tiny_qwen3moe)
    path = tmp_path / "int-norm.gguf"
    as_i32 = np.arange(64, dtype=np.int32).view(np.uint8)  # (256,) bytes of 64 int32 values
    copy_gguf(src, path, replace={"blk.0.attn_norm.weight": (as_i32, GGMLQuantizationType.I32)})
    with pytest.raises(InputError, match=r"int-norm\.gguf: tensor blk\.0\.attn_norm\.weight: type I32"):
        GGUFModel(path)


def test_hparams_match_the_exported_config(tiny_qwen2moe, tiny_qwen3moe):
    q2, q3 = GGUFModel(tiny_qwen2moe), GGUFModel(tiny_qwen3moe)
    assert (q2.arch.name, q3.arch.name) == ("qwen2moe", "qwen3moe")
    for hp in (q2.hp, q3.hp):
        assert (hp.n_layer, hp.d_model, hp.n_head, hp.n_head_kv, hp.head_dim) == (2, 64, 4, 2, 16)
        assert (hp.n_expert, hp.n_expert_used, hp.d_expert, hp.rope_theta) == (8, 2, 32, 1e6)
        assert hp.vocab_size == len(q2.metadata("tokenizer.ggml.tokens"))
    assert (q2.hp.d_shexp, q3.hp.d_shexp) == (64, 0)
    assert (q2.hp.norm_topk_prob, q3.hp.norm_topk_prob) == (False, True)
    assert q2.shape("blk.0.ffn_down_exps.weight") == (8, 64, 32)
    assert q2.shape("blk.0.ffn_gate_inp_shexp.weight") == (64,)


def test_expert_weights_norm_key_overrides_arch_default(tiny_qwen2moe, tmp_path):
    path = tmp_path / "norm.gguf"
    copy_gguf(GGUFModel(tiny_qwen2moe), path, extra_kv=[("qwen2moe.expert_weights_norm", True, None)])
    assert GGUFModel(path).hp.norm_topk_prob is True


def test_dequantized_tensors_equal_gguf_py(tiny_qwen2moe_q8):
    model = GGUFModel(tiny_qwen2moe_q8)
    reader = GGUFReader(tiny_qwen2moe_q8)
    types = set()
    for t in reader.tensors:
        ref = dequantize(t.data, t.tensor_type)
        got = model.tensor(t.name)
        types.add(t.tensor_type)
        assert got.dtype == np.float32 and got.shape == ref.shape, t.name
        np.testing.assert_array_equal(got, ref)
    assert {Q8_0, GGMLQuantizationType.F32} <= types
    assert model.raw("blk.0.ffn_gate_exps.weight").ggml_type == Q8_0
    assert model.raw("blk.0.ffn_gate_inp.weight").ggml_type == GGMLQuantizationType.F32  # router stays F32


def test_large_tensors_dequantized_by_our_kernels_equal_gguf_py(tiny_qwen2moe_q8, monkeypatch):
    """The kernel path (taken above DEVICE_DEQUANT_MIN_BYTES, here for every block tensor) is bit-identical."""
    monkeypatch.setattr(gguf_model, "DEVICE_DEQUANT_MIN_BYTES", 0)
    model = GGUFModel(tiny_qwen2moe_q8)
    for t in GGUFReader(tiny_qwen2moe_q8).tensors:
        if t.tensor_type == Q8_0:
            np.testing.assert_array_equal(model.tensor(t.name), dequantize(t.data, t.tensor_type).reshape(
                model.shape(t.name)), err_msg=t.name)


@pytest.mark.parametrize("kernel_path", [False, True], ids=["gguf-py", "kernels"])
def test_device_tensors_equal_host_tensors(tiny_qwen2moe_q8, monkeypatch, kernel_path):
    """`device_tensor` (what the units and the runner use) holds the bits `tensor` returns, on the device."""
    if kernel_path:
        monkeypatch.setattr(gguf_model, "DEVICE_DEQUANT_MIN_BYTES", 0)
    model = GGUFModel(tiny_qwen2moe_q8)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight", "token_embd.weight"):
        on_device = model.device_tensor(name)
        assert isinstance(on_device, jax.Array), name
        np.testing.assert_array_equal(np.asarray(on_device), model.tensor(name), err_msg=name)


def test_open_model_reuses_an_unchanged_file_and_reopens_a_rewritten_one(tiny_qwen2moe, tiny_qwen3moe, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_qwen2moe.read_bytes())
    first = open_model(path)
    assert open_model(path) is first
    path.write_bytes(tiny_qwen3moe.read_bytes())  # another file at the same path
    again = open_model(path)
    assert again is not first and again.arch.name == "qwen3moe"
    path.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(InputError):  # a damaged rewrite is refused, never served from the cache
        open_model(path)


def test_rows_and_layer_agree_with_tensor(tiny_qwen2moe_q8):
    model = GGUFModel(tiny_qwen2moe_q8)
    full = model.tensor("token_embd.weight")  # (V, d)
    idx = np.array([5, 0, 5, 17])
    np.testing.assert_array_equal(model.rows("token_embd.weight", idx), full[idx])
    layer = model.layer(1)
    assert set(layer) == {n[len("blk.1."):] for n in model.tensor_names if n.startswith("blk.1.")}
    np.testing.assert_array_equal(layer["ffn_up_exps.weight"], model.tensor("blk.1.ffn_up_exps.weight"))


def test_digest_is_sha256_of_file(tiny_qwen3moe):
    assert GGUFModel(tiny_qwen3moe).digest() == hashlib.sha256(tiny_qwen3moe.read_bytes()).hexdigest()


def test_copy_gguf_replaces_one_tensor_with_q8_0(tiny_qwen2moe, tmp_path):
    src = GGUFModel(tiny_qwen2moe)
    name = "blk.1.ffn_down_exps.weight"
    new = np.random.default_rng(0).standard_normal(src.shape(name)).astype(np.float32)  # (E, d, f)
    blocks = quantize(new, Q8_0)  # (E, d, f/32*34) uint8
    out = tmp_path / "healed.gguf"
    copy_gguf(src, out, replace={name: (blocks, Q8_0)}, extra_kv=[("moeheal.variant", "v1", None)])
    healed = GGUFModel(out)
    assert healed.raw(name).ggml_type == Q8_0
    np.testing.assert_array_equal(healed.tensor(name), dequantize(blocks, Q8_0))
    assert np.abs(healed.tensor(name) - new).max() < 0.05  # q8_0 of N(0,1): about max/254 error
    for other in src.tensor_names:
        if other != name:
            np.testing.assert_array_equal(healed.raw(other).data, src.raw(other).data)
    for key in src.metadata_fields():
        if key != "GGUF.kv_count":  # one key added
            assert healed.metadata(key) == src.metadata(key), key
    assert healed.metadata("moeheal.variant") == "v1"
    assert healed.hp == src.hp
    assert [p.name for p in tmp_path.iterdir()] == ["healed.gguf"]  # no temp file left behind


def test_write_gguf_float_and_raw_tensors_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    a32 = rng.standard_normal((3, 64)).astype(np.float32)
    a16 = rng.standard_normal((2, 32)).astype(np.float16)
    q = quantize(rng.standard_normal((4, 64)).astype(np.float32), Q8_0)  # (4, 68) uint8
    path = tmp_path / "t.gguf"
    write_gguf(path, "qwen3moe", [("x.int", 7, None), ("x.list", [1, 2, 3], None), ("x.s", "ja 日本", None)],
               [("a", a32, GGMLQuantizationType.F32), ("b", a16, GGMLQuantizationType.F16), ("c", q, Q8_0)])
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    np.testing.assert_array_equal(by_name["a"].data, a32)
    np.testing.assert_array_equal(by_name["b"].data, a16)
    np.testing.assert_array_equal(np.asarray(by_name["c"].data), q)
    assert reader.get_field("x.int").contents() == 7
    assert reader.get_field("x.list").contents() == [1, 2, 3]
    assert reader.get_field("x.s").contents() == "ja 日本"
