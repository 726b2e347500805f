"""What every moeheal process tells XLA before it compiles: JAX's persistent compilation cache,
outside the lake, and matrix products through the vendor's library on a GPU.

Why: at a real shape XLA's compilation is the largest fixed cost of a heal (about 200 s of a
Qwen3-30B-A3B heal on an H100, bench/RESULTS.md, "The best ladder at the 30B shape"), and a heal
resumed, run again after a knob change, or a shard's process on the same host compiles everything it
computes once more. Within a first heal the stages' programs differ, so the cache finds none there
(bench/RESULTS.md, "The compilation cache"). The persistent cache is keyed by the program's HLO, the
compile options and the backend, so a hit loads the executable those same inputs compile to: no result
depends on it.

Where: `$MOEHEAL_XLA_CACHE` if set (empty: off), else `$XDG_CACHE_HOME/moeheal/xla` (`~/.cache`
by default). A cache that the caller already chose (`JAX_COMPILATION_CACHE_DIR`, or JAX's config, as
the tests do) is left alone. JAX evicts the least recently used entries past `MAX_BYTES`.

Matrix products on a GPU (`GEMM_FLAG`): XLA's default fuses them into Triton kernels and autotunes
each one's tiling at compilation, timing every candidate on the device. At the Qwen3-30B-A3B shape
that was most of a heal's compilation, 247 s or more of a one-layer heal's, against 25 s with the
products left to cuBLAS; the steps ran as fast there (learned rounding's device time 3.5 s against
4.2 s), and a whole 2-layer heal at 65,536 tokens took 155 s instead of 331 s (bench/RESULTS.md,
"Where a 30B heal's compilation went"). A caller's own `XLA_FLAGS` that name the flag are kept; other
backends ignore it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MOEHEAL_XLA_CACHE"
MAX_BYTES = 4 << 30  # the cache's size on disk before JAX evicts its oldest entries
MIN_COMPILE_SECONDS = 0.0  # every program: a CPU heal compiles a hundred that each take under a second
GEMM_FLAG = "--xla_gpu_enable_triton_gemm"  # false: cuBLAS runs the matrix products, no Triton autotuning


def prepare_compilation() -> Path | None:
    """Everything this module sets (`library_gemms`, `enable_compile_cache`), before JAX's backend starts:
    XLA reads its flags once, when the first computation creates the backend. The cache's folder or None."""
    library_gemms()
    return enable_compile_cache()


def library_gemms() -> None:
    """Add `GEMM_FLAG`=false to `XLA_FLAGS` unless the caller's flags already name it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if GEMM_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {GEMM_FLAG}=false".strip()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeheal" / "xla"


def enable_compile_cache() -> Path | None:
    """Turn JAX's persistent compilation cache on (see the module's docstring); the folder, or None when
    it is off or the caller chose one. JAX is imported here: `moeheal --help` does not load it."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    where = os.environ.get(CACHE_ENV)
    if where == "":
        return None
    folder = Path(where) if where else default_cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder
