"""Writing ggml blocks: the registry of every format's encoder, ``quantize`` and ``quantize_experts``.

``quantize`` works on 2-D matrices and speaks ggml bytes (``decode.dequantize`` reads them back);
``quantize_experts`` does a stack of routed experts with one compiled program,
vmapped over experts and streamed in batches so memory stays bounded for large
MoE layers. Work is cut into fixed-size chunks (``chunks.py``), so each
(format, chunk shape) compiles exactly once.

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

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moeheal.kernels.chunks import (ACCELERATOR_CHUNK_WEIGHTS, CHUNK_WEIGHTS, ProgramTooLarge, device_memory_bytes,
                                    fit_chunk, map_chunks, on_accelerator, platform)
from moeheal.kernels.decode import format_of
from moeheal.kernels.formats_encode import Encoder, IQ4_NLEncoder, Q8_0Encoder, TQ2_0Encoder
from moeheal.kernels.gptq import CPU_SCHEDULE, GptqSchedule, factor_is_finite, gptq_factor, gptq_round
from moeheal.kernels.iq1m_encode import IQ1_MEncoder
from moeheal.kernels.iquants_encode import IQ2_SEncoder, IQ2_XSEncoder, IQ2_XXSEncoder, IQ3_XXSEncoder
from moeheal.kernels.kquants_encode import Q2_KEncoder, Q3_KEncoder, Q4_KEncoder, Q5_KEncoder, Q6_KEncoder
from moeheal.kernels.threads import one_blas_thread

# Every format's encoder, by name: the same names as ``decode.FORMATS``, each a subclass of its decoder.
ENCODERS: dict[str, type[Encoder]] = {cls.name: cls for cls in (
    TQ2_0Encoder, IQ4_NLEncoder, Q8_0Encoder, Q2_KEncoder, Q3_KEncoder, Q4_KEncoder, Q5_KEncoder, Q6_KEncoder,
    IQ2_XXSEncoder, IQ2_XSEncoder, IQ2_SEncoder, IQ3_XXSEncoder, IQ1_MEncoder)}


def encoder_of(fmt: str | GGMLQuantizationType) -> type[Encoder]:
    """The encoder of the format registered under a name ("q2_k") or a ggml type (``decode.format_of``,
    whose ValueError names the known ones)."""
    return ENCODERS[format_of(fmt).name]


# Columns per GPTQ rounding step on an accelerator (`gptq_schedule`).
ACCELERATOR_GPTQ_UPDATE_WIDTH = 32
# Platforms whose GPTQ factor is computed in float64 (`gptq_schedule`): CUDA and ROCm GPUs run
# float64 in hardware; Metal has none and TPUs emulate it.
FLOAT64_FACTOR_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})

# The mesh axis that experts are sharded along.
EXPERT_AXIS = "expert"
NOT_POSITIVE_DEFINITE = "hessian: not positive definite (damp it with damp_hessian)"


def _quantize_matrix(fmt: str, w: jax.Array, importance: jax.Array | None, upper: jax.Array | None,
                     schedule: GptqSchedule = CPU_SCHEDULE) -> jax.Array:
    """One matrix (rows, cols) -> ggml bytes (rows, cols/block*type_size); traced, not jitted.

    With GPTQ's factor ``upper`` of H (``_gptq_factor``), GPTQ rounding in
    ``schedule``'s order (``gptq_round``), the importance weighting the scale
    searches there.
    """
    cls = ENCODERS[fmt]
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
def experts_batch_jit(fmt: str, schedule: GptqSchedule, mesh: Mesh, w: jax.Array, importance: jax.Array | None,
                       hessians: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``_experts_batch`` on the mesh: each device runs it on its own experts, none talks to another."""
    if mesh.size == 1:
        return _experts_batch(fmt, schedule, w, importance, hessians)
    # check_vma off: the kernels' loops start from constants, which the per-device type check would
    # have to be told vary by device; nothing here crosses devices for it to guard
    per_device = jax.shard_map(partial(_experts_batch, fmt, schedule), mesh=mesh, in_specs=PartitionSpec(EXPERT_AXIS),
                               out_specs=PartitionSpec(EXPERT_AXIS), check_vma=False)
    return per_device(w, importance, hessians)


# Each (format, schedule, mesh, batch asked, argument shapes)'s fitted batch and its compiled program.
_FITTED_BATCHES: dict[tuple, tuple[int, jax.stages.Compiled]] = {}


def _fitted_key(fmt: str, schedule: GptqSchedule, mesh: Mesh, per_device: int, arrays: tuple) -> tuple:
    """``_FITTED_BATCHES``' key: what a program depends on, the arrays by shape and dtype."""
    return fmt, schedule, mesh, per_device, tuple(None if a is None else (a.shape, str(a.dtype)) for a in arrays)


