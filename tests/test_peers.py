"""The committed outside peers of the demo: the AutoRound peer differs from llama.cpp's Q2_K peer only in
the routed experts, those are a real Q2_K quantization of the reference's experts, and our runner reads it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.model.runner import Runner

DEMO = Path(__file__).resolve().parents[1] / "demo"
REFERENCE = DEMO / "model" / "demo-q8_0.gguf"
LLAMA_Q2_K = DEMO / "peers" / "q2_k_imatrix.gguf"
AUTOROUNDS = [DEMO / "peers" / name for name in ("q2_k_autoround.gguf", "q2_k_autoround_65k.gguf")]
EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")

pytestmark = [pytest.mark.skipif(not (all(p.exists() for p in AUTOROUNDS) and LLAMA_Q2_K.exists()),
                                 reason="demo peers absent"),
              pytest.mark.parametrize("autoround", AUTOROUNDS, ids=lambda p: p.stem)]


def test_autoround_peer_is_llama_cpp_q2_k_with_other_routed_experts(autoround: Path):
    base, peer = GGUFReader(LLAMA_Q2_K), GGUFReader(autoround)
    assert {k: f.contents() for k, f in base.fields.items()} == {k: f.contents() for k, f in peer.fields.items()}
    experts = 0
    for a, b in zip(base.tensors, peer.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.shape, a.n_bytes) == (b.name, b.tensor_type, b.data.shape, b.n_bytes)
        if EXPERTS.fullmatch(a.name):
            experts += 1
            assert b.tensor_type == GGMLQuantizationType.Q2_K, a.name
            changed = (a.data != b.data).any(axis=-1).mean()  # share of the 84-byte blocks that differ
            assert changed > 0.9, f"{a.name}: only {changed:.0%} of blocks differ from llama.cpp's"
        else:
            assert np.array_equal(a.data, b.data), a.name
    assert experts == 3 * sum(1 for t in base.tensors if t.name.endswith("ffn_gate_exps.weight")) > 0


def test_autoround_experts_quantize_the_reference_as_closely_as_llama_cpp(autoround: Path):
    """Decoded by gguf-py, each routed-expert tensor is near the reference's (Q8_0) weights: its relative
    error within 0.8x-1.25x of llama.cpp's Q2_K + imatrix of the same tensor (AutoRound minimises the
    block's output error, not the weights', so it need not be lower; a transposed, shifted or garbage
    tensor would be far off)."""
    ref, base, peer = (GGUFReader(p) for p in (REFERENCE, LLAMA_Q2_K, autoround))
    ref_tensors = {t.name: t for t in ref.tensors}
    base_tensors = {t.name: t for t in base.tensors}
    for t in peer.tensors:
        if not EXPERTS.fullmatch(t.name):
            continue
        w = dequantize(ref_tensors[t.name].data, GGMLQuantizationType.Q8_0)  # (E, out, in)
        ours = dequantize(t.data, GGMLQuantizationType.Q2_K)  # (E, out, in)
        theirs = dequantize(base_tensors[t.name].data, GGMLQuantizationType.Q2_K)  # (E, out, in)
        assert ours.shape == w.shape
        err = np.linalg.norm(ours - w) / np.linalg.norm(w)
        llama = np.linalg.norm(theirs - w) / np.linalg.norm(w)
        assert 0.8 * llama < err < 1.25 * llama, (t.name, err, llama)


def test_runner_reads_the_autoround_peer(autoround: Path):
    """Our reader decodes its experts as gguf-py does, and our runner's logits on real text are finite."""
    peer = open_model(autoround)
    name = "blk.0.ffn_down_exps.weight"
    np.testing.assert_array_equal(peer.tensor(name), dequantize(peer.raw(name).data, GGMLQuantizationType.Q2_K))
    tokens = np.array([peer.tokenizer().encode("def add(a, b):\n    return a + b\n").ids[:24]], np.int32)  # (1, T)
    logits = Runner(peer).forward(tokens)  # (1, T, V)
    assert logits.shape == (1, tokens.shape[1], peer.shape("output.weight")[0]) and np.isfinite(logits).all()
