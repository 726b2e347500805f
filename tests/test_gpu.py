"""The same kernels and runner on a GPU backend agree with the CPU (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from moeheal.kernels import decode, encode
from moeheal.kernels.gptq import GptqSchedule, damp_hessian

pytestmark = pytest.mark.gpu
DEMO_GGUF = Path(__file__).resolve().parents[1] / "demo" / "model" / "demo-q8_0.gguf"


def on_cpu(fn, *args):
    with jax.default_device(jax.devices("cpu")[0]):
        return fn(*args)


@pytest.mark.parametrize("fmt", ["tq2_0", "iq4_nl", "q8_0"])
def test_dequantize_is_bit_identical_on_gpu(fmt):
    rng = np.random.default_rng(0)
    w = rng.standard_t(4, size=(64, 512)).astype(np.float32)
    raw = on_cpu(encode.quantize, w, fmt)
    gpu = decode.dequantize(raw, fmt, w.shape)
    cpu = on_cpu(decode.dequantize, raw, fmt, w.shape)
    np.testing.assert_array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


@pytest.mark.parametrize("fmt", ["tq2_0", "iq4_nl"])
def test_quantize_on_gpu_matches_cpu_error(fmt):
    """Scale search may break float ties differently; the error it reaches may not differ."""
    rng = np.random.default_rng(1)
    w = rng.standard_t(4, size=(128, 1024)).astype(np.float32)
    importance = rng.gamma(2.0, size=1024).astype(np.float32)
    errors = []
    for raw in (encode.quantize(w, fmt, importance), on_cpu(encode.quantize, w, fmt, importance)):
        w_hat = decode.dequantize(raw, fmt, w.shape)
        errors.append(float(np.sum(importance * (w - w_hat) ** 2)))
    assert errors[0] == pytest.approx(errors[1], rel=1e-4)


def test_gptq_on_gpu_reaches_the_cpu_error():
    """The GPU rounds GPTQ 32 columns per step from a float64 factor, the CPU the whole block per
    step from a float32 one: the same method, the same output error to within near-tie flips."""
    rng = np.random.default_rng(3)
    cols = 512
    x = rng.standard_normal((4 * cols, cols)) @ (np.eye(cols) + rng.standard_normal((cols, cols)) / np.sqrt(cols))
    h = np.asarray(damp_hessian(x.T @ x / len(x), 0.01), np.float32)  # (cols, cols)
    w = (0.02 * rng.standard_t(4, size=(64, cols))).astype(np.float32)
    assert encode.gptq_schedule() == GptqSchedule(encode.ACCELERATOR_GPTQ_UPDATE_WIDTH, float64_factor=True)
    assert on_cpu(encode.gptq_schedule) == GptqSchedule()
    errors = []
    for raw in (encode.quantize(w, "q2_k", hessian=h), on_cpu(encode.quantize, w, "q2_k", None, h)):
        diff = (w - decode.dequantize(raw, "q2_k", w.shape)).astype(np.float64)  # (rows, cols)
        errors.append(float(np.sum((diff @ h) * diff)))
    assert errors[0] == pytest.approx(errors[1], rel=2e-2)


@pytest.mark.skipif(not DEMO_GGUF.exists(), reason="demo model absent")
def test_runner_logits_on_gpu_match_cpu():
    from moeheal.pipeline.gguf.model import GGUFModel
    from moeheal.pipeline.model.runner import Runner

    model = GGUFModel(DEMO_GGUF)
    tokens = np.random.default_rng(2).integers(0, model.hp.vocab_size, (2, 256)).astype(np.int32)
    gpu = Runner(model).forward(tokens)
    cpu = on_cpu(Runner(model).forward, tokens)
    rel = np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu)
    assert rel < 1e-4


def test_iq1_m_bytes_on_gpu_are_the_cpus():
    """IQ1_M's search keeps ggml's float32 order (products rounded before their sums, sums in order,
    divisions as divisions; kernels/iq1m_encode.py), so its bytes may not depend on the backend: the
    GPU's equal the CPU's, which tests/test_iquants.py ties to llama.cpp's byte for byte."""
    rng = np.random.default_rng(7)
    w = (0.02 * rng.standard_t(3, size=(64, 1024))).astype(np.float32)  # heavy tails, as the experts
    w[0] = 0.0  # degenerate rows: all zero, a lone spike, values on few levels (ties in the sort)
    w[1, :] = 0.0
    w[1, 7] = 1.5
    w[2] = np.round(w[2] * 100) / 100
    importance = rng.gamma(0.7, 1.0, size=1024).astype(np.float32)
    importance[16:32] = 0.0  # a sub-block no candidate scores
    for imp in (importance, None):
        gpu = np.asarray(encode.quantize(w, "iq1_m", imp))
        cpu = np.asarray(on_cpu(encode.quantize, w, "iq1_m", imp))
        assert np.array_equal(gpu, cpu), f"{np.mean(np.any(gpu != cpu, axis=-1)):.1%} of rows differ"
