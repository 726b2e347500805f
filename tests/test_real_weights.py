"""The quantizers on the demo model's trained weights with importance from real activations."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from moeheal.kernels.decode import dequantize
from moeheal.kernels.encode import quantize_experts
from moeheal.kernels import importance as imp
from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.gguf.tokenizer import build_tokenizer, encode

DEMO = Path(__file__).resolve().parents[1] / "demo"
pytestmark = pytest.mark.skipif(not (DEMO / "model" / "demo-q8_0.gguf").exists(), reason="demo model absent")


@pytest.fixture(scope="module")
def real() -> tuple[GGUFModel, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The demo model and, per layer, its MoE inputs and routing over 512 tokens of demo text."""
    model = GGUFModel(DEMO / "model" / "demo-q8_0.gguf")
    tok = build_tokenizer(model)
    docs = [json.loads(line) for line in (DEMO / "docs.jsonl").read_text(encoding="utf-8").splitlines()[:40]]
    ids = np.concatenate([encode(tok, d["text"]) for d in docs])[:1024].astype(np.int32)
    captured: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def on_layer(layer: int, cap) -> None:
        captured[layer] = (np.asarray(cap.mixed).reshape(-1, model.hp.d_model),
                           np.asarray(cap.experts).reshape(-1, model.hp.n_expert_used))

    Runner(model).forward(ids.reshape(2, 512), capture=True, on_layer=on_layer)
    return model, captured


def weighted_error(w: np.ndarray, w_hat: np.ndarray, importance: np.ndarray) -> float:
    return float(np.sum(importance[..., None, :] * (w.astype(np.float64) - w_hat) ** 2))


@pytest.mark.parametrize("layer", [0, 2])  # the first and the last of the demo model's 3 layers
def test_tq2_0_beats_gguf_py_on_every_real_tensor(real, layer):
    model, captured = real
    mixed, experts = captured[layer]
    gate = model.tensor(f"blk.{layer}.ffn_gate_exps.weight")  # (E, f, d)
    up = model.tensor(f"blk.{layer}.ffn_up_exps.weight")
    stats = imp.expert_hidden_stats(gate, up, mixed, experts, with_hessians=False)
    mean_sq = np.mean(np.square(mixed, dtype=np.float64), axis=0)
    gate_up = np.broadcast_to(imp.gate_up_importance(mean_sq, 0.5), (gate.shape[0], gate.shape[2]))
    down = imp.down_importance(stats.sum_h_sq, stats.counts, imp.analytic_hidden_sq(gate, up, mean_sq), 16.0, 0.5)
    for name, importance in (("ffn_gate_exps", gate_up), ("ffn_up_exps", gate_up), ("ffn_down_exps", down)):
        w = model.tensor(f"blk.{layer}.{name}.weight")
        ours = quantize_experts(w, "tq2_0", importance)
        ours_f = dequantize(ours, "tq2_0", w.shape)
        np.testing.assert_array_equal(  # our dequantizer is gguf-py's, bit for bit, on real bytes
            ours_f.view(np.uint32), gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.TQ2_0).view(np.uint32))
        theirs = gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ2_0)
        theirs_f = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.TQ2_0)
        for e in range(w.shape[0]):  # every expert's matrix is a tensor of its own
            assert weighted_error(w[e], ours_f[e], importance[e]) < weighted_error(w[e], theirs_f[e], importance[e]), \
                (name, e)


def test_real_q8_0_tensors_dequantize_bit_exact(real):
    model, _ = real
    for name in ("blk.1.attn_q.weight", "blk.2.ffn_down_exps.weight", "token_embd.weight"):
        raw = model.raw(name)
        ours = dequantize(raw.data, "q8_0", model.shape(name))
        np.testing.assert_array_equal(ours.view(np.uint32), model.tensor(name).view(np.uint32))
