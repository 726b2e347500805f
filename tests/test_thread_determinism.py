"""A unit's bytes do not depend on the host's thread counts (issue 57): the same quantize unit built
with 1, 2 and 4 threads gives the same bytes on the GPTQ and learned paths of each format family
(k-quants: q2_k, i-quants: iq2_xxs, t-quants: tq2_0), and calibrate's ridge the same floats.

The BLAS libraries read their thread count when they load (`OMP_NUM_THREADS`,
`OPENBLAS_NUM_THREADS`, else the CPUs the process may use), and XLA's CPU client sizes its pool
when it starts, so each build runs in a fresh interpreter with its own environment. The worker
takes the quantize stage's path at a small layer: its importance and Hessians
(`layer_importance`), GPTQ (`encode.quantize_experts`), then learned rounding from GPTQ's bytes
(`learned.learn_layer`), with no thread setting of its own: the kernels hold the host's BLAS at
one thread where it decides bytes (`kernels.threads`); the ridge runs under the limit its unit
holds. 256 columns (2 experts, seed 12): OpenBLAS splits the factorisation of H over threads at
that size, and before the fix 1 and 2 threads gave other GPTQ bytes (so other learned bytes) in
every family here, on the project's 2-core machine. The builds share JAX's compilation cache
(tests/conftest.py), so only the first compiles.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

FORMATS = ("q2_k", "iq2_xxs", "tq2_0")
# What a caller may set the thread counts with: the BLAS libraries read theirs when they load, XLA's CPU
# client its pool's size when it starts.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PJRT_NPROC")

WORKER = textwrap.dedent('''
    import sys

    import numpy as np

    from moeheal.kernels import encode, learned
    from moeheal.kernels.threads import one_blas_thread
    from moeheal.pipeline.stages.calibrate import ridge_cv_rows
    from moeheal.pipeline.stages.quantize import QuantizeParams, layer_importance
    from moeheal.kernels.ridge import matrix_rank, ridge_stats, solve_ridge

    out, formats = sys.argv[1], sys.argv[2].split(",")
    rng = np.random.default_rng(12)
    n_expert, d, f, tokens = 2, 256, 256, 512
    mix = np.eye(d) + 2.0 * rng.standard_normal((d, d)) / np.sqrt(d)  # correlated inputs: GPTQ has work to do
    x = (rng.standard_normal((tokens, d)) @ mix).astype(np.float32)  # (T, d)
    experts = np.stack([rng.permutation(n_expert)[:2] for _ in range(tokens)]).astype(np.int32)  # (T, 2)
    routing = rng.dirichlet([1.0, 1.0], tokens).astype(np.float32)  # (T, 2)
    w = {"ffn_gate_exps": (0.05 * rng.standard_t(4, (n_expert, f, d))).astype(np.float32),
         "ffn_up_exps": (0.05 * rng.standard_t(4, (n_expert, f, d))).astype(np.float32),
         "ffn_down_exps": (0.05 * rng.standard_t(4, (n_expert, d, f))).astype(np.float32)}
    y = np.zeros((tokens, d), np.float32)  # the float layer's routed output, learned rounding's target
    for k in range(2):
        for e in range(n_expert):
            rows = experts[:, k] == e
            g, u = x[rows] @ w["ffn_gate_exps"][e].T, x[rows] @ w["ffn_up_exps"][e].T
            y[rows] += routing[rows, k:k + 1] * ((g / (1 + np.exp(-g)) * u) @ w["ffn_down_exps"][e].T)
    params = QuantizeParams(quant=None, round="gptq", importance=True, beta_gate_up=0.5, beta_down=0.5,
                            down_blend_tokens=16.0, gptq_damp=0.01, gptq_shrink=64.0, gptq_router_weighted=True)
    plan = layer_importance(w, x, experts, routing, params)
    arrays = {}
    for fmt in formats:
        gptq = {name: encode.quantize_experts(w[name], fmt, *plan[name]) for name in w}
        arrays |= {f"{fmt}/gptq/{name}": raw for name, raw in gptq.items()}
        tokens_set = learned.TokenSet(x, experts, routing, y, y)
        tensors = {name: learned.LearnedTensor(fmt, w[name].shape, raw) for name, raw in gptq.items()}
        settings = learned.Settings(steps=2, batch_tokens=128, lr=0.01, eval_every=1, sub_lr=0.01, scale_lr=0.001)
        raw, curve = learned.learn_layer(tensors, {}, tokens_set.take(np.arange(384)),
                                         tokens_set.take(np.arange(384, tokens)), settings)
        arrays |= {f"{fmt}/learned/{name}": value for name, value in raw.items()}
        arrays[f"{fmt}/learned/curve"] = np.array([row["loss"] for row in curve])
    # calibrate's ridge on the shared expert's Z (T, f_s), under the limit its unit holds
    z = rng.standard_normal((tokens, 384)).astype(np.float32)
    y_q = (0.9 * y + 0.05 * rng.standard_normal(y.shape)).astype(np.float32)
    with one_blas_thread():
        gram, cross, _, _ = ridge_stats(z, y - y_q)
        rows, _, _ = ridge_cv_rows(z, y, y_q, gram, matrix_rank(gram), 6.0, 1.0, refit_alpha=True)
        arrays["ridge/fit"] = solve_ridge(gram, cross, 6.0)
    arrays["ridge/cv"] = np.array([[row["rel_gain"], row["dof"]] for row in rows])
    np.savez(out, **arrays)
''')


def thread_settings() -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each build's (command prefix, environment): n = 1, 2 and 4 BLAS threads (OpenBLAS runs no more
    than there are CPUs: on 2 cores, 4 is 2) and n threads in XLA's own pool (`PJRT_NPROC`, which it
    takes whatever the CPUs); the one-thread build also on one CPU (`taskset`, where it is at hand),
    as a scheduler that pins a task would run it."""
    base = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    settings = {f"{n} threads": ([], {**base, **{k: str(n) for k in THREAD_VARIABLES}}) for n in (1, 2, 4)}
    cpus = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") and len(cpus) > 1:
        settings["1 threads"] = (["taskset", "-c", str(cpus[0])], settings["1 threads"][1])
    return settings


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """Every setting's arrays, by setting."""
    root = tmp_path_factory.mktemp("threads")
    results = {}
    for name, (prefix, env) in thread_settings().items():
        out = root / f"{name.replace(' ', '_')}.npz"
        done = subprocess.run([*prefix, sys.executable, "-P", "-c", WORKER, str(out), ",".join(FORMATS)],
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        with np.load(out) as arrays:
            results[name] = dict(arrays)
    return results


def differing(builds: dict[str, dict[str, np.ndarray]], prefix: str) -> list[str]:
    """The arrays under `prefix` whose bytes differ between any two settings, with the settings."""
    first, *others = builds
    keys = [k for k in builds[first] if k.startswith(prefix)]
    assert keys
    return [f"{key}: {first} != {other}" for key in keys for other in others
            if builds[first][key].tobytes() != builds[other][key].tobytes()]


@pytest.mark.parametrize("path", ["gptq", "learned"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantize_units_bytes_do_not_depend_on_the_thread_count(builds, fmt: str, path: str) -> None:
    assert differing(builds, f"{fmt}/{path}/") == []


def test_calibrates_ridge_diagnostics_do_not_depend_on_the_thread_count(builds) -> None:
    assert differing(builds, "ridge/") == []


def test_the_stages_with_host_linear_algebra_hold_one_blas_thread(monkeypatch, tmp_path) -> None:
    """quantize, calibrate and sensitivity build their units inside `one_blas_thread`, whatever the
    caller set: each unit's work (stubbed here) sees every BLAS library at one thread."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from moeheal.pipeline.stages import calibrate, quantize, sensitivity

    seen = []

    def work(*args, **kwargs):
        seen.append(sorted({lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}))
        return sensitivity.pa.table({"x": [1]})

    for module, name in ((quantize, "quantize_layer"), (calibrate, "calibrate_layer"),
                         (sensitivity, "measure_sensitivity")):
        monkeypatch.setattr(module, name, work)
        monkeypatch.setattr(module, "open_model", lambda path: type("Model", (), {"hp": None, "moe_layers": (0,)}))
        monkeypatch.setattr(module, "open_dump", lambda *args: None)
    monkeypatch.setattr(quantize, "layer_formats", lambda *args: {})
    monkeypatch.setattr(sensitivity, "write_parquet", lambda *args: None)
    path = Path(tmp_path)
    with threadpool_limits(limits=2, user_api="blas"):
        quantize.build_quantize(path, quantize.QuantizeParams(quant={}, round="ls", importance=False, layer=0),
                                source=path, log=print)
        calibrate.build_calibrate(path, calibrate.CalibrateParams(alpha=True, cal_tokens=0, layer=0), source=path,
                                  quantized=path, dump=path, log=print)
        sensitivity.build_sensitivity(path, None, source=path, dump=path, unseen=path, guidance=path, log=print)
    assert seen == [[1]] * 3
