"""Learned rounding (kernels/learned.py): the written bytes decode (gguf-py) to exactly the values
the loss saw, for every registered format at random points of the relaxation; and on a small
layer, learning lowers the MoE output's error on held-out tokens below its GPTQ start."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moeheal.kernels import decode, encode
from moeheal.kernels import learned as L
from moeheal.kernels.decode import FORMATS
from moeheal.kernels.gptq import damp_hessian
from moeheal.kernels.iquants import gguf_grid
from moeheal.pipeline.config import load_config
from moeheal.pipeline.errors import InputError
from moeheal.pipeline.stages.quantize import QuantizeParams
from bench.inputs.healworld import write_world
from tests.reference_quants import routed_output

pytestmark = pytest.mark.compile_bound  # tests/conftest.py


def _random_theta(relax: L.Relaxation, theta0: L.Params, rng: np.random.Generator) -> L.Params:
    """A point of the relaxation inside its bounds, with many codes past the rounding boundary."""
    bounds = relax.bounds()
    return {k: jnp.asarray(rng.uniform(-bounds[k], bounds[k], v.shape).astype(np.float32)) for k, v in theta0.items()}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_learned_bytes_decode_to_the_values_the_loss_saw(fmt):
    rng = np.random.default_rng(0)
    cls = decode.format_of(fmt)
    x = (0.02 * rng.standard_t(4, (4, 512))).astype(np.float32)
    # random blocks: every byte pattern is a valid code of these formats; the fp16 scales set to small values
    blocks = rng.integers(0, 256, (x.size // cls.block_size, cls.type_size), dtype=np.uint8)  # (n, type_size)
    for j in range(cls.fp16_scale_bits(blocks).shape[1]):
        bits = cls.fp16_scale_bits(blocks)
        bits[:, j] = rng.uniform(0.001, 0.01, (blocks.shape[0], 1)).astype(np.float16).view(np.uint16)[:, 0]
        blocks = cls.with_fp16_scale_bits(blocks, bits)
    raw = blocks.reshape(x.shape[0], -1)  # (4, bytes)
    relax = L.relaxation(fmt)
    const = relax.const(jnp.asarray(raw.reshape(-1, cls.type_size)))
    theta0 = relax.init(const)
    # at the start: the stored values exactly
    start = np.asarray(relax.values(theta0, const)).reshape(x.shape)
    assert np.array_equal(start, gguf.quants.dequantize(raw, cls.ggml_type).reshape(x.shape), equal_nan=True)
    theta = _random_theta(relax, theta0, rng)
    seen = np.asarray(jax.jit(relax.values)(theta, const)).reshape(x.shape)  # (4, 512)
    written = np.asarray(cls.pack(*relax.parts(theta, const))).reshape(raw.shape)
    decoded = gguf.quants.dequantize(written, cls.ggml_type).reshape(x.shape)
    assert not np.array_equal(written, raw)  # the point moved codes and scales
    np.testing.assert_array_equal(seen, decoded)
    # a decode program's forward values (no straight-through terms) are the loss's, bit for bit
    forward = jax.jit(relax.forward)(theta, const, relax.choice(theta, const))
    np.testing.assert_array_equal(np.asarray(forward).reshape(x.shape), seen)
    # and the gradient reaches every parameter through the straight-through rounding
    grad = jax.grad(lambda t: jnp.sum(relax.values(t, const) * jnp.asarray(x.reshape(-1, cls.block_size))))(theta)
    for name, g in grad.items():
        assert np.any(np.asarray(g) != 0), name


@pytest.mark.parametrize("fmt", ["iq2_xxs", "iq2_s", "iq3_xxs", "iq1_m"])
def test_each_codebook_group_takes_the_nearest_of_its_stored_points_neighbours(fmt):
    """The relaxation's choice, read through the per-format neighbour tables, is the float64 NumPy choice:
    among the ``NEIGHBOURS`` grid points nearest to the stored one (by the grid alone), the one nearest to
    the group's target, the stored value plus its learned offsets."""
    rng = np.random.default_rng(4)
    cls = decode.format_of(fmt)
    relax = L.relaxation(fmt)
    blocks = np.asarray(encode.quantize((0.02 * rng.standard_t(4, (8, 512))).astype(np.float32), fmt))
    const = relax.const(jnp.asarray(blocks.reshape(-1, cls.type_size)))
    theta = _random_theta(relax, relax.init(const), rng)
    idx = relax.choice(theta, const)["idx"]  # (n, G)
    grid = np.asarray(cls.grid_values(), np.float64)  # (K, g)
    stored = np.asarray(const["idx"])  # (n, G)
    sq = np.sum(grid * grid, axis=1)
    nearest = np.argsort(sq[:, None] + sq[None, :] - 2 * grid @ grid.T, axis=1, kind="stable")[:, :L.NEIGHBOURS]
    step = L.grid_step(gguf_grid(cls.quant))  # the lattice's step (iq1_m: 1, not its delta's)
    target = grid[stored] + step * np.asarray(theta["mag"], np.float64).reshape(*stored.shape, -1)
    cand = nearest[stored]  # (n, G, N)
    dist = np.sum((grid[cand] - target[:, :, None, :]) ** 2, axis=-1)  # (n, G, N)
    expected = np.take_along_axis(cand, np.argmin(dist, axis=-1)[..., None], axis=-1)[..., 0]
    assert np.any(expected != stored)  # the offsets moved points
    np.testing.assert_array_equal(np.asarray(idx), expected)


