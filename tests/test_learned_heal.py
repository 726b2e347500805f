"""A tiny world healed end to end with round = "learned": every layer's quantize unit learns, the
curve is published, and the written GGUF holds the learned bytes (decoded as the unit's loss saw)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from moeheal.pipeline.config import load_config
from moeheal.pipeline.gguf.model import open_model
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.data.units import load_quantized
from bench.inputs.healworld import write_world

VARIANTS = """
[[variant]]
name = "learned"
quant = "q2_k"
round = "learned"
learned_steps = 2
"""


def test_a_learned_variant_heals_end_to_end(tmp_path):
    config = write_world(tmp_path, variants=VARIANTS, moce_bonus=(0.0,))
    run = HealRun(load_config(config), log=lambda _: None)
    run.heal()
    curve = run.lake.read_table("learned_curve").to_pylist()
    layers = run.source.moe_layers
    assert {r["variant"] for r in curve} == {"learned"} and {r["layer"] for r in curve} == set(layers)
    for layer in layers:
        rows = [r for r in curve if r["layer"] == layer]
        assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2]
        start = next(r["loss"] for r in rows if r["split"] == "heldout" and r["step"] == 0)
        chosen = next(r for r in rows if r["split"] == "chosen")
        assert chosen["loss"] <= start and {0, chosen["step"]} <= {r["step"] for r in rows if r["split"] == "unseen"}
    healed = open_model(run.result(run.assemble(run.cfg.variants[0])).path)
    variant = run.cfg.variants[0]
    for layer in layers:  # the GGUF's down projection is the learned unit's bytes with alpha in its scales
        unit = load_quantized(run.result(run.quantize(variant, layer)).path, layer)
        stored = np.asarray(healed.raw(f"blk.{layer}.ffn_gate_exps.weight").data)
        assert np.array_equal(stored.reshape(-1), unit["ffn_gate_exps"].reshape(-1))
