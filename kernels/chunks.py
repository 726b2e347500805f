"""Work cut into fixed-size chunks, and where it runs: shared by reading (``decode.dequantize``)
and writing (``encode.quantize``) ggml blocks.

Every chunk has one shape (the last one zero-padded), so each (format, chunk
shape) compiles exactly once, and memory stays bounded however large the tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Weights per compiled call. The scale search keeps a handful of arrays the
# size of the chunk alive, so this bounds peak memory to a few hundred MB.
CHUNK_WEIGHTS = 1 << 22
# Weights per compiled call on an accelerator: GPTQ's column loop is sequential, so a batch of 2
# experts (CHUNK_WEIGHTS at the Qwen3-30B-A3B shape) leaves a GPU idle. 1 << 28 holds all 128 experts
# of that shape (every column step then serves the whole layer; 42 per batch took 8% longer on an
# H200) and 256 of Qwen3-Next's: with their Hessians and the factor's scratch under 20 GB.
ACCELERATOR_CHUNK_WEIGHTS = 1 << 28


def map_chunks(fn: Callable[..., Any], chunk: int, *arrays: np.ndarray | jax.Array | None,
               sharding: jax.sharding.Sharding | None = None, to_host: bool = True) -> Any:
    """Apply ``fn`` to equal leading-axis chunks of ``arrays`` and concatenate.

    The last chunk is zero-padded to the common length so every call has one
    shape (one compilation); padded results are dropped. None passes through.
    ``fn`` may return a tuple of arrays, each concatenated on its own. With a
    ``sharding``, each chunk is placed with it before the call (the caller
    makes ``chunk`` a multiple of its device count). Inputs already on a device
    (``jax.Array``) are sliced and padded there; ``to_host=False`` keeps the
    results there too, so a layer's tensors cross to the host only when a
    caller asks for them.
    """
    n = next(a.shape[0] for a in arrays if a is not None)
    outs = []
    for start in range(0, n, chunk):
        parts = []
        for a in arrays:
            if a is None:
                parts.append(None)
                continue
            xp = jnp if isinstance(a, jax.Array) else np
            part = a[start:start + chunk]
            if part.shape[0] < chunk:
                part = xp.concatenate([part, xp.zeros((chunk - part.shape[0], *part.shape[1:]), part.dtype)])
            parts.append(part if sharding is None else jax.device_put(part, sharding))
        valid = min(chunk, n - start)
        if to_host:
            outs.append(jax.tree.map(lambda out: np.asarray(out)[:valid], fn(*parts)))  # noqa: B023
        else:
            outs.append(jax.tree.map(lambda out: out[:valid], fn(*parts)))  # noqa: B023
    if to_host:  # a writable NumPy array of the caller's own, even from one chunk
        return jax.tree.map(lambda *chunks: np.concatenate(chunks), *outs)
    return jax.tree.map(lambda *chunks: chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks), *outs)


def platform(devices: Sequence[jax.Device] | None = None) -> str:
    """The platform work goes to: the first of ``devices``'s, else the default device's
    (``jax.default_device``'s, where a caller set one), else the default backend's first's."""
    first = devices[0] if devices is not None else (jax.config.jax_default_device or jax.local_devices()[0])
    return getattr(first, "platform", first)  # the setting may name a platform


def on_accelerator(devices: Sequence[jax.Device] | None = None) -> bool:
    """Whether work goes to an accelerator (see ``platform``)."""
    return platform(devices) != "cpu"