# --------------------------------------------------------------------------- config



@pytest.mark.parametrize("knobs, key, why", [
    ('round = "gptq"\nlearned_steps = 10', "learned_steps", 'only used with round = "learned"'),
    ('round = "ls"\nlearned_steps = 10', "learned_steps", 'only used with round = "learned"'),
    ('round = "learned"\nlearned_steps = -1', "learned_steps", "out of range"),
    ('round = "learned"\nimportance = false', "round", "needs calibration statistics"),
    ('round = "learned"\ngptq_damp = 0.0', "gptq_damp", "must be > 0"),
    ('round = "learnt"', "round", "is not one of"),
    ('budget_bpw = 2.7\nformats = ["q2_k"]\nround = "learned"\nsensitivity_round = "gptq"', "sensitivity_round",
     "has no effect"),
])
def test_learned_knobs_are_validated(tmp_path, knobs, key, why):
    config = write_world(tmp_path, variants=f'[[variant]]\nname = "x"\n{knobs}\n')
    with pytest.raises(InputError) as err:
        load_config(config)
    assert f"] {key}: " in str(err.value) and why in str(err.value) and "heal.toml" in str(err.value)


def test_learned_params_carry_gptq_and_steps(tmp_path):
    config = write_world(tmp_path, variants='[[variant]]\nname = "x"\nquant = "q8_0"\nround = "learned"\n'
                                            'gptq_damp = 0.5\nlearned_steps = 7\n'
                                            '[[variant]]\nname = "y"\nround = "gptq"\n')
    learned_v, gptq_v = load_config(config).variants
    params = QuantizeParams.of(learned_v)
    assert params.round == "learned" and params.learned_steps == 7 and params.gptq_damp == 0.5
    assert QuantizeParams.of(gptq_v).learned_steps is None and "learned_steps" not in gptq_v.knobs()
    assert learned_v.knobs()["learned_steps"] == 7 and learned_v.measured_round == "gptq"


# --------------------------------------------------------------------------- a small layer


def _small_layer(n_expert: int = 4, d: int = 256, f: int = 256, k: int = 2, tokens: int = 2048, seed: int = 0):
    """Float experts, correlated inputs, a random top-k routing with softmax weights, the float output."""
    from moeheal.pipeline.model.layers import moe_forward

    rng = np.random.default_rng(seed)
    w = {"ffn_gate_exps": rng.standard_t(4, (n_expert, f, d)), "ffn_up_exps": rng.standard_t(4, (n_expert, f, d)),
         "ffn_down_exps": rng.standard_t(4, (n_expert, d, f))}
    w = {name: (0.05 * v).astype(np.float32) for name, v in w.items()}
    x = (rng.normal(size=(tokens, d)) @ (rng.normal(size=(d, d)) / np.sqrt(d)) * 2.0).astype(np.float32)  # (T, d)
    logits = rng.normal(size=(tokens, n_expert)) * 2.0  # (T, E)
    experts = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)  # (T, k)
    top = np.exp(np.take_along_axis(logits, experts, axis=1))
    weights = (top / top.sum(axis=1, keepdims=True)).astype(np.float32)  # (T, k)
    yr = np.asarray(moe_forward({"gate_exps": w["ffn_gate_exps"], "up_exps": w["ffn_up_exps"],
                                 "down_exps": w["ffn_down_exps"]}, x, experts, weights))  # (T, d)
    return w, L.TokenSet(x, experts, weights, yr, yr)


