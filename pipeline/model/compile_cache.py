"""JAX's persistent compilation cache for every heal, outside the lake.

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
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MOEHEAL_XLA_CACHE"
MAX_BYTES = 4 << 30  # the cache's size on disk before JAX evicts its oldest entries
MIN_COMPILE_SECONDS = 0.0  # every program: a CPU heal compiles a hundred that each take under a second


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