def _fitted_batch(fmt: str, schedule: GptqSchedule, mesh: Mesh, sharding: NamedSharding, per_device: int,
                  memory: int, w: jax.Array | np.ndarray, importance: jax.Array | np.ndarray | None,
                  hessians: jax.Array | np.ndarray | None) -> tuple[int, jax.stages.Compiled]:
    """The largest per-device batch of at most ``per_device`` experts whose ``experts_batch_jit`` program
    fits devices of ``memory`` bytes (``chunks.fit_chunk``), and that program, compiled once per process.

    The batch asked for holds every expert of a Qwen3-30B-A3B tensor; an i-quant's codebook search keeps
    a few hundred bytes per weight live, 50 GB for such a batch, so its batch is cut to what the memory
    holds instead. The program is the one the jit would run, compiled ahead so its memory is known first.
    Sized by the devices' memory, not what is free now: a batch's shape can move a k-quant's near-ties,
    so the bytes depend on the format, the shapes and the device, never on what else is resident.
    """
    arrays = (w, importance, hessians)
    key = _fitted_key(fmt, schedule, mesh, per_device, arrays)
    if key not in _FITTED_BATCHES:
        def compile_at(batch: int) -> jax.stages.Compiled:
            specs = [None if a is None else jax.ShapeDtypeStruct((batch * mesh.size, *a.shape[1:]), a.dtype,
                                                                  sharding=sharding) for a in arrays]
            try:
                return experts_batch_jit.lower(fmt, schedule, mesh, *specs).compile()
            except jax.errors.JaxRuntimeError as err:  # an H100 autotuning the 128-expert search: 16 GiB buffers
                if "RESOURCE_EXHAUSTED" in str(err):
                    raise ProgramTooLarge(str(err)) from err
                raise

        _FITTED_BATCHES[key] = fit_chunk(w.shape[0], per_device, memory, compile_at)  # as many experts as one device
    return _FITTED_BATCHES[key]


