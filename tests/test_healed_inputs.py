"""`inputs = "healed"`: layer L is quantized and healed on the inputs the model with its earlier layers
healed makes, the reference's routed output still the target; the layers of such a variant are a
chain in the DAG, the others' units stay independent."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from bench.inputs.healworld import write_world
from moeheal.pipeline.config import load_config
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import ARRAYS, open_dump
from moeheal.pipeline.data.units import load_quantized
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.runner import Runner
from moeheal.pipeline.stages.healed_dump import sequence_bounds, unit_overrides

VARIANTS = """
[[variant]]
name = "ref_inputs"
quant = "q2_k"
round = "gptq"

[[variant]]
name = "healed_inputs"
quant = "q2_k"
round = "gptq"
inputs = "healed"
"""


@pytest.fixture(scope="module")
def healed_run(tmp_path_factory):
    config = write_world(tmp_path_factory.mktemp("healed"), variants=VARIANTS, moce_bonus=(0.0,))
    run = HealRun(load_config(config), log=lambda _: None)
    run.heal()
    return run


def test_the_first_layer_sees_the_reference_inputs_and_later_ones_the_healed_models(healed_run):
    run = healed_run
    ref_v, healed_v = run.cfg.variants
    hp, moe = run.source.hp, run.source.moe_layers
    assert len(moe) >= 2
    reference = open_dump(run.result(run.dump("calibration")).path, hp, moe)
    first = open_dump(run.result(run.healed_dump(healed_v, moe[0])).path, hp, (moe[0],))[str(moe[0])]
    for name in ARRAYS:  # nothing healed before the first MoE layer: the reference's rows, exactly
        np.testing.assert_array_equal(first[name][:], reference[str(moe[0])][name][:], err_msg=name)

    # the second layer's rows from the chain equal the whole model run from token 0 with layer 0 healed
    layer, previous = moe[1], moe[0]
    chained = open_dump(run.result(run.healed_dump(healed_v, layer)).path, hp, (layer,))[str(layer)]
    overrides = unit_overrides(run.result(run.calibrate(healed_v, previous)).path, previous)
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight", "blk.0.ffn_down_shexp.weight"} <= set(overrides)
    tokens, seq = trace_tokens(run.result(run.traces()).path, "calibration")
    runner = Runner(run.source, overrides)
    captured = {name: [] for name in ("mixed", "experts", "weights", "hh")}
    for s, e in sequence_bounds(seq, 0):
        def keep(i, cap):
            if i == layer:
                for name in captured:
                    captured[name].append(np.asarray(getattr(cap, name))[0])
        runner.forward(tokens[None, s:e], capture=True, on_layer=keep, logits=False)
    for name, parts in captured.items():  # float32 rounding apart: the stage runs batches of sequences
        np.testing.assert_allclose(chained[name][:], np.concatenate(parts), rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_array_equal(chained["yr"][:], reference[str(layer)]["yr"][:])  # the target: the reference's
    drift = np.abs(chained["mixed"][:] - reference[str(layer)]["mixed"][:]).max()
    assert drift > 1e-3, "layer 0 healed must move layer 1's inputs"


def test_layers_chain_for_a_healed_variant_and_stay_apart_for_the_others(healed_run):
    run = healed_run
    ref_v, healed_v = run.cfg.variants
    first, second = run.source.moe_layers[:2]

    def reaches(node, target):
        return node.label == target.label or any(reaches(up, target) for up in node.upstream_nodes())

    assert reaches(run.quantize(healed_v, second), run.calibrate(healed_v, first))
    assert not reaches(run.quantize(ref_v, second), run.calibrate(ref_v, first))
    assert not reaches(run.quantize(healed_v, first), run.calibrate(healed_v, second))

    # layer 0 is quantized on the same rows by both, so to the same bytes; layer 1 is not
    for layer, same in ((first, True), (second, False)):
        a = load_quantized(run.result(run.quantize(ref_v, layer)).path, layer)["ffn_up_exps"]
        b = load_quantized(run.result(run.quantize(healed_v, layer)).path, layer)["ffn_up_exps"]
        assert np.array_equal(a, b) == same, layer
    metrics = run.lake.read_table("layer_metrics").to_pylist()  # published like any variant's
    assert {(r["variant"], r["layer"]) for r in metrics if r["split"] == "in_sample"} >= {
        ("healed_inputs", first), ("healed_inputs", second)}


@pytest.mark.parametrize("knobs, message", [
    ('inputs = "healed"\nimportance = false', "inputs: has no effect with importance = false"),
    ('inputs = "quantized"', "inputs"),
])
def test_a_bad_inputs_knob_is_one_line_naming_the_key(tmp_path, knobs, message):
    config = write_world(tmp_path, variants=f'\n[[variant]]\nname = "v"\nquant = "q2_k"\n{knobs}\n')
    with pytest.raises(InputError, match=message):
        load_config(config)
