"""Every heal turns JAX's persistent compilation cache on, outside the lake, unless the caller chose one,
and leaves a GPU's matrix products to the vendor's library unless the caller's XLA flags say otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from moeheal.pipeline.model import compile_cache


@pytest.fixture
def no_cache_chosen(monkeypatch):
    """JAX's cache setting as a user's fresh process has it (the tests' own cache put back after)."""
    before = {name: getattr(jax.config, name) for name in ("jax_compilation_cache_dir",
                                                           "jax_persistent_cache_min_compile_time_secs",
                                                           "jax_compilation_cache_max_size")}
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for name, value in before.items():
        jax.config.update(name, value)


def test_the_cache_is_under_the_users_cache_folder(no_cache_chosen, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.enable_compile_cache() == tmp_path / "moeheal" / "xla"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "moeheal" / "xla")
    assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_BYTES


def test_the_environment_moves_or_turns_off_the_cache(no_cache_chosen, monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert compile_cache.enable_compile_cache() == tmp_path / "elsewhere"
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(compile_cache.CACHE_ENV, "")
    assert compile_cache.enable_compile_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


def test_a_cache_the_caller_chose_is_kept(no_cache_chosen, monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
    assert compile_cache.enable_compile_cache() is None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "set"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert compile_cache.enable_compile_cache() is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "set")


def test_gemm_flag_is_added_once_and_a_callers_choice_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    compile_cache.library_gemms()
    compile_cache.library_gemms()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {compile_cache.GEMM_FLAG}=false"
    monkeypatch.setenv("XLA_FLAGS", f"{compile_cache.GEMM_FLAG}=true")
    compile_cache.library_gemms()
    assert os.environ["XLA_FLAGS"] == f"{compile_cache.GEMM_FLAG}=true"
    monkeypatch.delenv("XLA_FLAGS")
    compile_cache.library_gemms()
    assert os.environ["XLA_FLAGS"] == f"{compile_cache.GEMM_FLAG}=false"


def test_this_xla_knows_the_gemm_flag(tmp_path):
    """XLA aborts a process whose XLA_FLAGS name a flag it does not know: a renamed flag fails here, not in a heal."""
    code = ("from moeheal.pipeline.model.compile_cache import library_gemms; library_gemms(); "
            "import jax.numpy as jnp; print(float((jnp.ones((4, 4)) @ jnp.ones((4, 4))).sum()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "64.0"
