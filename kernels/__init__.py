"""Quantization kernels: the public Python API of the contract.

``quantize`` / ``dequantize`` work on 2-D matrices and speak ggml bytes;
``quantize_experts`` does a stack of routed experts with one compiled program,
vmapped over experts and streamed in batches so memory stays bounded for large
MoE layers. Work is cut into fixed-size chunks (the last one zero-padded), so
each (format, chunk shape) compiles exactly once.

Devices: ``quantize_experts`` runs on the accelerator, and with several local
devices shards the expert axis over them: a 1-D mesh named ``expert`` over
``jax.local_devices()`` (or the ``devices`` given), each device quantizing its
share of every batch with the same program a single device runs on a batch of
that size. Experts are independent, so no device talks to another and the
bytes are those of a one-device run.

Several hosts: start the same program on every host after
``jax.distributed.initialize()``. The mesh holds only a host's local devices,
so each host calls ``quantize_experts`` on its own share of the experts (or of
the tensors) and writes its own bytes; there is no cross-host traffic to wait for.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moeheal.kernels import kquants  # noqa: F401  (registers q2_k .. q6_k in FORMATS)
from moeheal.kernels import iquants  # noqa: F401  (registers iq2_xxs, iq2_xs, iq2_s, iq3_xxs)
from moeheal.kernels.formats import FORMATS, BlockFormat, dequantize_blocks_jit, format_of
from moeheal.kernels.gptq import CPU_SCHEDULE, GptqSchedule, damp_hessian, factor_is_finite, gptq_factor, gptq_round

__all__ = [
    "FORMATS",
    "GptqSchedule",
    "bits_per_weight",
    "damp_hessian",
    "dequantize",
    "expert_mesh",
    "format_of",
    "gptq_schedule",
    "quantize",
    "quantize_experts",
]

# Weights per compiled call. The scale search keeps a handful of arrays the
# size of the chunk alive, so this bounds peak memory to a few hundred MB.
CHUNK_WEIGHTS = 1 << 22
# Weights per compiled call on an accelerator: GPTQ's column loop is sequential, so a batch of 2
# experts (CHUNK_WEIGHTS at the Qwen3-30B-A3B shape) leaves a GPU idle. 1 << 28 holds all 128 experts
# of that shape (every column step then serves the whole layer; 42 per batch took 8% longer on an
# H200) and 256 of Qwen3-Next's: with their Hessians and the factor's scratch under 20 GB.
ACCELERATOR_CHUNK_WEIGHTS = 1 << 28

# Columns per GPTQ rounding step on an accelerator (`gptq_schedule`).
ACCELERATOR_GPTQ_UPDATE_WIDTH = 32
# Platforms whose GPTQ factor is computed in float64 (`gptq_schedule`): CUDA and ROCm GPUs run
# float64 in hardware; Metal has none and TPUs emulate it.
FLOAT64_FACTOR_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})

# The mesh axis that experts are sharded along.
EXPERT_AXIS = "expert"
NOT_POSITIVE_DEFINITE = "hessian: not positive definite (damp it with damp_hessian)"


def bits_per_weight(fmt: str) -> float:
    """Storage cost of a format in bits per weight (tq2_0: 2.0625)."""
    return format_of(fmt).bits_per_weight


def _quantize_matrix(fmt: str, w: jax.Array, importance: jax.Array | None, upper: jax.Array | None,
                     schedule: GptqSchedule = CPU_SCHEDULE) -> jax.Array:
    """One matrix (rows, cols) -> ggml bytes (rows, cols/block*type_size); traced, not jitted.

    With GPTQ's factor ``upper`` of H (``_gptq_factor``), GPTQ rounding in
    ``schedule``'s order (``gptq_round``), the importance weighting the scale
    searches there.
    """
    cls = FORMATS[fmt]
    rows, cols = w.shape
    if upper is not None:
        return gptq_round(cls, w, upper, importance, schedule)  # (rows, bytes)
    blocks = w.reshape(rows * cols // cls.block_size, cls.block_size)  # (n, B)
    imp = None
    if importance is not None:
        imp = jnp.broadcast_to(importance.reshape(1, cols // cls.block_size, cls.block_size),
                               (rows, cols // cls.block_size, cls.block_size)).reshape(blocks.shape)  # (n, B)
    return cls.quantize_blocks(blocks, imp).reshape(rows, -1)  # (rows, bytes)


def _gptq_factor(hessian: jax.Array, importance: jax.Array | None, schedule: GptqSchedule
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GPTQ's factor U of one Hessian (cols, cols), the scale searches' importance (cols,) (diag(H) when
    None) and whether U is finite (); traced, not jitted. The one factorisation of H a matrix gets."""
    upper = gptq_factor(hessian, schedule)  # (cols, cols)
    importance = jnp.diag(hessian) if importance is None else importance  # (cols,)
    return upper, importance, factor_is_finite(upper)


