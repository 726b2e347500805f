"""Quantization kernels: the public Python API of the contract.

``quantize`` / ``dequantize`` work on 2-D matrices and speak ggml bytes;
``quantize_experts`` does a stack of routed experts with one compiled program,
vmapped over experts and streamed in batches so memory stays bounded for large
MoE layers. Work is cut into fixed-size chunks (the last one zero-padded), so
each (format, chunk shape) compiles exactly once.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moeheal.kernels import kquants  # noqa: F401  (registers q2_k .. q6_k in FORMATS)
from moeheal.kernels import iquants  # noqa: F401  (registers iq2_xxs, iq2_xs, iq2_s, iq3_xxs)
from moeheal.kernels.formats import FORMATS, BlockFormat, dequantize_blocks_jit, format_of
from moeheal.kernels.gptq import damp_hessian, gptq_quantize

__all__ = [
    "FORMATS",
    "bits_per_weight",
    "damp_hessian",
    "dequantize",
    "format_of",
    "quantize",
    "quantize_experts",
]

# Weights per compiled call. The scale search keeps a handful of arrays the
# size of the chunk alive, so this bounds peak memory to a few hundred MB.
CHUNK_WEIGHTS = 1 << 22


def bits_per_weight(fmt: str) -> float:
    """Storage cost of a format in bits per weight (tq2_0: 2.0625)."""
    return format_of(fmt).bits_per_weight


def _quantize_matrix(fmt: str, w: jax.Array, importance: jax.Array | None, hessian: jax.Array | None) -> jax.Array:
    """One matrix (rows, cols) -> ggml bytes (rows, cols/block*type_size); traced, not jitted.

    With a hessian, GPTQ rounding; the importance (if any) still weights the
    scale searches there.
    """
    cls = FORMATS[fmt]
    rows, cols = w.shape
    if hessian is not None:
        return gptq_quantize(cls, w, hessian, importance)  # (rows, bytes)
    blocks = w.reshape(rows * cols // cls.block_size, cls.block_size)  # (n, B)
    imp = None
    if importance is not None:
        imp = jnp.broadcast_to(importance.reshape(1, cols // cls.block_size, cls.block_size),
                               (rows, cols // cls.block_size, cls.block_size)).reshape(blocks.shape)  # (n, B)
    return cls.quantize_blocks(blocks, imp).reshape(rows, -1)  # (rows, bytes)


@partial(jax.jit, static_argnames=("fmt",))
def _quantize_rows_jit(fmt: str, w: jax.Array, importance: jax.Array | None, hessian: jax.Array | None) -> jax.Array:
    """Jitted ``_quantize_matrix`` for one chunk of rows."""
    return _quantize_matrix(fmt, w, importance, hessian)


@partial(jax.jit, static_argnames=("fmt",))
def _quantize_experts_jit(fmt: str, w: jax.Array, importance: jax.Array | None, hessians: jax.Array | None) -> jax.Array:
    """``_quantize_matrix`` vmapped over a batch of experts: (e, rows, cols) -> (e, rows, bytes)."""
    return jax.vmap(partial(_quantize_matrix, fmt))(w, importance, hessians)


def _map_chunks(fn: Callable[..., jax.Array], chunk: int, *arrays: np.ndarray | None) -> np.ndarray:
    """Apply ``fn`` to equal leading-axis chunks of ``arrays`` and concatenate.

    The last chunk is zero-padded to the common length so every call has one
    shape (one compilation); padded results are dropped. None passes through.
    """
    n = next(a.shape[0] for a in arrays if a is not None)
    chunk = max(1, min(chunk, n))
    outs = []
    for start in range(0, n, chunk):
        parts = []
        for a in arrays:
            if a is None:
                parts.append(None)
                continue
            part = a[start:start + chunk]
            if part.shape[0] < chunk:
                pad = np.zeros((chunk - part.shape[0], *part.shape[1:]), part.dtype)
                part = np.concatenate([part, pad])
            parts.append(part)
        outs.append(np.asarray(fn(*parts))[: min(chunk, n - start)])
    return np.concatenate(outs)


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
    try:
        np.linalg.cholesky(hessian.astype(np.float64))
    except np.linalg.LinAlgError:
        raise ValueError("hessian: not positive definite (damp it with damp_hessian)") from None


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
    chunk_rows = max(1, CHUNK_WEIGHTS // cols)
    return _map_chunks(lambda w: _quantize_rows_jit(fmt, w, importance, hessian), chunk_rows, x)  # (rows, bytes)


def dequantize(raw: np.ndarray, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """ggml block bytes -> float32 array of ``shape``, bit-identical to gguf.quants.dequantize."""
    cls = format_of(fmt)
    shape = tuple(int(s) for s in shape)
    n_weights = int(np.prod(shape))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if shape[-1] % cls.block_size != 0 or raw.size != n_weights // cls.block_size * cls.type_size:
        raise ValueError(f"raw: {raw.size} bytes do not hold {cls.name} weights of shape {shape}")
    blocks = raw.reshape(-1, cls.type_size)  # (n, type_size)
    chunk_blocks = max(1, CHUNK_WEIGHTS // cls.block_size)
    values = _map_chunks(lambda b: dequantize_blocks_jit(fmt, b), chunk_blocks, blocks)  # (n, B)
    return values.reshape(shape)


def quantize_experts(
    w: np.ndarray,
    fmt: str,
    importance: np.ndarray | None = None,
    hessians: np.ndarray | None = None,
    batch_weights: int = CHUNK_WEIGHTS,
) -> np.ndarray:
    """Quantize a stack of experts: w [E, rows, cols] -> uint8 [E, rows, bytes].

    importance [E, cols] (each expert has its own input statistics) or None;
    hessians [E, cols, cols] (damped) select GPTQ rounding, with the
    importance (if given) weighting the scale searches. Experts are vmapped
    in batches of about ``batch_weights`` weights (raise it on a GPU), each
    batch the same compiled program.
    """
    cls = format_of(fmt)
    w = np.asarray(w, np.float32)
    if w.ndim != 3:
        raise ValueError(f"w: expected [n_expert, rows, cols], got shape {w.shape}")
    n_expert, rows, cols = w.shape
    _check_matrix(w, cls, "w")
    if importance is not None:
        importance = np.asarray(importance, np.float32)
        if importance.shape != (n_expert, cols):
            raise ValueError(f"importance: shape {importance.shape}, expected ({n_expert}, {cols})")
    if hessians is not None:
        hessians = np.asarray(hessians, np.float32)
    _check_hessian(cls, hessians, cols, (n_expert,))
    batch = max(1, batch_weights // (rows * cols))
    return _map_chunks(partial(_quantize_experts_jit, fmt), batch, w, importance, hessians)  # (E, rows, bytes)
