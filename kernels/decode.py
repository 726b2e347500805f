"""Reading ggml blocks: the registry of every format's decoder, and ``dequantize``.

The registry is here, where it is read, and it names each format's decoder
class: whatever reads a format by name or ggml type imports this module and so
every layout, and nothing of how bytes are chosen (``encode.py``). The
runner, the dumps and the reference logits therefore depend on the layouts
alone.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from gguf import GGMLQuantizationType

from moeheal.kernels.chunks import ACCELERATOR_CHUNK_WEIGHTS, CHUNK_WEIGHTS, map_chunks, on_accelerator
from moeheal.kernels.formats import IQ4_NL, Q8_0, TQ2_0, BlockFormat
from moeheal.kernels.iquants import IQ1_M, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS
from moeheal.kernels.kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K

DECODERS: tuple[type[BlockFormat], ...] = (TQ2_0, IQ4_NL, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
                                           IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ1_M)
FORMATS: dict[str, type[BlockFormat]] = {cls.name: cls for cls in DECODERS}
FORMATS_BY_TYPE: dict[GGMLQuantizationType, type[BlockFormat]] = {cls.ggml_type: cls for cls in DECODERS}


def format_of(fmt: str | GGMLQuantizationType) -> type[BlockFormat]:
    """The format registered under a name ("q2_k") or a ggml type; ValueError names the known ones."""
    cls = FORMATS_BY_TYPE.get(fmt) if isinstance(fmt, GGMLQuantizationType) else FORMATS.get(fmt)
    if cls is None:
        raise ValueError(f"unknown format {fmt!r}; known: {sorted(FORMATS)}")
    return cls


def bits_per_weight(fmt: str) -> float:
    """Storage cost of a format in bits per weight (tq2_0: 2.0625)."""
    return format_of(fmt).bits_per_weight


@partial(jax.jit, static_argnames=("fmt",))
def dequantize_blocks_jit(fmt: str, blocks: jax.Array) -> jax.Array:
    """Jitted ``FORMATS[fmt].dequantize_blocks``; compiled once per (fmt, shape)."""
    return FORMATS[fmt].dequantize_blocks(blocks)


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
    weights = ACCELERATOR_CHUNK_WEIGHTS if on_accelerator() else CHUNK_WEIGHTS
    chunk_blocks = max(1, min(weights // cls.block_size, blocks.shape[0]))
    values = map_chunks(lambda b: dequantize_blocks_jit(fmt, b), chunk_blocks, blocks,
                        to_host=not keep_on_device)  # (n, B)
    return values.reshape(shape)
