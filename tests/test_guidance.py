"""Fisher-weighted learned rounding (`learned_loss = "fisher"`): the guidance stage's estimate is the
squared gradient the whole model gives, its draws follow the reference's distribution, the weighted
loss is the float64 one, and a variant that asks for it heals through the DAG on it. The plain learned
variant beside it is learned rounding's own heal end to end."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from moeheal.kernels import learned
from moeheal.pipeline.config import E2E_TOPK, load_config
from moeheal.pipeline.data.documents import trace_tokens
from moeheal.pipeline.data.dumps import open_dump
from moeheal.pipeline.data.fisher import read_fisher, read_fisher_values
from moeheal.pipeline.data.units import load_quantized
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.gguf.model import GGUFModel, open_model
from moeheal.pipeline.heal import HealRun
from moeheal.pipeline.model.tuner import Trace, Tuner
from moeheal.pipeline.stages import guidance
from bench.inputs.healworld import write_world

LEARNED_VARIANTS = """
[[variant]]
name = "plain"
quant = "q2_k"
round = "learned"
learned_steps = 8

[[variant]]
name = "fisher"
quant = "q2_k"
round = "learned"
learned_steps = 8
learned_loss = "fisher"

[[variant]]
name = "channels"
quant = "q2_k"
round = "learned"
learned_steps = 8
learned_loss = "fisher_channels"
"""


@pytest.fixture(scope="module")
def healed(tmp_path_factory) -> HealRun:
    config = write_world(tmp_path_factory.mktemp("guidance"), variants=LEARNED_VARIANTS, moce_bonus=(0.0,))
    run = HealRun(load_config(config), log=lambda _: None)
    run.heal()
    return run


def _trace(run: HealRun) -> Trace:
    """The calibration trace with the reference's top-k distribution the guidance stage drew from."""
    topk = run.result(run.reference_topk(min(E2E_TOPK, run.reference.hp.vocab_size))).path
    return Trace(*trace_tokens(run.result(run.traces()).path, "calibration"), run.cfg.seq_tokens, topk,
                     "calibration")


def test_fisher_rows_are_the_whole_models_output_gradient_squared(healed):
    """The streamed sweep's estimate against JAX differentiating the whole reference forward as one
    function with respect to an offset added to each layer's output, in float64: the squared
    gradient of the summed log-likelihood of the drawn tokens, at the real tokens."""
    run = healed
    model = GGUFModel(run.cfg.reference)
    tokens, ids, logp, _, mask = _trace(run).batch(0)
    mask = mask.copy()
    mask[0, -5:] = 0  # a short sequence: the masked tail is no row
    drawn = guidance.draw_tokens(ids, logp, mask, np.random.default_rng(0))
    batch = guidance.one_hot_batch(tokens, drawn, mask)
    with jax.enable_x64(True):
        tuner = Tuner(model, model, dtype=jnp.float64)
        got = guidance.fisher_rows(tuner, batch, model.moe_layers)
        theta = jax.tree_util.tree_map(lambda u: u.astype(np.float64), tuner.theta0)
        cos, sin = (a.astype(jnp.float64) for a in tuner.arch.rope_tables(tokens.shape[1], tuner.hp))
        layers = [tuner.layer_inputs(i, theta) for i in range(tuner.hp.n_layer)]
        head_theta, head = tuner.head_inputs(theta)
        ref = tuner.reference_batch(batch)

        def summed_nll(offsets: list[jax.Array]) -> jax.Array:
            h = tuner.embed(tokens)  # (B, T, d)
            for i, spec in enumerate(tuner.specs):
                h = tuner.layer_forward(spec, *layers[i], h, cos, sin) + offsets[i]  # (B, T, d)
            return tuner.head_kl(head_theta, head, h, *ref) * jnp.sum(ref[-1])  # () summed, not averaged

        zeros = [jnp.zeros((*tokens.shape, tuner.hp.d_model), jnp.float64) for _ in tuner.specs]
        expected = jax.grad(summed_nll)(zeros)
    real = mask > 0
    for layer in model.moe_layers:
        want = np.square(np.asarray(expected[layer])[real])  # (n, d)
        assert got[layer].shape == (int(real.sum()), model.hp.d_model)
        assert want.max() > 0
        np.testing.assert_allclose(got[layer], want, rtol=1e-4, atol=1e-6 * want.max())  # float32 inside the blocks


