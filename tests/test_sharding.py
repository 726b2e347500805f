"""quantize_experts sharded over several devices writes the bytes of a one-device run.

XLA fixes the CPU device count when the backend starts, so the check runs in a
fresh interpreter with four host devices. Six experts over four devices, one
expert per device per step: the second step is half padding. One expert per
device also keeps this jaxlib's batched CPU LAPACK kernels from waiting on a
thread pool that the other devices' programs hold (a hang on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SHARDED_EQUALS_ONE_DEVICE = textwrap.dedent('''
    import jax
    import numpy as np

    from moeheal.kernels import encode
    from moeheal.kernels.gptq import damp_hessian

    assert len(jax.devices()) == 4
    rng = np.random.default_rng(0)
    n_expert, rows, cols = 6, 64, 256
    w = (0.02 * rng.standard_t(4, (n_expert, rows, cols))).astype(np.float32)  # (E, rows, cols)
    x = rng.standard_normal((n_expert, 2 * cols, cols)).astype(np.float32)  # (E, N, cols)
    hessians = np.stack([np.asarray(damp_hessian(xe.T @ xe / len(xe), 0.01)) for xe in x])  # (E, cols, cols)
    importance = np.einsum("ecc->ec", hessians)  # (E, cols)
    batch = rows * cols  # one expert per device per step

    devices_used = []
    run_batch = encode.experts_batch_jit

    def recording_batch(*args):
        raw, ok = run_batch(*args)
        devices_used.append(len(raw.sharding.device_set))
        return raw, ok

    encode.experts_batch_jit = recording_batch
    for fmt in ("tq2_0", "q2_k", "iq2_xxs"):
        for h in (None, hessians):
            devices_used.clear()
            sharded = encode.quantize_experts(w, fmt, importance, h, batch_weights=batch)
            assert devices_used == [4, 4], (fmt, devices_used)  # two steps of four experts, the second padded
            one = encode.quantize_experts(w, fmt, importance, h, batch_weights=batch, devices=jax.devices()[:1])
            assert devices_used[2:] == [1] * n_expert, (fmt, devices_used)
            assert sharded.shape == one.shape and np.array_equal(sharded, one), (fmt, h is None)

    singular = hessians.copy()
    singular[3] = 0.0
    try:
        encode.quantize_experts(w, "tq2_0", importance, singular, batch_weights=batch)
    except ValueError as err:
        assert "not positive definite" in str(err)
    else:
        raise AssertionError("a singular Hessian on another device was accepted")
    print("ok")
''')


def test_quantize_experts_sharded_over_four_devices_equals_one_device() -> None:
    # compiling is most of this run: unoptimised, as the compile_bound files (tests/conftest.py)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SHARDED_EQUALS_ONE_DEVICE], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]