@dataclass(frozen=True)
class _Placement:
    """Where ``quantize_experts`` runs a stack of experts: the mesh, its sharding of the expert axis,
    GPTQ's schedule there, the experts per device and step asked for, and the devices' memory (None on
    the CPU, where no batch is cut to fit)."""

    mesh: Mesh
    sharding: NamedSharding
    schedule: GptqSchedule
    per_device: int
    memory: int | None

    @classmethod
    def of(cls, shape: tuple[int, ...], batch_weights: int | None, devices: Sequence[jax.Device] | None
           ) -> "_Placement":
        """The placement of experts of ``shape`` (E, rows, cols). The per-device batch does not depend on
        the device count: device d of step s runs the batch a single device runs at step s * devices + d,
        same experts, same shape, same program, so the bytes cannot depend on the device count (a batch's
        shape can move near-ties on some backends)."""
        n_expert, rows, cols = shape
        mesh = expert_mesh(devices)
        if batch_weights is None:
            batch_weights = ACCELERATOR_CHUNK_WEIGHTS if on_accelerator(mesh.devices.flat) else CHUNK_WEIGHTS
        return cls(mesh, NamedSharding(mesh, PartitionSpec(EXPERT_AXIS)), gptq_schedule(mesh.devices.flat),
                   max(1, min(batch_weights // (rows * cols), n_expert)), device_memory_bytes(mesh.devices.flat))


def prepare_experts(jobs: Iterable[tuple[str, tuple[int, int, int], bool, bool]],
                    devices: Sequence[jax.Device] | None = None) -> None:
    """Compile ahead, in parallel threads, the programs ``quantize_experts`` will run for ``jobs``:
    (format, experts' shape (E, rows, cols), with an importance, with Hessians), each at its default
    batch. On an accelerator each new program is compiled once per process (``_fitted_batch``: a
    codebook format's twice, its batch cut to fit), seconds each, and a layer's several formats would
    otherwise compile one after the other on one host core; the host has more. Nothing on the CPU,
    whose programs the jit compiles as they run. The programs are those ``quantize_experts`` runs, so
    the bytes are the same with or without this."""
    pending: dict[tuple, Callable[[], object]] = {}
    for fmt, shape, with_importance, with_hessians in jobs:
        placement = _Placement.of(tuple(shape), None, devices)
        if placement.memory is None:
            return
        n_expert, _, cols = shape
        specs = (jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct((n_expert, cols), jnp.float32) if with_importance else None,
                 jax.ShapeDtypeStruct((n_expert, cols, cols), jnp.float32) if with_hessians else None)
        key = _fitted_key(fmt, placement.schedule, placement.mesh, placement.per_device, specs)
        if key not in _FITTED_BATCHES:
            pending[key] = partial(_fitted_batch, fmt, placement.schedule, placement.mesh, placement.sharding,
                                   placement.per_device, placement.memory, *specs)
    if len(pending) > 1:
        with ThreadPoolExecutor(min(len(pending), os.cpu_count() or 1)) as pool:
            for future in [pool.submit(compile_one) for compile_one in pending.values()]:
                future.result()


def clear_fitted_batches() -> None:
    """Forget the batches and programs ``_fitted_batch`` compiled, as ``jax.clear_caches`` forgets the jit's:
    for a bench that changes a setting the programs read when traced."""
    _FITTED_BATCHES.clear()


def fitted_batches() -> dict[tuple[str, tuple[int, ...], bool], int]:
    """The per-device batch each (format, experts' shape, GPTQ or not) was cut to on an accelerator in
    this process (``_fitted_batch``): what a bench reports beside its times."""
    return {(fmt, shapes[0][0], shapes[2] is not None): batch
            for (fmt, _, _, _, shapes), (batch, _) in _FITTED_BATCHES.items()}


def expert_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """1-D mesh named ``expert`` over ``devices`` (default: this host's devices of the default backend)."""
    return Mesh(np.array(jax.local_devices() if devices is None else list(devices)), (EXPERT_AXIS,))


def gptq_schedule(devices: Sequence[jax.Device] | None = None) -> GptqSchedule:
    """GPTQ's schedule on these devices (``gptq_quantize``'s ``schedule``).

    An accelerator rounds ``ACCELERATOR_GPTQ_UPDATE_WIDTH`` columns per step
    (the whole-block step moved 8x the memory per column there) and, on
    ``FLOAT64_FACTOR_PLATFORMS``, factors H in float64 (half the float32
    reference's work, bench/RESULTS.md). The CPU keeps the whole-block step and
    the float32 factor, whose bytes the demo's published figures were made
    with (a schedule changes a few near-tie codes, never the method).
    """
    if not on_accelerator(devices):
        return CPU_SCHEDULE
    return GptqSchedule(update_width=ACCELERATOR_GPTQ_UPDATE_WIDTH,
                        float64_factor=platform(devices) in FLOAT64_FACTOR_PLATFORMS)


def _float32(x: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """x as float32, staying where it is: a device array is never pulled to the host."""
    return x.astype(jnp.float32) if isinstance(x, jax.Array) else np.asarray(x, np.float32)


def _check_matrix(x: np.ndarray, cls: type[Encoder], what: str) -> None:
    if x.shape[-1] % cls.block_size != 0:
        raise ValueError(f"{what}: {x.shape[-1]} columns is not a multiple of {cls.name}'s block of {cls.block_size}")


def _check_hessian(cls: type[Encoder], hessian: np.ndarray | None, cols: int, lead: tuple[int, ...]) -> None:
    if hessian is None:
        return
    if not cls.supports_gptq:
        gptq = sorted(name for name, f in ENCODERS.items() if f.supports_gptq)
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
    ggml tensor. The host's BLAS runs on one thread meanwhile (``kernels.threads``):
    on the CPU, GPTQ's factorisation is LAPACK's, whose last bits follow the
    thread count, and the bytes may not.
    """
    cls = encoder_of(fmt)
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
    with one_blas_thread():  # GPTQ's factor and solves on the CPU are the host's LAPACK: bytes whatever its threads
        upper = None
        if hessian is not None:  # factored once, shared by every chunk of rows
            upper, importance, factored = _gptq_factor_jit(jnp.asarray(hessian), importance, schedule)
            _check_factored(np.asarray(factored))
        chunk_rows = max(1, min(CHUNK_WEIGHTS // cols, rows))
        return map_chunks(lambda w: _quantize_rows_jit(fmt, w, importance, upper, schedule), chunk_rows,
                          x)  # (rows, bytes), read back before the limit ends


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
    CPU, ``ACCELERATOR_CHUNK_WEIGHTS`` on an accelerator, cut where that batch's program would not
    fit the accelerator's memory), each batch the same compiled program; with several
    ``devices`` (default: this host's devices of the default backend) each takes one batch per step.
    ValueError if a Hessian's factorisation (float32, or float64 where
    ``gptq_schedule`` says) fails on the device. The host's BLAS runs on one
    thread meanwhile, as in ``quantize``: the bytes do not depend on the thread count.
    """
    cls = encoder_of(fmt)
    w = _float32(w)  # (E, rows, cols), on the device already when the caller's arrays are
    if w.ndim != 3:
        raise ValueError(f"w: expected [n_expert, rows, cols], got shape {w.shape}")
    n_expert, _, cols = w.shape
    _check_matrix(w, cls, "w")
    if importance is not None:
        importance = _float32(importance)
        if importance.shape != (n_expert, cols):
            raise ValueError(f"importance: shape {importance.shape}, expected ({n_expert}, {cols})")
    if hessians is not None:
        hessians = _float32(hessians)
    _check_hessian(cls, hessians, cols, (n_expert,))
    placement = _Placement.of(w.shape, batch_weights, devices)
    mesh, sharding, per_device = placement.mesh, placement.sharding, placement.per_device
    program: Callable = partial(experts_batch_jit, fmt, placement.schedule, mesh)
    if placement.memory is not None:  # an accelerator: a batch whose program fits its memory (a codebook may not)
        per_device, program = _fitted_batch(fmt, placement.schedule, mesh, sharding, per_device, placement.memory,
                                            w, importance, hessians)
    with one_blas_thread():  # GPTQ's factor and solves on the CPU are the host's LAPACK: bytes whatever its threads
        raw, factored = map_chunks(program, per_device * mesh.size, w, importance, hessians,
                                   sharding=sharding)  # (E, rows, bytes), (E,), read back before the limit ends
    _check_factored(factored)
    return raw