_gptq_factor_jit = jax.jit(_gptq_factor, static_argnames=("schedule",))


@partial(jax.jit, static_argnames=("fmt", "schedule"))
def _quantize_rows_jit(fmt: str, w: jax.Array, importance: jax.Array | None, upper: jax.Array | None,
                       schedule: GptqSchedule) -> jax.Array:
    """Jitted ``_quantize_matrix`` for one chunk of rows."""
    return _quantize_matrix(fmt, w, importance, upper, schedule)


def _check_factored(factored: np.ndarray) -> None:
    """ValueError unless every Hessian's factor (in the schedule's precision) came out finite on the device."""
    if not np.all(factored):
        raise ValueError(NOT_POSITIVE_DEFINITE)


def _experts_batch(fmt: str, schedule: GptqSchedule, w: jax.Array, importance: jax.Array | None,
                   hessians: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Bytes (e, rows, bytes) of a batch, and per expert whether its Hessian factors (e,) (True without one).

    Each Hessian is factored once, for the rounding and the check alike, and
    the check costs no host work: the flags come back with the bytes.
    """
    if hessians is None:
        raw = jax.vmap(partial(_quantize_matrix, fmt, schedule=schedule))(w, importance, None)  # (e, rows, bytes)
        return raw, jnp.ones(w.shape[:1], bool)  # (e,)
    upper, importance, factored = jax.vmap(partial(_gptq_factor, schedule=schedule))(hessians, importance)
    raw = jax.vmap(partial(_quantize_matrix, fmt, schedule=schedule))(w, importance, upper)  # (e, rows, bytes)
    return raw, factored  # (e, rows, bytes), (e,)


@partial(jax.jit, static_argnames=("fmt", "schedule", "mesh"))
def _experts_batch_jit(fmt: str, schedule: GptqSchedule, mesh: Mesh, w: jax.Array, importance: jax.Array | None,
                       hessians: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``_experts_batch`` on the mesh: each device runs it on its own experts, none talks to another."""
    if mesh.size == 1:
        return _experts_batch(fmt, schedule, w, importance, hessians)
    # check_vma off: the kernels' loops start from constants, which the per-device type check would
    # have to be told vary by device; nothing here crosses devices for it to guard
    per_device = jax.shard_map(partial(_experts_batch, fmt, schedule), mesh=mesh, in_specs=PartitionSpec(EXPERT_AXIS),
                               out_specs=PartitionSpec(EXPERT_AXIS), check_vma=False)
    return per_device(w, importance, hessians)


def expert_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """1-D mesh named ``expert`` over ``devices`` (default: this host's devices of the default backend)."""
    return Mesh(np.array(jax.local_devices() if devices is None else list(devices)), (EXPERT_AXIS,))


def _map_chunks(fn: Callable[..., Any], chunk: int, *arrays: np.ndarray | jax.Array | None,
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


def _platform(devices: Sequence[jax.Device] | None = None) -> str:
    """The platform work goes to: the first of ``devices``'s, else the default device's
    (``jax.default_device``'s, where a caller set one), else the default backend's first's."""
    first = devices[0] if devices is not None else (jax.config.jax_default_device or jax.local_devices()[0])
    return getattr(first, "platform", first)  # the setting may name a platform


def _on_accelerator(devices: Sequence[jax.Device] | None = None) -> bool:
    """Whether work goes to an accelerator (see ``_platform``)."""
    return _platform(devices) != "cpu"


def gptq_schedule(devices: Sequence[jax.Device] | None = None) -> GptqSchedule:
    """GPTQ's schedule on these devices (``gptq_quantize``'s ``schedule``).

    An accelerator rounds ``ACCELERATOR_GPTQ_UPDATE_WIDTH`` columns per step
    (the whole-block step moved 8x the memory per column there) and, on
    ``FLOAT64_FACTOR_PLATFORMS``, factors H in float64 (half the float32
    reference's work, bench/RESULTS.md). The CPU keeps the whole-block step and
    the float32 factor, whose bytes the demo's published figures were made
    with (a schedule changes a few near-tie codes, never the method).
    """
    if not _on_accelerator(devices):
        return CPU_SCHEDULE
    return GptqSchedule(update_width=ACCELERATOR_GPTQ_UPDATE_WIDTH,
                        float64_factor=_platform(devices) in FLOAT64_FACTOR_PLATFORMS)


def _float32(x: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """x as float32, staying where it is: a device array is never pulled to the host."""
    return x.astype(jnp.float32) if isinstance(x, jax.Array) else np.asarray(x, np.float32)


def _check_matrix(x: np.ndarray, cls: type[BlockFormat], what: str) -> None:
    if x.shape[-1] % cls.block_size != 0:
        raise ValueError(f"{what}: {x.shape[-1]} columns is not a multiple of {cls.name}'s block of {cls.block_size}")


def _check_hessian(cls: type[BlockFormat], hessian: np.ndarray | None, cols: int, lead: tuple[int, ...]) -> None:
    if hessian is None:
        return
    if not cls.supports_gptq:
        gptq = sorted(name for name, f in FORMATS.items() if f.supports_gptq)
        raise ValueError(f"hessian: gptq rounding is defined for {', '.join(gptq)}, not {cls.name}")
    if hessian.shape != (*lead, cols, cols):
        raise ValueError(f"hessian: shape {hessian.shape}, expected {(*lead, cols, cols)}")


def quantize(
    x: np.ndarray,
    fmt: str,
    importance: np.ndarray | None = None,
    hessian: np.ndarray | None = None,
) -> np.ndarray:
    """Quantize a matrix to ggml block bytes.

    x float [rows, cols] (cols a multiple of the block); importance [cols]
    (per-input-column weight of the squared error, e.g. E[x_j^2]) or None for
    uniform; hessian [cols, cols] (E[x x^T], positive definite: damp it with
    ``damp_hessian``) selects GPTQ rounding (formats whose ``supports_gptq``);
    given both, the importance weights the scale searches and H the error
    feedback. Returns uint8 [rows, cols / block * type_size], the rows of a
    ggml tensor.
    """
    cls = format_of(fmt)
    x = np.asarray(x, np.float32)
    if x.ndim != 2:
        raise ValueError(f"x: expected a matrix [rows, cols], got shape {x.shape}")
    rows, cols = x.shape
    _check_matrix(x, cls, "x")
    if importance is not None:
        importance = np.asarray(importance, np.float32)
        if importance.shape != (cols,):
            raise ValueError(f"importance: shape {importance.shape}, expected ({cols},)")
    if hessian is not None:
        hessian = np.asarray(hessian, np.float32)
    _check_hessian(cls, hessian, cols, ())
    schedule = gptq_schedule()
    upper = None
    if hessian is not None:  # factored once, shared by every chunk of rows
        upper, importance, factored = _gptq_factor_jit(jnp.asarray(hessian), importance, schedule)
        _check_factored(np.asarray(factored))
    chunk_rows = max(1, min(CHUNK_WEIGHTS // cols, rows))
    return _map_chunks(lambda w: _quantize_rows_jit(fmt, w, importance, upper, schedule), chunk_rows,
                       x)  # (rows, bytes)


def dequantize(raw: np.ndarray, fmt: str, shape: tuple[int, ...], keep_on_device: bool = False
               ) -> np.ndarray | jax.Array:
    """ggml block bytes -> float32 array of ``shape``, bit-identical to gguf.quants.dequantize.

    ``keep_on_device`` returns a ``jax.Array`` on the default device instead of a
    NumPy copy: the consumer is device code (GPTQ statistics, the routed
    forward), and a real layer's float32 experts are GBs each way. On an
    accelerator the blocks go in batches of ``ACCELERATOR_CHUNK_WEIGHTS``.
    """
    cls = format_of(fmt)
    shape = tuple(int(s) for s in shape)
    n_weights = int(np.prod(shape))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if shape[-1] % cls.block_size != 0 or raw.size != n_weights // cls.block_size * cls.type_size:
        raise ValueError(f"raw: {raw.size} bytes do not hold {cls.name} weights of shape {shape}")
    blocks = raw.reshape(-1, cls.type_size)  # (n, type_size)
    weights = ACCELERATOR_CHUNK_WEIGHTS if _on_accelerator() else CHUNK_WEIGHTS
    chunk_blocks = max(1, min(weights // cls.block_size, blocks.shape[0]))
    values = _map_chunks(lambda b: dequantize_blocks_jit(fmt, b), chunk_blocks, blocks,
                         to_host=not keep_on_device)  # (n, B)
    return values.reshape(shape)


def quantize_experts(
    w: np.ndarray,
    fmt: str,
    importance: np.ndarray | None = None,
    hessians: np.ndarray | None = None,
    batch_weights: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> np.ndarray:
    """Quantize a stack of experts: w [E, rows, cols] -> uint8 [E, rows, bytes].

    importance [E, cols] (each expert has its own input statistics) or None;
    hessians [E, cols, cols] (damped) select GPTQ rounding, with the
    importance (if given) weighting the scale searches. Experts are vmapped
    in batches of about ``batch_weights`` weights (default: ``CHUNK_WEIGHTS`` on the
    CPU, ``ACCELERATOR_CHUNK_WEIGHTS`` on an accelerator), each
    batch the same compiled program; with several ``devices`` (default: this
    host's devices of the default backend) each takes one batch per step.
    ValueError if a Hessian's factorisation (float32, or float64 where
    ``gptq_schedule`` says) fails on the device.
    """
    cls = format_of(fmt)
    w = _float32(w)  # (E, rows, cols), on the device already when the caller's arrays are
    if w.ndim != 3:
        raise ValueError(f"w: expected [n_expert, rows, cols], got shape {w.shape}")
    n_expert, rows, cols = w.shape
    _check_matrix(w, cls, "w")
    if importance is not None:
        importance = _float32(importance)
        if importance.shape != (n_expert, cols):
            raise ValueError(f"importance: shape {importance.shape}, expected ({n_expert}, {cols})")
    if hessians is not None:
        hessians = _float32(hessians)
    _check_hessian(cls, hessians, cols, (n_expert,))
    mesh = expert_mesh(devices)
    # The per-device batch does not depend on the device count: device d of step s runs the batch a
    # single device runs at step s * devices + d, same experts, same shape, same program, so the bytes
    # cannot depend on the device count (a batch's shape can move near-ties on some backends).
    if batch_weights is None:
        batch_weights = ACCELERATOR_CHUNK_WEIGHTS if _on_accelerator(mesh.devices.flat) else CHUNK_WEIGHTS
    per_device = max(1, min(batch_weights // (rows * cols), n_expert))
    sharding = NamedSharding(mesh, PartitionSpec(EXPERT_AXIS))
    raw, factored = _map_chunks(partial(_experts_batch_jit, fmt, gptq_schedule(mesh.devices.flat), mesh),
                                        per_device * mesh.size,
                                        w, importance, hessians, sharding=sharding)  # (E, rows, bytes), (E,)
    _check_factored(factored)
    return raw
