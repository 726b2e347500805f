"""Hugging Face checkpoints: tiny random checkpoints of every supported family, saved by transformers
as a hub checkpoint is (config.json, safetensors, tokenizer.json), converted by `hf_convert` (NumPy
alone) and, when its source is found, by llama.cpp's `convert_hf_to_gguf.py`; both files run in our
runner within 1e-4 of transformers, hold the same tensors, and one heals.

llama.cpp's converter is found through LLAMA_CPP_SRC (its source folder, holding
convert_hf_to_gguf.py and gguf-py/), else in the parent of LLAMA_CPP_DIR (a build folder inside
the source); those tests skip when it is not found. It is run as a tool, in this Python (which has
torch and transformers), with one change: our tiny tokenizers are no model's, so its lookup of the
pre-tokenizer by a hash of known tokenizers' output is answered "qwen2" (the tiny vocabularies
are trained with Qwen2's pre-tokenizer).
"""

from __future__ import annotations

import copy
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import PreTrainedTokenizerFast

from moeheal.pipeline.config import load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.sources.hf_checkpoint import convert_checkpoint
from moeheal.pipeline.model.runner import Runner
from bench.inputs.ggufs import tiny_hf_model, train_tiny_bpe
from bench.inputs.healworld import write_world
from tests.test_arch_deepseek2 import tiny_deepseek_v3
from tests.test_arch_mixtral import tiny_mixtral, train_tiny_spm
from tests.test_arch_qwen3next import tiny_qwen3next
from tests.test_runner import rel_err, tokens_for

pytestmark = pytest.mark.compile_bound  # tests/conftest.py

FAMILIES = ["qwen2moe", "qwen3moe", "olmoe", "mixtral", "deepseek2", "qwen3next"]


def llama_cpp_converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py from LLAMA_CPP_SRC, else next to the LLAMA_CPP_DIR build folder."""
    for folder in (os.environ.get("LLAMA_CPP_SRC"), os.environ.get("LLAMA_CPP_DIR")):
        if folder:
            for candidate in (Path(folder), Path(folder).parent):
                if (candidate / "convert_hf_to_gguf.py").is_file() and (candidate / "gguf-py").is_dir():
                    return candidate / "convert_hf_to_gguf.py"
    return None


CONVERTER = llama_cpp_converter()
needs_converter = pytest.mark.skipif(CONVERTER is None, reason="llama.cpp's convert_hf_to_gguf.py not found "
                                                                 "(set LLAMA_CPP_SRC to llama.cpp's source folder)")

# Runs the converter's main with its pre-tokenizer lookup answered (see the module docstring).
RUN_CONVERTER = """
import os, runpy, sys
script = sys.argv[1]
sys.path[:0] = [os.path.dirname(script), os.path.join(os.path.dirname(script), "gguf-py")]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def tiny_family(family: str, seed: int, **dims):
    """(transformers model, tokenizers.Tokenizer) of a family, as the parity tests build them, with
    the config values llama.cpp's converter reads from a real checkpoint's config.json: OLMoE's
    epsilon 1e-5 (the converter writes that constant), DeepSeek-V3's `scoring_func`."""
    if family == "mixtral":
        tokenizer = train_tiny_spm(seed=seed)
        return tiny_mixtral(tokenizer.get_vocab_size(), seed, **dims), tokenizer
    tokenizer = train_tiny_bpe(seed=seed)
    vocab = tokenizer.get_vocab_size()
    if family == "qwen3next":
        return tiny_qwen3next(vocab, seed, **dims), tokenizer
    if family == "deepseek2":
        hf = tiny_deepseek_v3(vocab, seed, **dims)
        hf.config.scoring_func = "sigmoid"
        return hf, tokenizer
    hf = tiny_hf_model(family, vocab, seed, **dims)
    if family == "olmoe":
        hf.config.rms_norm_eps = 1e-5
        for module in hf.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 1e-5
    return hf, tokenizer


