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


def random_routed_layer(rng: np.random.Generator, n: int, k: int, n_expert: int, d: int = 256, f: int = 128):
    """Random float32 experts gate/up (E, f, d), down (E, d, f) on the default device, n inputs (N, d) and a
    random top-k routing: experts (N, k) int32, weights (N, k)."""
    import jax.numpy as jnp

    w = {"ffn_gate_exps.weight": 0.05 * rng.standard_normal((n_expert, f, d)),
         "ffn_up_exps.weight": 0.05 * rng.standard_normal((n_expert, f, d)),
         "ffn_down_exps.weight": 0.05 * rng.standard_normal((n_expert, d, f))}
    w = {name: jnp.asarray(v, jnp.float32) for name, v in w.items()}
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)  # (N, d)
    experts = jnp.asarray(np.argsort(-rng.standard_normal((n, n_expert)), axis=1)[:, :k].astype(np.int32))  # (N, k)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), n).astype(np.float32))  # (N, k)
    return w, x, experts, weights


@pytest.mark.parametrize("fmt", ["tq2_0", "iq4_nl", "q8_0"])
def test_dequantize_is_bit_identical_on_gpu(fmt):
    rng = np.random.default_rng(0)
    w = rng.standard_t(4, size=(64, 512)).astype(np.float32)
    raw = on_cpu(encode.quantize, w, fmt)
    gpu = decode.dequantize(raw, fmt, w.shape)
    cpu = on_cpu(decode.dequantize, raw, fmt, w.shape)
    np.testing.assert_array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


def test_fp16_round_survives_fusion_on_gpu():
    """A tuned scale's rounding to fp16 inside a fused GPU program, as e2e's forward runs it: a cast to
    float16 and back may be dropped there (XLA's excess precision), `fp16_round` may not."""
    import jax.numpy as jnp

    from moeheal.kernels.e2e import fp16_ste
    from moeheal.kernels.formats import fp16_round

    x = np.float32(1) + np.float32(2.0**-13) * np.arange(4096, dtype=np.float32)  # (n,) between fp16 values
    want = x.astype(np.float16).astype(np.float32) * np.float32(3)  # (n,)
    for rounding in (fp16_round, fp16_ste):
        got = np.asarray(jax.jit(lambda v, f=rounding: f(v) * 3)(jnp.asarray(x)))  # (n,)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


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


