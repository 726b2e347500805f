"""A healed GGUF's `general.file_type` says what its routed experts are, as llama-quantize names it.

`copy_gguf` (the writer of every healed file) sets the key from the types of the tensors it writes:
the file type of the routed experts' type, or for a mix of types the one of the type holding the
most routed-expert weights. Files are read back by gguf-py's `GGUFReader`, not our reader. With
llama.cpp's binaries at hand, llama-quantize's own files show the type each file type stores its
experts in, and the key our writer derives from that type must be the key llama-quantize wrote.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from moeheal.pipeline.gguf.metadata import FILE_TYPE_KEY, FILE_TYPE_OF, experts_file_type
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.gguf.writer import Deferred, copy_gguf
from moeheal.pipeline.model.roles import ROUTED_TENSOR

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo" / "model" / "demo-q8_0.gguf"
Q2_K, Q3_K, IQ2_XXS = GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.IQ2_XXS

needs_demo = pytest.mark.skipif(not DEMO_MODEL.exists(), reason="demo/model/demo-q8_0.gguf not built yet")


def file_type(path: Path) -> LlamaFileType:
    return LlamaFileType(int(GGUFReader(path).fields[FILE_TYPE_KEY].contents()))


def routed_names(model: GGUFModel) -> list[str]:
    return [name for name in model.tensor_names if ROUTED_TENSOR.match(name)]


def zero_blocks(model: GGUFModel, name: str, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The tensor's shape in `ggml_type`'s block bytes, all zeros (a valid block of zero weights)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    *rows, cols = model.shape(name)
    return np.zeros((*rows, cols // block_size * type_size), np.uint8)


def healed(tmp_path: Path, types: dict[str, GGMLQuantizationType]) -> Path:
    """The demo model with each routed tensor of role `types` names (ffn_gate_exps, ...) in that type,
    half of them given as arrays and half as `Deferred`, as calibrate's assembly gives them."""
    source = GGUFModel(DEMO_MODEL)
    replace = {}
    for i, name in enumerate(routed_names(source)):
        ggml_type = types[ROUTED_TENSOR.match(name).group(2)]
        blocks = zero_blocks(source, name, ggml_type)
        replace[name] = (blocks, ggml_type) if i % 2 else Deferred(blocks.shape, ggml_type, lambda b=blocks: b)
    out = tmp_path / "healed.gguf"
    copy_gguf(source, out, replace, extra_kv=[("moeheal.variant", "v", None)])
    return out


@needs_demo
def test_the_demo_model_is_a_q8_0_file():
    """The source's key, so that every test below shows the key changed."""
    assert file_type(DEMO_MODEL) == LlamaFileType.MOSTLY_Q8_0


@needs_demo
@pytest.mark.parametrize(("ggml_type", "expected"), [(Q2_K, LlamaFileType.MOSTLY_Q2_K),
                                                     (IQ2_XXS, LlamaFileType.MOSTLY_IQ2_XXS),
                                                     (Q3_K, LlamaFileType.MOSTLY_Q3_K_M)])
def test_a_file_of_one_expert_type_is_named_by_it(tmp_path, ggml_type, expected):
    out = healed(tmp_path, dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), ggml_type))
    assert file_type(out) == expected
    assert GGUFReader(out).fields["moeheal.variant"].contents() == "v"


@needs_demo
@pytest.mark.parametrize(("gate", "up_down", "expected"), [(Q2_K, IQ2_XXS, LlamaFileType.MOSTLY_IQ2_XXS),
                                                           (IQ2_XXS, Q2_K, LlamaFileType.MOSTLY_Q2_K)])
def test_a_mix_is_named_by_the_type_of_most_expert_weights(tmp_path, gate, up_down, expected):
    """Gate in one type, up and down (two thirds of the routed weights) in the other."""
    out = healed(tmp_path, {"ffn_gate_exps": gate, "ffn_up_exps": up_down, "ffn_down_exps": up_down})
    assert file_type(out) == expected


