"""Work cut into fixed-size chunks, and where it runs: shared by reading (``decode.dequantize``)
and writing (``encode.quantize``) ggml blocks.

Every chunk has one shape (the last one zero-padded), so each (format, chunk
shape) compiles exactly once, and memory stays bounded however large the tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

# Weights per compiled call. The scale search keeps a handful of arrays the
# size of the chunk alive, so this bounds peak memory to a few hundred MB.
CHUNK_WEIGHTS = 1 << 22
# Share of a device's memory one chunk's program may take (`fit_chunk`): what the caller keeps resident
# beside the call (a 30B layer's weights and Hessians, 3 GB) and the allocator's fragmentation take the rest.
CHUNK_MEMORY_SHARE = 0.5

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


def device_memory_bytes(devices: Sequence[jax.Device] | None = None) -> int | None:
    """The least memory any of ``devices`` (default: this host's devices of the default backend) lets this
    process take, or None on a CPU backend or where a device reports no memory figures. A limit, not
    what is free now: a chunk sized by it depends on the device alone, never on what else is resident."""
    devices = jax.local_devices() if devices is None else list(devices)
    limits = [device.memory_stats() if device.platform != "cpu" else None for device in devices]
    if not all(stats and "bytes_limit" in stats for stats in limits):
        return None
    return min(stats["bytes_limit"] for stats in limits)


Program = TypeVar("Program")


def program_bytes(compiled: jax.stages.Compiled) -> int:
    """Device memory a compiled program takes while it runs: its arguments, outputs and scratch
    (per device, for a program over a mesh), as XLA's memory analysis reports them."""
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


class ProgramTooLarge(Exception):
    """A program's compilation ran out of device memory (a GPU compiler autotunes a fusion on buffers of
    its real size): its chunk does not fit, whatever the memory analysis would have said."""


def fit_chunk(n: int, chunk: int, memory: int, compile_at: Callable[[int], Program],
              bytes_of: Callable[[Program], int] = program_bytes) -> tuple[int, Program]:
    """The largest chunk of at most ``chunk`` items (of ``n``) whose program fits a device of ``memory``
    bytes (``device_memory_bytes``), and that program.

    A program's memory is about linear in its chunk (a vmapped batch), so a chunk that does not fit in
    ``CHUNK_MEMORY_SHARE`` of ``memory`` is scaled down by the ratio and compiled again (``compile_at(chunk)``),
    until one fits or the chunk is one item. Where the compilation itself runs out of memory
    (``compile_at`` raises ``ProgramTooLarge``), a one-item program's bytes times the chunk stand for the
    chunk's (an upper bound: its fixed part counted per item). A smaller chunk is balanced,
    ``ceil(n / ceil(n / fitted))``: the last one, zero-padded by ``map_chunks``, then computes as little
    padding as the fit allows.
    """
    chunk = max(1, min(chunk, n))
    while True:
        try:
            program: Program | None = compile_at(chunk)
            need = bytes_of(program)
        except ProgramTooLarge:
            if chunk == 1:
                raise
            program, need = None, bytes_of(compile_at(1)) * chunk
        if program is not None and (chunk == 1 or need <= CHUNK_MEMORY_SHARE * memory):
            return chunk, program
        fitted = max(1, min(chunk - 1, int(chunk * CHUNK_MEMORY_SHARE * memory / need)))
        chunk = -(-n // -(-n // fitted))  # as many chunks as `fitted` needs, evened out