def test_draws_follow_the_top_k_distribution_renormalised():
    """Over many positions the drawn ids' frequencies are the top-k probabilities divided by their sum
    (within 4 standard errors); a masked position draws the first id."""
    p = np.array([0.5, 0.2, 0.1])  # the rest, 0.2, is the bucket: never drawn
    n = 20000
    ids = np.broadcast_to(np.array([7, 3, 9], np.int32), (1, n, 3))
    logp = np.broadcast_to(np.log(p).astype(np.float32), (1, n, 3))
    mask = np.ones((1, n), np.float32)
    mask[0, :10] = 0
    drawn = guidance.draw_tokens(ids, logp, mask, np.random.default_rng(1))[..., 0]  # (1, n)
    assert drawn.shape == (1, n) and set(np.unique(drawn)) == {3, 7, 9}
    assert (drawn[0, :10] == 7).all()
    freq = np.array([(drawn[0, 10:] == t).mean() for t in (7, 3, 9)])
    q = p / p.sum()
    assert np.all(np.abs(freq - q) < 4 * np.sqrt(q * (1 - q) / (n - 10))), (freq, q)


def test_weighted_relative_error_against_float64_numpy():
    """`relative_error` with per-token, per-channel weights against sum w r^2 / sum w yr^2 in float64
    NumPy; ones give exactly the unweighted error."""
    rng = np.random.default_rng(0)
    e, f, d, t, k = 4, 16, 8, 40, 2
    w = {"ffn_gate_exps": rng.standard_normal((e, f, d)).astype(np.float32),
         "ffn_up_exps": rng.standard_normal((e, f, d)).astype(np.float32),
         "ffn_down_exps": rng.standard_normal((e, d, f)).astype(np.float32)}
    x = rng.standard_normal((t, d)).astype(np.float32)
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)  # (T, k)
    gates = rng.random((t, k)).astype(np.float32)
    yr = rng.standard_normal((t, d)).astype(np.float32)
    weight = rng.exponential(1.0, (t, d)).astype(np.float32)
    x64 = x.astype(np.float64)
    out = np.zeros((t, d))
    for i in range(t):
        for j in range(k):
            ex = experts[i, j]
            g = w["ffn_gate_exps"][ex].astype(np.float64) @ x64[i]
            u = w["ffn_up_exps"][ex].astype(np.float64) @ x64[i]
            out[i] += gates[i, j] * (w["ffn_down_exps"][ex].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    r2, y2 = np.square(out - yr), np.square(yr.astype(np.float64))
    weighted = learned.TokenSet(x, experts, gates, yr, yr, weight=weight)
    assert learned.relative_error(w, weighted, batch_tokens=16) == pytest.approx(
        np.sum(weight * r2) / np.sum(weight * y2), rel=1e-5)
    plain = learned.relative_error(w, learned.TokenSet(x, experts, gates, yr, yr), batch_tokens=16)
    assert plain == pytest.approx(np.sum(r2) / np.sum(y2), rel=1e-5)
    ones = learned.TokenSet(x, experts, gates, yr, yr, weight=np.ones_like(yr))
    assert learned.relative_error(w, ones, batch_tokens=16) == plain


def test_a_fisher_variant_learns_on_the_guidance_and_only_it_reads_it(healed):
    """The guidance stage's arrays: a row per dumped calibration row, finite, non-negative, read back
    with mean 1; the fisher variant's quantize units depend on it and the plain one's do not; their
    learned bytes differ (and with the weights averaged per channel, from both), and the chosen step's
    held-out error is never above step 0's."""
    run = healed
    folder = run.result(run.guidance()).path
    dump = open_dump(run.result(run.dump("calibration")).path, run.reference.hp, run.reference.moe_layers)
    rows = int(dump.attrs["total_rows"])
    for layer in run.reference.moe_layers:
        stored = zarr.open_group(str(folder), mode="r")[str(layer)]
        assert stored.shape == (rows, run.reference.hp.d_model)
        values = read_fisher(folder, layer, slice(None))
        assert np.isfinite(values).all() and (values >= 0).all()
        assert values.mean() == pytest.approx(1.0, rel=1e-2)  # bfloat16 rows over a float64 mean
        assert values.std() > 0.1  # the weights are not uniform: some tokens and channels matter more
    fisher, plain, channels = (v for name in ("fisher", "plain", "channels") for v in run.cfg.variants
                               if v.name == name)
    assert "guidance" in run.quantize(fisher, 0).upstream and "guidance" not in run.quantize(plain, 0).upstream
    assert "guidance" in run.quantize(channels, 0).upstream
    planned = {p.stage: p for p in HealRun(run.cfg, log=lambda _: None, plan=True).plan()}
    assert planned["guidance:calibration"].status == "cached"
    assert "guidance:calibration" in planned["quantize:fisher:0"].upstream
    assert "guidance:unseen" not in planned  # no budget variant: nothing prices formats
    for layer in run.reference.moe_layers:
        a = np.load(run.result(run.quantize(fisher, layer)).path / f"layer_{layer}.npz")
        b = np.load(run.result(run.quantize(plain, layer)).path / f"layer_{layer}.npz")
        c = np.load(run.result(run.quantize(channels, layer)).path / f"layer_{layer}.npz")
        assert not np.array_equal(a["ffn_down_exps"], b["ffn_down_exps"])
        assert not np.array_equal(c["ffn_down_exps"], a["ffn_down_exps"])
        assert not np.array_equal(c["ffn_down_exps"], b["ffn_down_exps"])
        curve = pq.read_table(run.result(run.quantize(fisher, layer)).path / "learned_curve.parquet").to_pylist()
        heldout = [r["loss"] for r in curve if r["split"] == "heldout"]
        chosen = [r["loss"] for r in curve if r["split"] == "chosen"]
        assert chosen[0] <= heldout[0]


def test_a_learned_variant_heals_end_to_end(healed):
    """The plain learned variant of this file's world, healed end to end with round = "learned": every
    layer's quantize unit learns, the curve is published, and the written GGUF holds the learned bytes
    (decoded as the unit's loss saw). It had a file of its own that healed this tiny world again for
    one such variant; the world here heals one already, so its lake is read instead."""
    run = healed
    variant = next(v for v in run.cfg.variants if v.name == "plain")
    curve = run.lake.read_table("learned_curve").to_pylist()
    layers = run.source.moe_layers
    assert {r["variant"] for r in curve} == {"plain", "fisher", "channels"}
    for layer in layers:
        rows = [r for r in curve if r["variant"] == "plain" and r["layer"] == layer]
        assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, variant.learned_steps + 1))
        start = next(r["loss"] for r in rows if r["split"] == "heldout" and r["step"] == 0)
        chosen = next(r for r in rows if r["split"] == "chosen")
        assert chosen["loss"] <= start and {0, chosen["step"]} <= {r["step"] for r in rows if r["split"] == "unseen"}
    healed_model = open_model(run.result(run.assemble(variant)).path)
    for layer in layers:  # the GGUF's gate projection is the learned unit's bytes
        unit = load_quantized(run.result(run.quantize(variant, layer)).path, layer)
        stored = np.asarray(healed_model.raw(f"blk.{layer}.ffn_gate_exps.weight").data)
        assert np.array_equal(stored.reshape(-1), unit["ffn_gate_exps"].reshape(-1))


