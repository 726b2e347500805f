"""Session-wide tiny GGUF models (built once per test run, a few seconds each)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The repository's top-level folders share names with installed distributions (`kernels` is Hugging
# Face's, which transformers imports), so the root is never ahead of site-packages here (DESIGN.md,
# Imports): pytest imports the tests by file (`--import-mode=importlib`, pyproject.toml), `python -m
# pytest` without `-P` put the working directory first, which is dropped, and the root comes last, where
# it provides `bench` (bench/inputs/: the tiny models and worlds; the scripts test_bench_tools checks) and
# nothing an installed distribution has.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO]
sys.path.append(str(REPO))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# JAX's persistent compilation cache, shared by both test workers, every test file of a run and the
# `moeheal` processes tests start (so set in the environment), and by later runs in this checkout: the
# small healed worlds of many files compile the same kernels at the same shapes, and on the CPU the
# compiling is a large part of what a small world costs. Every program is cached, however fast it
# compiled. The key includes JAX's version, the backend and the program, so a stale entry is never used.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The many small worlds the tests heal publish their reports without PNGs (drawing them is seconds per
# publish); files marked `plots` draw them (`_plots_where_marked`).
os.environ.setdefault("MOEHEAL_PLOTS", "0")

from moeheal.pipeline.model.compile_cache import library_gemms  # noqa: E402

# The products as every moeheal command runs them (cuBLAS, not autotuned Triton GEMM fusions), before
# JAX's backend starts: a GPU test checks the programs a heal runs. A CPU ignores the flag.
library_gemms()

import jax  # noqa: E402
import pytest  # noqa: E402

from bench.inputs.ggufs import make_tiny_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen2moe(tmp_path_factory) -> Path:
    """Random 2-layer qwen2moe (shared expert, qkv biases), F32 matrices."""
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2moe-f32.gguf", arch="qwen2moe", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3moe(tmp_path_factory) -> Path:
    """Random 2-layer qwen3moe (q/k norms, no shared expert), F32 matrices."""
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe-f32.gguf", arch="qwen3moe", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2moe_q8(tmp_path_factory) -> Path:
    """The qwen2moe recipe with Q8_0 matrices (routers, norms, biases stay F32)."""
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2moe-q8_0.gguf", arch="qwen2moe", seed=2,
                          matrix_type="q8_0")


@pytest.fixture(scope="session")
def healed_world(tmp_path_factory):
    """bench/inputs/healworld.py's default world, healed once per test process: (heal.toml, its HealRun).

    Tests that only read it, or copy it before changing anything, share it (the end-to-end tests,
    the published lake's trust and safety tests), so the whole suite heals this world once per worker."""
    from moeheal.pipeline.config import load_config
    from moeheal.pipeline.heal import HealRun
    from bench.inputs.healworld import write_world

    config = write_world(tmp_path_factory.mktemp("healed_world"))
    run = HealRun(load_config(config), log=lambda message: None)
    run.heal()
    return config, run


def pytest_addoption(parser) -> None:
    parser.addoption("--optimize-compile-bound", action="store_true",
                     help="compile the `compile_bound` files with XLA's optimisations too (the A/B in bench/RESULTS.md)")


@pytest.fixture(autouse=True, scope="module")
def _compile_bound_modules_compile_cheaply(request):
    """Files marked `compile_bound` (small arrays, many programs: the kernels' numerics) compile
    without XLA's backend optimisations, which take most of their time and cost nothing in their
    arithmetic (measured: a third off those files). Compiled programs are dropped on the way in and
    out, so that no other file runs one compiled this way; the persistent cache keys the option."""
    if request.node.get_closest_marker("compile_bound") is None or request.config.getoption("optimize_compile_bound"):
        yield
        return
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _plots_where_marked(request):
    """Files marked `plots` (the report's own tests) draw them: `MOEHEAL_PLOTS` unset for the file."""
    if request.node.get_closest_marker("plots") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MOEHEAL_PLOTS", raising=False)
        yield


# The files that keep one worker a minute or more (`--durations`, bench/RESULTS.md "Test suite"), longest
# first: `--dist loadfile --no-loadscope-reorder` (the Makefile) hands files out in collection order, so a
# long file handed out last would leave the other worker idle while it runs; handed out first, the short
# files fill in around them.
RUN_FIRST = ("test_init_heal.py", "test_scaleout.py", "test_wheel_init.py", "test_budget.py", "test_trust.py",
             "test_thread_determinism.py", "test_arch_deepseek2.py", "test_guidance.py", "test_e2e.py")


def pytest_collection_modifyitems(config, items) -> None:
    """`gpu` tests run only where JAX sees a GPU; `llamacpp` tests only with LLAMA_CPP_DIR set; the
    files of `RUN_FIRST` first, in its order (the same order on every worker)."""
    first = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest as collected
    has_gpu = jax.default_backend() in ("gpu", "cuda", "rocm", "METAL")
    llama = os.environ.get("LLAMA_CPP_DIR")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU JAX backend (have {jax.default_backend()})"))
        if "llamacpp" in item.keywords and not (llama and Path(llama, "bin").is_dir()):
            item.add_marker(pytest.mark.skip(reason="needs llama.cpp binaries under LLAMA_CPP_DIR/bin"))