def _held_out_error(tensors: dict[str, L.LearnedTensor], data: L.TokenSet) -> float:
    """sum ||MoE output - yr||^2 / sum ||yr||^2 with gguf-py's decoding of the bytes, float64."""
    from moeheal.pipeline.model.layers import moe_forward

    deq = {name: gguf.quants.dequantize(np.asarray(t.raw), decode.format_of(t.fmt).ggml_type).reshape(t.shape)
           for name, t in tensors.items()}
    y = np.asarray(moe_forward({"gate_exps": deq["ffn_gate_exps"], "up_exps": deq["ffn_up_exps"],
                                "down_exps": deq["ffn_down_exps"]}, data.x, data.experts, data.weights), np.float64)
    return float(np.sum((y - data.yr) ** 2) / np.sum(np.square(data.yr, dtype=np.float64)))


@pytest.mark.parametrize("fmt", ["q2_k", "tq2_0", "iq2_xxs"])  # one per relaxation family
def test_learning_lowers_the_held_out_moe_output_error_below_gptq(fmt):
    """GPTQ's bytes (per-expert Hessians of the training rows), then learning on the layer's output:
    the rows held out from the steps score the written bytes (gguf-py's decoding, float64) below
    GPTQ's. A third split, only measured, shows the curve's figures are the bytes' own."""
    from moeheal.kernels import importance as imp

    w, data = _small_layer()
    n = len(data)
    train, held, test = data.take(np.arange(n // 2)), data.take(np.arange(n // 2, 3 * n // 4)), \
        data.take(np.arange(3 * n // 4, n))
    stats = imp.expert_hidden_stats(w["ffn_gate_exps"], w["ffn_up_exps"], train.x, train.experts)
    mass, _ = imp.hessian_mass(stats, 0.0)
    hess = {"ffn_gate_exps": stats.sum_xx_t, "ffn_up_exps": stats.sum_xx_t, "ffn_down_exps": stats.sum_hh_t}
    start = {}
    for name, v in w.items():
        h = np.stack([np.asarray(damp_hessian(hess[name][e] / max(mass[e], 1), 0.01)) for e in range(v.shape[0])])
        start[name] = L.LearnedTensor(fmt, v.shape, encode.quantize_experts(v, fmt, None, h))
    settings = L.Settings(steps=24, batch_tokens=256, lr=0.01, eval_every=4, sub_lr=0.01, scale_lr=0.001,
                          optimizer="adam")
    raw, curve = L.learn_layer(start, {}, train, held, settings, {"test": test})
    learned = {name: L.LearnedTensor(fmt, t.shape, raw[name]) for name, t in start.items()}
    chosen = next(r for r in curve if r["split"] == "chosen")
    before, after = _held_out_error(start, held), _held_out_error(learned, held)
    assert chosen["step"] > 0 and after < before, (before, after)
    assert chosen["loss"] == pytest.approx(after, rel=1e-4)
    test_rows = {r["step"]: r["loss"] for r in curve if r["split"] == "test"}
    assert test_rows[0] == pytest.approx(_held_out_error(start, test), rel=1e-4)
    assert test_rows[chosen["step"]] == pytest.approx(_held_out_error(learned, test), rel=1e-4)


def test_programs_compiled_ahead_are_the_ones_learning_runs(caplog):
    """`prepare_tensors` compiles each (format, shape)'s decoding, update and hardening (3 programs per
    pair, in threads), and learning a layer of those formats and shapes afterwards compiles none of them:
    the jit finds them ready. Shapes of this test alone (3 experts), so no earlier test compiled them."""
    import logging

    w, data = _small_layer(n_expert=3, tokens=600)
    fmts = {"ffn_gate_exps": "q2_k", "ffn_up_exps": "iq2_xxs", "ffn_down_exps": "q2_k"}
    start = {name: L.LearnedTensor(fmts[name], v.shape, encode.quantize_experts(v, fmts[name])) for name, v in w.items()}
    settings = L.Settings(steps=3, batch_tokens=256, lr=0.01, eval_every=3, sub_lr=0.01, scale_lr=0.001,
                          optimizer="adam")
    jobs = [(t.fmt, t.shape) for t in start.values()]
    assert L.prepare_tensors(jobs, settings) == 3 * len(set(jobs))
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        L.learn_layer(start, {}, data.take(np.arange(400)), data.take(np.arange(400, 600)), settings)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
    assert compiled and not [m for m in compiled if "jit(decode)" in m or "jit(update)" in m], compiled


@pytest.mark.slow  # a world's dump for one unit, 16 s of a CI worker: `make test-slow`; the GPU runs take this path
def test_a_learned_unit_compiles_its_recipes_programs_ahead_where_a_device_would(tmp_path, monkeypatch):
    """On an accelerator the quantize unit compiles learned rounding's programs for its own formats and its
    recipe's (`learned.prepare_tensors`, with the unit's own settings) before its GPTQ rounding; the CPU
    leaves them to the jit. Here the unit is made to take the accelerator's path: it asks for every routed
    (role, format) of the layer with the schedule the layer learns with, and writes its layer."""
    from moeheal.pipeline.heal import HealRun
    from moeheal.pipeline.stages import quantize

    asked: list[tuple[list, L.Settings]] = []
    prepare = L.prepare_tensors
    monkeypatch.setattr(quantize, "on_accelerator", lambda: True)
    monkeypatch.setattr(L, "prepare_tensors", lambda jobs, settings: asked.append((list(jobs), settings))
                        or prepare(jobs, settings))
    config = write_world(tmp_path, variants='[[variant]]\nname = "x"\nquant = "q2_k"\nround = "learned"\n'
                                            'learned_steps = 2\n', moce_bonus=(0.0,))
    run = HealRun(load_config(config), log=lambda _: None)
    assert run.result(run.quantize(run.cfg.variants[0], 0)) is not None  # the unit and its dump, nothing after
    [(jobs, settings)] = asked
    assert sorted(jobs) == [("q2_k", (8, 256, 256))] * 3 and settings.steps == 2


def test_the_loss_is_the_layers_output_error_with_the_shared_expert():
    """layer_error on float weights against the project's routed forward and the shared expert's
    output: zero at the reference weights, and the summed squared difference elsewhere."""
    from moeheal.pipeline.model.layers import swiglu

    w, data = _small_layer(tokens=300)
    rng = np.random.default_rng(1)
    shared = {"ffn_gate_shexp": rng.normal(size=(128, 256)) * 0.05, "ffn_up_shexp": rng.normal(size=(128, 256)) * 0.05,
              "ffn_down_shexp": rng.normal(size=(256, 128)) * 0.05}
    shared = {k: v.astype(np.float32) for k, v in shared.items()}
    gate = (1 / (1 + np.exp(-data.x[:, 0]))).astype(np.float32)  # (T,) any per-token multiplier
    hh = np.asarray(swiglu(data.x, shared["ffn_gate_shexp"], shared["ffn_up_shexp"]))  # (T, f_s)
    target = data.yr + (hh @ shared["ffn_down_shexp"].T) * gate[:, None]  # (T, d)
    full = L.TokenSet(data.x, data.experts, data.weights, target, data.yr, gate)
    rows = [np.arange(0, 256), np.arange(256, 300)]
    cap = L.expert_capacity(full.experts, 4, rows)
    layouts, device_rows = L._layouts(full, rows, 4, cap, 256), L._device_rows(full)
    batches = [L._gather(device_rows, {k: v[i] for k, v in layouts.items()}) for i in range(2)]
    weights = {k: jnp.asarray(v) for k, v in {**w, **shared}.items()}
    exact = sum(float(L.layer_error(weights, b)) for b in batches)
    assert exact < 1e-6 * full.energy()
    moved = dict(weights, ffn_down_exps=weights["ffn_down_exps"] * 1.1)  # the routed output times 1.1
    error = sum(float(L.layer_error(moved, b)) for b in batches)
    assert error == pytest.approx(0.01 * full.energy(), rel=1e-3)


def test_relative_error_is_the_layers_output_error_in_float64():
    """`relative_error` of perturbed float experts against a float64 NumPy forward of the routed layer
    (batches of uneven fill included: 2048 rows in batches of 300)."""
    w, data = _small_layer(tokens=2048, seed=3)
    rng = np.random.default_rng(4)
    moved = {name: v + 0.01 * rng.normal(size=v.shape).astype(np.float32) for name, v in w.items()}
    y = routed_output(moved, data.x, data.experts, data.weights)  # (T, d)
    expected = np.sum((y - data.target) ** 2) / np.sum(np.square(data.yr, dtype=np.float64))
    assert expected > 1e-3  # the perturbation is visible
    np.testing.assert_allclose(L.relative_error(moved, data, batch_tokens=300), expected, rtol=1e-4)


@pytest.mark.parametrize("rows, steps, expected", [
    (7168, 0, (32, 256)),  # the demo's 8,192 tokens less the held-out eighth: at least 32 steps
    (57344, 0, (224, 256)),  # 65,536 tokens: one pass of 256-token steps
    (114688, 0, (224, 512)),  # 131,072: past 256 steps of a pass, the batch doubles
    (1 << 22, 0, (256, 16384)),
    (57344, 7, (7, 256)),  # learned_steps given: that many steps of 256 tokens
])
def test_the_default_schedule_is_one_pass_over_the_training_rows(rows, steps, expected):
    from moeheal.pipeline.stages.quantize import LEARNED_MAX_STEPS, learned_schedule

    got = learned_schedule(rows, steps)
    assert got == expected
    if not steps:  # one pass: every training row is reached, in at most LEARNED_MAX_STEPS steps
        assert got[0] * got[1] >= rows and (got[0] <= LEARNED_MAX_STEPS or got[1] == 256)


def test_each_pair_slot_holds_that_pair_and_the_loss_adds_no_repeated_rows():
    """`_batch_layout`'s slot of every (token, choice) pair is the expert's row holding that token with
    that routing weight, and a row past the batch's tokens points at the zero slot; `layer_error` sums
    a token's pairs by gathering them, with no scatter-add in its program (on a GPU a scatter-add of
    a token's k outputs runs as atomics in no fixed order: a new loss, and new bytes, every run)."""
    rng = np.random.default_rng(5)
    n_expert, k, rows = 6, 3, 40
    experts = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(33)]).astype(np.int32)  # (33, k)
    weights = rng.random((33, k)).astype(np.float32)
    cap = L.expert_capacity(experts, n_expert, [np.arange(33)])
    tok, wt, slot = L._batch_layout(experts, weights, n_expert, rows, cap)
    e, c = np.divmod(slot[:33], cap)  # (33, k) x2
    np.testing.assert_array_equal(e, experts)
    np.testing.assert_array_equal(tok[e, c], np.repeat(np.arange(33)[:, None], k, axis=1))
    np.testing.assert_array_equal(wt[e, c], weights)
    assert (slot[33:] == n_expert * cap).all()
    assert len(np.unique(slot[:33])) == 33 * k
    w, data = _small_layer(tokens=256)
    cap = L.expert_capacity(data.experts, 4, [np.arange(256)])
    layouts, device_rows = L._layouts(data, [np.arange(256)], 4, cap, 256), L._device_rows(data)
    batch = L._gather(device_rows, {name: v[0] for name, v in layouts.items()})
    program = str(jax.make_jaxpr(L.layer_error)({n: jnp.asarray(v) for n, v in w.items()}, batch))
    assert "scatter-add" not in program and "scatter_add" not in program


def test_a_new_mix_of_formats_compiles_no_new_program():
    """A recipe gives layers different mixes of formats. Each tensor's decoding and update are compiled per
    (format, shape) and the layer's loss and gradient once per shape, so a second layer whose three tensors
    mix the same two formats the other way round compiles nothing: a program per mix was compiled again
    in most layers of a 30B recipe (seconds each on a GPU)."""
    w, data = _small_layer(n_expert=2, tokens=1024)  # gate, up and down all (2, 256, 256)
    train, held = data.take(np.arange(768)), data.take(np.arange(768, 1024))
    settings = L.Settings(steps=2, batch_tokens=256, lr=0.01, eval_every=2)
    mixes = [{"ffn_gate_exps": "q2_k", "ffn_up_exps": "iq2_xxs", "ffn_down_exps": "q2_k"},
             {"ffn_gate_exps": "iq2_xxs", "ffn_up_exps": "q2_k", "ffn_down_exps": "iq2_xxs"}]
    programs = []
    for mix in mixes:
        start = {name: L.LearnedTensor(fmt, w[name].shape, encode.quantize_experts(w[name], fmt)) for name, fmt in mix.items()}
        L.learn_layer(start, {}, train, held, settings)
        shape = tuple(w["ffn_gate_exps"].shape)
        programs.append((L._loss_and_grad._cache_size(), L._set_error._cache_size(),
                         {fmt: (L._decoder(fmt, shape)._cache_size(), L._updater(fmt, shape, "adam")._cache_size())
                          for fmt in ("q2_k", "iq2_xxs")}))
    assert programs[1] == programs[0]  # the second mix compiled nothing
    assert programs[0][2] == {"q2_k": (1, 1), "iq2_xxs": (1, 1)}  # one decoding and one update per (format, shape)