def save_checkpoint(hf, tokenizer, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The model as a hub checkpoint: config.json, model.safetensors (in `dtype`), tokenizer.json."""
    (hf if dtype == torch.float32 else copy.deepcopy(hf).to(dtype)).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return folder


def llama_cpp_convert(checkpoint: Path, out: Path) -> Path:
    """llama.cpp's converter on `checkpoint`, F32 (and without Qwen3-Next's multi-token prediction)."""
    no_mtp = ["--no-mtp"] if json.loads((checkpoint / "config.json").read_text())["model_type"] == "qwen3_next" else []
    subprocess.run([sys.executable, "-P", "-c", RUN_CONVERTER, str(CONVERTER), str(checkpoint), "--outtype", "f32",
                    "--outfile", str(out), *no_mtp], check=True, capture_output=True, timeout=300)
    return out


def transformers_logits(hf, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(tokens).long()).logits.numpy()


def check_logits(path: Path, hf) -> GGUFModel:
    """Our runner on the file against transformers on the same random tokens: within 1e-4."""
    model = GGUFModel(path)
    tokens = tokens_for(model, batch=2, length=24)
    assert rel_err(Runner(model).forward(tokens), transformers_logits(hf, tokens)) <= 1e-4
    return model


def stored_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF as float32 in its stored NumPy shape (gguf-py, not our reader)."""
    return {t.name: np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
        tuple(reversed(t.shape.tolist()))) for t in GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """{family: (checkpoint folder, transformers model)} of every family, float32 safetensors."""
    built = {}
    for family in FAMILIES:
        hf, tokenizer = tiny_family(family, seed=3)
        built[family] = save_checkpoint(hf, tokenizer, tmp_path_factory.mktemp(family) / "checkpoint"), hf
    return built


# Converts each (checkpoint, out) pair of sys.argv in a Python where torch and transformers cannot be imported.
CONVERT_WITHOUT_TORCH = """
import sys
sys.modules.update(torch=None, transformers=None, safetensors=None)
from pathlib import Path
from moeheal.pipeline.sources.hf_checkpoint import convert_checkpoint
for folder, out in zip(sys.argv[1::2], sys.argv[2::2]):
    convert_checkpoint(Path(folder), Path(out), outtype="f32")
"""