def test_moe_forward_on_gpu_batches_small_loads_deterministically():
    """At e2e's load (one 512-token sequence, 128 experts, 8 a token) the GPU runs the batched expert blocks:
    its output is the CPU scan's to float32 rounding, and its gradient the same bits on every run."""
    import jax.numpy as jnp

    from moeheal.pipeline.model import layers as M

    n, k, n_expert = 512, 8, 128
    assert n * k <= M.BATCHED_MAX_LOAD * n_expert
    w, x, experts, weights = random_routed_layer(np.random.default_rng(5), n, k, n_expert)
    got = np.asarray(M.moe_forward(w, x, experts, weights))
    ref = on_cpu(lambda *a: np.asarray(M.moe_forward(*a)), w, x, experts, weights)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    grad = jax.jit(jax.grad(lambda w_, x_: jnp.sum(M.moe_forward(w_, x_, experts, weights) ** 2), argnums=(0, 1)))
    first, second = (jax.tree.leaves(grad(w, x)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_routed_output_on_gpu_groups_large_loads_deterministically():
    """Above the batched form's loads, calibrate's and the sensitivity measure's routed outputs
    (`moe_output`) run the grouped expert blocks on a GPU: the CPU scan's output to float32 rounding, and
    the same bits on every run (no scatter-add onto the tokens)."""
    from moeheal.pipeline.model import layers as M

    n, k, n_expert = 4096, 8, 32
    assert n * k > M.BATCHED_MAX_LOAD * n_expert
    w, x, experts, weights = random_routed_layer(np.random.default_rng(6), n, k, n_expert)
    first, second = (np.asarray(M.moe_output(w, x, experts, weights)) for _ in range(2))
    ref = on_cpu(lambda *a: np.asarray(M.moe_forward(*a)), w, x, experts, weights)
    np.testing.assert_allclose(first, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(first, second)


def test_learned_rounding_writes_the_same_bytes_on_every_gpu_run():
    """A layer's learned rounding twice on the GPU: the same bytes (a token's pair outputs are gathered and
    summed in k's order, not scatter-added with atomics) and the same curve."""
    from moeheal.kernels import learned
    from moeheal.pipeline.model import layers as M

    rng = np.random.default_rng(6)
    n_expert, d, f, k, n = 16, 256, 256, 4, 2048
    w = {name: (0.05 * rng.standard_t(4, size=shape)).astype(np.float32) for name, shape in
         (("ffn_gate_exps", (n_expert, f, d)), ("ffn_up_exps", (n_expert, f, d)), ("ffn_down_exps", (n_expert, d, f)))}
    x = rng.standard_normal((n, d)).astype(np.float32)  # (T, d)
    experts = np.argsort(-rng.standard_normal((n, n_expert)), axis=1)[:, :k].astype(np.int32)  # (T, k)
    weights = rng.dirichlet(np.ones(k), n).astype(np.float32)  # (T, k)
    yr = np.asarray(M.moe_forward({name + ".weight": v for name, v in w.items()}, x, experts, weights))  # (T, d)
    data = learned.TokenSet(x, experts, weights, yr, yr)
    tensors = {name: learned.LearnedTensor("q2_k", v.shape, encode.quantize_experts(v, "q2_k")) for name, v in w.items()}
    settings = learned.Settings(steps=16, batch_tokens=256, lr=0.05, eval_every=4, sub_lr=0.02, scale_lr=0.002)
    runs = [learned.learn_layer(tensors, {}, data.take(slice(0, 1792)), data.take(slice(1792, n)), settings)
            for _ in range(2)]
    assert next(r["step"] for r in runs[0][1] if r["split"] == "chosen") > 0  # learned bytes, not the start's
    for name in w:
        np.testing.assert_array_equal(runs[0][0][name], runs[1][0][name])
    assert [r["loss"] for r in runs[0][1]] == [r["loss"] for r in runs[1][1]]


def moe_float64(decoded: dict, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The routed output in float64 NumPy: sum_k w_tk down_e (silu(gate_e x_t) * up_e x_t), e = experts_tk."""
    from moeheal.pipeline.model.layers import EXPERT_TENSORS  # gate, up, down

    gate, up, down = (np.asarray(decoded[name], np.float64) for name in EXPERT_TENSORS)
    x = np.asarray(x, np.float64)  # (N, d)
    out = np.zeros_like(x)  # (N, d)
    for e in np.unique(experts):
        t, slot = np.nonzero(experts == e)  # the pairs routed to e
        g, u = x[t] @ gate[e].T, x[t] @ up[e].T  # (n_e, f) x2
        h = g / (1.0 + np.exp(-g)) * u  # (n_e, f)
        np.add.at(out, t, (h @ down[e].T) * weights[t, slot][:, None])  # (n_e, d)
    return out


def test_packed_experts_on_gpu_are_the_decoded_experts():
    """e2e's tuner at its step load on the GPU: `PackedExperts` in the batched product as close to a
    float64 reference as every expert decoded first (two programs, so not the same bits on a GPU),
    and the scales' gradient the same bits on every run."""
    import jax.numpy as jnp

    from moeheal.kernels.decode import format_of
    from moeheal.pipeline.model import layers as M
    from moeheal.pipeline.model.tuner import BlockDecoder

    rng = np.random.default_rng(8)
    n, k, n_expert, d, f = 512, 8, 128, 256, 256
    fmt = format_of("q2_k")
    blocks = {name: jnp.asarray(on_cpu(encode.quantize_experts, (0.05 * rng.standard_normal((n_expert, f, d))).astype(
        np.float32), "q2_k").reshape(n_expert, -1, fmt.type_size)) for name in M.EXPERT_TENSORS}
    theta = {name: [jnp.asarray(0.01 * rng.standard_normal((n_expert, b.shape[1], 1)), jnp.float32)
                    for _ in fmt.fp16_parts] for name, b in blocks.items()}

    def packed(th):
        return {name: M.PackedExperts(blocks[name], tuple(th[name]), (), BlockDecoder(fmt), (n_expert, f, d))
                for name in blocks}

    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)  # (N, d)
    experts = jnp.asarray(np.argsort(-rng.standard_normal((n, n_expert)), axis=1)[:, :k].astype(np.int32))  # (N, k)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), n).astype(np.float32))  # (N, k)
    assert n * k <= M.PACKED_MAX_LOAD * n_expert
    got = np.asarray(M.moe_forward(packed(theta), x, experts, weights))
    decoded = {name: p.decoded() for name, p in packed(theta).items()}
    want = np.asarray(M._moe_batched(decoded, x, experts, weights))
    ref = moe_float64({name: np.asarray(v) for name, v in decoded.items()}, np.asarray(x), np.asarray(experts),
                      np.asarray(weights))
    err_packed, err_decoded = np.abs(got - ref).max(), np.abs(want - ref).max()
    scale = np.abs(ref).max()
    assert err_packed <= 1e-5 * scale and err_decoded <= 1e-5 * scale, (
        f"largest error against float64: packed {err_packed:.3g}, decoded {err_decoded:.3g}, of outputs up to "
        f"{scale:.3g}")
    grad = jax.jit(jax.grad(lambda th: jnp.sum(M.moe_forward(packed(th), x, experts, weights) ** 2)))
    first, second = (jax.tree.leaves(grad(theta)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