def test_experts_file_type_weighs_weights_and_breaks_ties_to_fewer_bits():
    assert experts_file_type({Q2_K: 100, IQ2_XXS: 101}) == LlamaFileType.MOSTLY_IQ2_XXS
    assert experts_file_type({Q3_K: 100, Q2_K: 99}) == LlamaFileType.MOSTLY_Q3_K_M
    assert experts_file_type({Q3_K: 100, Q2_K: 100}) == LlamaFileType.MOSTLY_Q2_K  # 2.625 bits < 3.4375
    assert experts_file_type({IQ2_XXS: 100, Q2_K: 100}) == LlamaFileType.MOSTLY_IQ2_XXS  # 2.0625 bits
    assert experts_file_type({GGMLQuantizationType.IQ2_S: 1}) == LlamaFileType.MOSTLY_IQ2_M
    assert experts_file_type({GGMLQuantizationType.Q8_K: 1}) is None  # no file type stores Q8_K
    assert experts_file_type({}) is None


@needs_demo
def test_a_copy_that_keeps_the_experts_types_keeps_the_sources_key(tmp_path):
    """A source whose key is not the one its experts' type implies (a caller set it) keeps that key
    through a copy that changes no routed tensor's type; a caller's key wins over the derived one."""
    source = GGUFModel(DEMO_MODEL)
    first = tmp_path / "first.gguf"
    copy_gguf(source, first, extra_kv=[(FILE_TYPE_KEY, int(LlamaFileType.MOSTLY_Q4_K_M), None)])
    assert file_type(first) == LlamaFileType.MOSTLY_Q4_K_M
    again = tmp_path / "again.gguf"
    first_model = GGUFModel(first)
    norm = "blk.0.ffn_norm.weight"
    copy_gguf(first_model, again, {norm: (first_model.tensor(norm) * 2, GGMLQuantizationType.F32)})
    assert file_type(again) == LlamaFileType.MOSTLY_Q4_K_M
    named = tmp_path / "named.gguf"
    name = routed_names(source)[0]
    copy_gguf(source, named, {name: (zero_blocks(source, name, Q2_K), Q2_K)},
              extra_kv=[(FILE_TYPE_KEY, int(LlamaFileType.MOSTLY_Q6_K), None)])
    assert file_type(named) == LlamaFileType.MOSTLY_Q6_K


# llama-quantize's file types that need no importance matrix, each storing the experts in one type.
QUANTIZE_FILE_TYPES = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL"]


@needs_demo
@pytest.mark.llamacpp
@pytest.mark.parametrize("ftype", QUANTIZE_FILE_TYPES)
def test_the_key_is_the_one_llama_quantize_writes_for_the_experts_type(tmp_path, ftype):
    binary = Path(os.environ["LLAMA_CPP_DIR"]) / "bin" / "llama-quantize"
    theirs = tmp_path / f"llama-quantize-{ftype}.gguf"
    run = subprocess.run([str(binary), "--allow-requantize", "--pure", str(DEMO_MODEL), str(theirs), ftype, "2"],
                         capture_output=True, text=True, errors="replace", timeout=300, check=False)
    assert run.returncode == 0, (run.stdout + run.stderr)[-2000:]
    quantized = GGUFModel(theirs)
    types = {quantized.raw(name).ggml_type for name in routed_names(quantized)}
    assert len(types) == 1, f"{ftype}: experts in {types}"
    (experts_type,) = types
    assert file_type(theirs) == LlamaFileType[f"MOSTLY_{ftype}"] == FILE_TYPE_OF[experts_type]
    source = GGUFModel(DEMO_MODEL)
    ours = tmp_path / "ours.gguf"
    copy_gguf(source, ours, {name: (quantized.raw(name).data, experts_type) for name in routed_names(source)})
    assert file_type(ours) == file_type(theirs)