@pytest.fixture(scope="module")
def converted_without_torch(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """{family: our F32 conversion of its checkpoint}, all made by one Python without torch."""
    out = tmp_path_factory.mktemp("ours")
    paths = {family: out / f"{family}.gguf" for family in checkpoints}
    pairs = [str(arg) for family, path in paths.items() for arg in (checkpoints[family][0], path)]
    subprocess.run([sys.executable, "-P", "-c", CONVERT_WITHOUT_TORCH, *pairs], check=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return paths


@pytest.mark.parametrize("family", FAMILIES)
def test_our_conversion_without_torch_runs_within_1e4_of_transformers(checkpoints, converted_without_torch, family):
    model = check_logits(converted_without_torch[family], checkpoints[family][1])
    assert model.arch.name == {"mixtral": "llama"}.get(family, family)


@needs_converter
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_conversion_runs_within_1e4_and_matches_ours(checkpoints, converted_without_torch, family, tmp_path):
    """The file llama.cpp's converter writes opens (its 2-D shared-expert gates included), runs as
    transformers does, and holds the tensors ours holds: equal values, equal shapes but for the
    1-dims llama.cpp's converter keeps; Qwen3-Next's -exp(A_log) within NumPy's and torch's 2 ulp."""
    folder, hf = checkpoints[family]
    if family == "mixtral":
        pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads Mixtral's vocabulary with it")
    theirs = llama_cpp_convert(folder, tmp_path / "llama-cpp.gguf")
    model = check_logits(theirs, hf)
    ours = stored_tensors(converted_without_torch[family])
    stored = stored_tensors(theirs)
    assert sorted(stored) == sorted(ours)
    for name, value in stored.items():
        assert model.shape(name) == ours[name].shape, name
        if name.endswith("ssm_a"):
            np.testing.assert_allclose(value, ours[name], rtol=3e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(value.reshape(ours[name].shape), ours[name], err_msg=name)
    if family in ("qwen2moe", "qwen3next"):  # the case: stored [1, d], read as (d,)
        gate = "blk.0.ffn_gate_inp_shexp.weight"
        assert stored[gate].shape == (1, model.hp.d_model) and model.shape(gate) == (model.hp.d_model,)
        assert model.raw(gate).data.shape == (4 * model.hp.d_model,)


def test_bf16_and_f16_checkpoints_convert_exactly(tmp_path):
    """bf16 weights widen to their exact float32 values; an f16 reference stores them rounded to f16
    (norms, biases and routers in F32 as llama.cpp keeps them), a Q8_0 one within half a step of its
    block (plus the f16 scale's rounding), a bf16 one exactly; an f16 checkpoint converts to its
    exact values too."""
    hf, tokenizer = tiny_family("qwen2moe", seed=5)
    bf16 = save_checkpoint(hf, tokenizer, tmp_path / "bf16", torch.bfloat16)
    f16 = save_checkpoint(hf, tokenizer, tmp_path / "f16", torch.float16)
    exact = {k: v.to(torch.bfloat16).float().numpy() for k, v in hf.state_dict().items()}
    got = stored_tensors(convert_checkpoint(bf16, tmp_path / "bf16-f32.gguf", outtype="f32"))
    np.testing.assert_array_equal(got["blk.1.attn_q.weight"], exact["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(got["blk.0.ffn_down_exps.weight"], exact["model.layers.0.mlp.experts.down_proj"])
    np.testing.assert_array_equal(got["blk.0.ffn_gate_inp_shexp.weight"],
                                  exact["model.layers.0.mlp.shared_expert_gate.weight"].reshape(-1))
    half = convert_checkpoint(bf16, tmp_path / "bf16-f16.gguf")  # the default: F16 matrices
    types = {t.name: t.tensor_type for t in GGUFReader(half).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == GGMLQuantizationType.F16
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    np.testing.assert_array_equal(stored_tensors(half)["blk.0.ffn_up_exps.weight"],
                                  got["blk.0.ffn_up_exps.weight"].astype(np.float16).astype(np.float32))
    q8 = convert_checkpoint(bf16, tmp_path / "bf16-q8_0.gguf", outtype="q8_0")
    assert {t.name: t.tensor_type for t in GGUFReader(q8).tensors}["blk.0.ffn_up_exps.weight"] == \
        GGMLQuantizationType.Q8_0
    w = got["blk.0.ffn_up_exps.weight"].reshape(-1, 32)  # (blocks, 32)
    step = np.abs(w).max(axis=1, keepdims=True) / 127  # (blocks, 1) Q8_0: one scale per 32 weights
    error = np.abs(stored_tensors(q8)["blk.0.ffn_up_exps.weight"].reshape(-1, 32) - w)  # (blocks, 32)
    assert np.all(error <= (0.5 + 127 * 2.0**-11) * step)  # half a step, and the scale's own f16 rounding
    brain = convert_checkpoint(bf16, tmp_path / "bf16-bf16.gguf", outtype="bf16")
    assert {t.name: t.tensor_type for t in GGUFReader(brain).tensors}["blk.0.ffn_up_exps.weight"] == \
        GGMLQuantizationType.BF16
    np.testing.assert_array_equal(stored_tensors(brain)["blk.0.ffn_up_exps.weight"], got["blk.0.ffn_up_exps.weight"])
    from_f16 = stored_tensors(convert_checkpoint(f16, tmp_path / "f16-f32.gguf", outtype="f32"))
    np.testing.assert_array_equal(from_f16["blk.0.attn_k.weight"],
                                  hf.state_dict()["model.layers.0.self_attn.k_proj.weight"].half().float().numpy())


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    hf, tokenizer = tiny_family("qwen3moe", seed=6, n_layer=1, n_expert=4)
    return save_checkpoint(hf, tokenizer, tmp_path_factory.mktemp("small") / "checkpoint")


def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        if item.name not in names:
            (dst / item.name).write_bytes(item.read_bytes())
    return dst


def _fp8_safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))


@pytest.mark.parametrize("damage, message", [
    ("no_config", "no config.json"),
    ("unsupported", "model_type 'gpt2' is not supported"),
    ("no_safetensors", "no *.safetensors files"),
    ("fp8", "dtype F8_E4M3 is not supported"),
    ("no_tokenizer", "no tokenizer.json"),
    ("truncated_config", "key num_hidden_layers: missing"),
])
def test_what_we_cannot_convert_is_refused_in_one_line_naming_llama_cpp(small_checkpoint, tmp_path, damage, message):
    folder = tmp_path / "damaged"
    if damage == "no_config":
        _copy_without(small_checkpoint, folder, "config.json")
    elif damage == "unsupported":
        _copy_without(small_checkpoint, folder)
        (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    elif damage == "no_safetensors":
        _copy_without(small_checkpoint, folder, "model.safetensors")
    elif damage == "fp8":
        _copy_without(small_checkpoint, folder)
        _fp8_safetensors(folder / "model-fp8.safetensors")
    elif damage == "no_tokenizer":
        _copy_without(small_checkpoint, folder, "tokenizer.json")
    else:
        _copy_without(small_checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        del config["num_hidden_layers"]
        (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.gguf"
    with pytest.raises(InputError) as err:
        convert_checkpoint(folder, out)
    line = str(err.value)
    assert message in line and "\n" not in line and not out.exists()
    if damage != "truncated_config":
        assert "convert_hf_to_gguf.py" in line


# Per family, the smallest widths our 256-weight formats quantize (every expert matrix's rows a
# multiple of 256), as the parity tests' builders take them.
HEAL_DIMS = {
    "qwen2moe": {"d_model": 256, "d_expert": 256, "d_shexp": 256},
    "qwen3moe": {"d_model": 256, "d_expert": 256},
    "olmoe": {"d_model": 256, "d_expert": 256},
    "mixtral": {"d_model": 256, "d_expert": 256},
    "deepseek2": {"d_model": 256, "d_expert": 256, "kv_lora_rank": 64, "nope": 32, "rope": 16, "v_dim": 32,
                  "q_lora_rank": 64},
    "qwen3next": {"d_model": 256, "d_expert": 256, "d_shexp": 256},
}


@needs_converter
@pytest.mark.parametrize("family", FAMILIES)
def test_a_llama_cpp_converted_model_heals(family, tmp_path):
    """The issue's files, end to end, every family: llama.cpp's conversion (qwen2moe's and
    Qwen3-Next's 2-D shared-expert gates included) is the reference of a heal (with a ridge through
    the shared expert where there is one), and the healed file runs."""
    if family == "mixtral":
        pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads Mixtral's vocabulary with it")
    hf, tokenizer = tiny_family(family, seed=3, **HEAL_DIMS[family])
    reference = llama_cpp_convert(save_checkpoint(hf, tokenizer, tmp_path / "checkpoint"), tmp_path / "ref.gguf")
    shared = GGUFModel(reference).arch.has_shared_expert
    variant = ('[[variant]]\nname = "v1"\nbeta_gate_up = 0.5\nbeta_down = 0.5\nround = "ls"\n'
               + ("ridge_rho = 6.0\n" if shared else "ridge_rho = 0.0\n"))
    run = HealRun(load_config(write_world(tmp_path, model=reference, variants=variant, moce_bonus=(0.0,))),
                  log=lambda m: None)
    run.heal()
    assert (run.calibrated_table(run.cfg.variants, "ridge_cv").num_rows > 0) == shared
    healed = GGUFModel(run.result(run.assemble(run.cfg.variants[0])).path)
    layer = healed.moe_layers[0]
    assert healed.raw(f"blk.{layer}.ffn_down_exps.weight").ggml_type.name == "TQ2_0"
    if family in ("qwen2moe", "qwen3next"):
        gate = f"blk.{layer}.ffn_gate_inp_shexp.weight"
        assert healed.shape(gate) == (healed.hp.d_model,)
    assert np.all(np.isfinite(Runner(healed).forward(tokens_for(healed, batch=1, length=16))))


def test_a_shape_with_llama_cpp_s_extra_1_dims_opens_and_runs_the_same(tiny_qwen2moe, tmp_path):
    """Without llama.cpp's converter at hand: the shared-expert gates stored as [1, d] (as it writes
    them) open as (d,) and give the same logits; a shape that differs by more than 1-dims is refused."""
    from moeheal.pipeline.gguf.writer import copy_gguf

    source = GGUFModel(tiny_qwen2moe)
    gates = [f"blk.{i}.ffn_gate_inp_shexp.weight" for i in range(source.hp.n_layer)]
    copy_gguf(source, tmp_path / "2d.gguf", {g: (source.tensor(g)[None, :], GGMLQuantizationType.F32) for g in gates})
    assert {t.name: tuple(t.shape.tolist()) for t in GGUFReader(tmp_path / "2d.gguf").tensors}[gates[0]] == \
        (source.hp.d_model, 1)  # ggml order: ne = [d, 1]
    model = GGUFModel(tmp_path / "2d.gguf")
    assert model.shape(gates[0]) == (source.hp.d_model,) and model.tensor(gates[0]).shape == (source.hp.d_model,)
    tokens = tokens_for(model, batch=1, length=16)
    np.testing.assert_array_equal(Runner(model).forward(tokens), Runner(source).forward(tokens))
    halves = source.tensor(gates[0]).reshape(2, -1)  # (2, d/2): the same values, not the same shape
    copy_gguf(source, tmp_path / "bad.gguf", {gates[0]: (halves, GGMLQuantizationType.F32)})
    with pytest.raises(InputError, match=r"ffn_gate_inp_shexp.weight: shape \[2, 32\], expected \[64\]"):
        GGUFModel(tmp_path / "bad.gguf")