def test_the_unseen_traces_store_is_that_traces_estimate(healed):
    """The sensitivity stage's store: one row per unseen-trace token, the first sequence's rows the
    squared output gradients of one draw from the stage's seed (recomputed here), not the calibration
    trace's; its `mean` attribute the mean of the values."""
    run = healed
    node = run.guidance("unseen")
    assert node.params.trace == "unseen" and node.label == "guidance:unseen"
    folder = run.result(node).path
    topk = run.result(run.reference_topk(min(E2E_TOPK, run.reference.hp.vocab_size))).path
    trace = Trace(*trace_tokens(run.result(run.traces()).path, "unseen"), run.cfg.seq_tokens, topk, "unseen")
    tokens, ids, logp, _, mask = trace.batch(0)
    rng = np.random.default_rng(node.params.seed)
    batch = guidance.one_hot_batch(tokens, guidance.draw_tokens(ids, logp, mask, rng), mask)
    expected = guidance.fisher_rows(Tuner(run.reference, run.reference), batch, run.reference.moe_layers)
    n = int(mask.sum())
    calibration = run.result(run.guidance()).path
    for layer in run.reference.moe_layers:
        stored = zarr.open_group(str(folder), mode="r")[str(layer)]
        assert stored.shape == (trace.n_tokens, run.reference.hp.d_model)
        values = read_fisher_values(folder, layer)
        np.testing.assert_allclose(values[:n], expected[layer], rtol=1e-2, atol=1e-6 * expected[layer].max())
        assert not np.allclose(values[:n], read_fisher_values(calibration, layer)[:n], rtol=1e-2)
        assert stored.attrs["mean"] == pytest.approx(values.astype(np.float64).mean(), rel=1e-2)


@pytest.mark.parametrize("knobs, message", [
    ('round = "gptq"\nlearned_loss = "fisher"', '[variant[0]] learned_loss: is only used with round = "learned"'),
    ('round = "learned"\nlearned_loss = "kl"',
     "[variant[0]] learned_loss: 'kl' is not one of output, fisher, fisher_channels"),
])
def test_learned_loss_is_validated(tmp_path: Path, knobs: str, message: str):
    config = write_world(tmp_path, variants=f'[[variant]]\nname = "v"\nquant = "q2_k"\n{knobs}\n')
    with pytest.raises(InputError) as err:
        load_config(config)
    assert message in str(err.value)
