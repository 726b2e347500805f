"""ggml block formats, the reading half: the base class of every format, the block layouts of
the scaled-grid formats (tq2_0, iq4_nl) and of q8_0; the k-quants' and i-quants' layouts live in
``kquants.py`` and ``iquants.py``, the registry that names them all in ``decode.py``.

Each format is a small class in the style of gguf-py's ``quants.py``, named by
its ggml type: its geometry comes from ``gguf.GGML_QUANT_SIZES``, it packs and
unpacks ggml's exact byte layout, computes the values from the parts with
gguf-py's float32 products, and says where its fp16 super-block scales live
(what alpha multiplies). How the scales and codes are *chosen* (the scale
searches, GPTQ) is the writing half (``formats_encode.py``, ``kquants_encode.py``,
``iquants_encode.py``), whose classes derive from these: code that only reads a
GGUF (the runner, the dumps, the reference logits) depends on this half alone,
so a change to a search cannot invalidate what was computed from the source model.

tq2_0 and iq4_nl are "scaled grid" formats: a block stores one fp16 scale d and
per weight an index into a fixed grid of levels, value = d * level.

Every function here is a pure, jit-able function of arrays: no files, no config.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# ---------------------------------------------------------------------------
# fp16 scale <-> bytes (little endian, as ggml stores ggml_fp16_t)
# ---------------------------------------------------------------------------


FP16_MAX = 65504.0
FP16_MANTISSA_BITS = 10
FP16_SMALLEST_EXPONENT = -24  # of fp16's smallest subnormal, 2**-24: the step below 2**-14


def _power_of_two(k: jax.Array) -> jax.Array:
    """2.0**k as float32 for integer k in [-126, 127], built from its bits: exact on every backend."""
    return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)  # k's shape


def fp16_round(d: jax.Array) -> jax.Array:
    """float32 values rounded to the nearest fp16 value (ties to even, subnormals and overflow to inf
    as a cast does), returned as float32.

    Arithmetic, not a cast to float16 and back: XLA may drop such a round trip inside a fused GPU
    program (excess precision is allowed by default), and then a tuned scale's forward would use a
    value the written file cannot hold. A multiply by a power of two, a round to integer and a
    multiply back are exact, and no compiler may drop them.
    """
    d = jnp.asarray(d, jnp.float32)
    biased = (jax.lax.bitcast_convert_type(d, jnp.int32) >> 23) & 0xFF  # float32's biased exponent
    exponent = biased - 126  # d in [2**(exponent-1), 2**exponent) for normal d
    step = jnp.maximum(exponent - 1 - FP16_MANTISSA_BITS, FP16_SMALLEST_EXPONENT)  # log2 of fp16's step there
    rounded = jnp.round(d * _power_of_two(-step)) * _power_of_two(step)  # d's shape
    return jnp.where(jnp.abs(rounded) > FP16_MAX, jnp.copysign(jnp.float32(jnp.inf), d), rounded)


def fp16_to_bytes(d: jax.Array) -> jax.Array:
    """(n,) or (n, 1) float32 scales (the latter as ``unpack`` returns them) -> (n, 2) uint8, little-endian fp16."""
    bits = jax.lax.bitcast_convert_type(d.reshape(d.shape[0]).astype(jnp.float16), jnp.uint16)  # (n,)
    return jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)  # (n, 2)


def bytes_to_fp16(b: jax.Array) -> jax.Array:
    """(n, 2) uint8 little-endian fp16 -> (n, 1) float32 (exact widening)."""
    bits = b[:, 0].astype(jnp.uint16) | (b[:, 1].astype(jnp.uint16) << 8)  # (n,)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[:, None]  # (n, 1)


# ---------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------


class BlockFormat:
    """A ggml block format: geometry, type, the byte layout of its blocks, their values, scales.

    A concrete subclass names its ggml type in the class statement
    (``class TQ2_0(GridFormat, ggml_type=GGMLQuantizationType.TQ2_0)``); the
    name, block and type sizes and bits per weight then come from gguf-py, so
    they cannot drift from ggml's. ``decode.FORMATS`` lists the concrete ones.

    ``scale_offsets`` are the byte offsets in a block of the fp16 super-block
    scales that a global factor multiplies (the scale d; for formats with a min
    also dmin, so that every dequantized value is multiplied by the factor).
    ``fp16_scale_bits`` / ``with_fp16_scale_bits`` read and write those scales;
    a format that spreads its fp16 scale over other fields (iq1_m) leaves
    ``scale_offsets`` empty and overrides the two.

    ``unpack`` splits blocks into their parts (fp16 scales, integer scale codes,
    weight codes, as float or integer arrays), ``pack`` writes them back, and
    ``dequantize_parts`` computes the values from the parts with the same float32
    products as gguf-py. Dequantizing is the two composed, so code that tunes a
    part (the fp16 scales at ``fp16_parts``, or the codes) and decodes it through
    ``dequantize_parts`` sees exactly the values the written bytes will decode to,
    and JAX can differentiate the values with respect to the float parts.
    """

    name: ClassVar[str]
    ggml_type: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    bits_per_weight: ClassVar[float]
    scale_offsets: ClassVar[tuple[int, ...]]
    fp16_parts: ClassVar[tuple[int, ...]] = (0,)  # positions in ``unpack``'s parts of the stored fp16 scales
    # What llama.cpp's CPU backend converts the other operand (the activations) of a matrix product
    # with this format to before the dot products (ggml-cpu.c type_traits_cpu[...].vec_dot_type):
    # "q8_0" (an fp16 scale per 32) or "q8_k" (a float32 scale per 256); `kernels.narrow` says when
    # that conversion overflows.
    llama_activation: ClassVar[str]

    def __init_subclass__(cls, ggml_type: GGMLQuantizationType | None = None, **kwargs: Any) -> None:
        """Give a concrete format its ggml geometry; families (no ggml_type) stay abstract."""
        super().__init_subclass__(**kwargs)
        if ggml_type is None:
            return
        cls.ggml_type = ggml_type
        cls.name = ggml_type.name.lower()
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[ggml_type]
        cls.bits_per_weight = cls.type_size * 8 / cls.block_size

    @classmethod
    def code_scale_parts(cls) -> tuple[tuple[int, int, int], ...]:
        """(part, lo, hi) of each integer sub-block scale code in ``unpack``'s parts that end-to-end
        tuning may move (`pipeline/stages/e2e.py`, ``e2e_code_lr``); none unless a format says so."""
        return ()

    @classmethod
    def pack(cls, *parts: jax.Array) -> jax.Array:
        """The parts ``unpack`` returns (scales as fp16-representable floats) -> (n, type_size) uint8."""
        raise NotImplementedError

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, ...]:
        """(n, type_size) uint8 -> the block's parts, fp16 scales first (each family documents its parts)."""
        raise NotImplementedError

    @classmethod
    def dequantize_parts(cls, parts: tuple[jax.Array, ...]) -> jax.Array:
        """``unpack``'s parts -> (n, block_size) float32 values; differentiable in the float parts."""
        raise NotImplementedError

    @classmethod
    def dequantize_blocks(cls, blocks: jax.Array) -> jax.Array:
        """(n, type_size) uint8 -> (n, block_size) float32, bit for bit as gguf-py."""
        return cls.dequantize_parts(cls.unpack(blocks))

    @classmethod
    def fp16_scale_bits(cls, blocks: np.ndarray) -> np.ndarray:
        """The stored fp16 super-block scales of (n, type_size) uint8 blocks, as bits: (n, S) uint16."""
        blocks = np.asarray(blocks, np.uint8)
        return np.stack([np.ascontiguousarray(blocks[:, off:off + 2]).view("<u2")[:, 0] for off in cls.scale_offsets],
                        axis=1).astype(np.uint16) if cls.scale_offsets else np.zeros((blocks.shape[0], 0), np.uint16)

    @classmethod
    def with_fp16_scale_bits(cls, blocks: np.ndarray, bits: np.ndarray) -> np.ndarray:
        """A copy of (n, type_size) uint8 blocks with the fp16 scales ``bits`` (n, S) uint16 stored."""
        out = np.array(blocks, np.uint8)
        bits = np.asarray(bits, np.uint16)
        for j, off in enumerate(cls.scale_offsets):
            out[:, off:off + 2] = bits[:, j:j + 1].astype("<u2").view(np.uint8)
        return out

    @classmethod
    def scale_scales(cls, raw: np.ndarray, factor: float) -> np.ndarray:
        """ggml bytes with every super-block scale multiplied by ``factor``.

        This is how alpha scales a quantized matrix without changing its
        format: the product is taken in float32 and rounded to fp16 once. Any
        byte array whose size is a whole number of blocks is accepted; a new
        uint8 array of the same shape comes back. ValueError, never a silent
        inf, NaN or zero, when the factor is not finite, a product overflows
        fp16 or is not finite, or a nonzero scale would round to zero.
        """
        if not np.isfinite(factor):
            raise ValueError(f"{cls.name}: scale factor {factor!r} is not finite")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size % cls.type_size != 0:
            raise ValueError(f"{cls.name}: {raw.size} {raw.dtype} values are not whole {cls.type_size}-byte blocks")
        blocks = raw.reshape(-1, cls.type_size)  # (n, type_size)
        scales = cls.fp16_scale_bits(blocks).view(np.float16)  # (n, S)
        for j in range(scales.shape[1]):
            old = scales[:, j].astype(np.float32)  # (n,)
            with np.errstate(over="ignore", invalid="ignore"):
                new = (old * np.float32(factor)).astype(np.float16)  # (n,)
            bad = ~np.isfinite(new)  # (n,)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"{cls.name}: scale {old[i]!r} of block {i} times {factor!r} is not a finite fp16 "
                                 f"({np.count_nonzero(bad)} blocks); fp16 holds at most 65504")
            lost = (new == 0) & (old != 0)  # (n,)
            if lost.any():
                i = int(np.argmax(lost))
                raise ValueError(f"{cls.name}: scale {old[i]!r} of block {i} times {factor!r} underflows fp16 to zero "
                                 f"({np.count_nonzero(lost)} blocks)")
            scales[:, j] = new
        return cls.with_fp16_scale_bits(blocks, scales.view(np.uint16)).reshape(raw.shape)


class GridFormat(BlockFormat):
    """A block of one fp16 scale and per-weight indices into a fixed level grid."""

    levels: ClassVar[tuple[int, ...]]

    @classmethod
    def level_grid(cls) -> jax.Array:
        """(K,) float32 grid levels, ascending."""
        return jnp.asarray(cls.levels, jnp.float32)

    @classmethod
    def pack(cls, d: jax.Array, idx: jax.Array) -> jax.Array:
        """(n,) fp16-valued scales and (n, block_size) level indices -> (n, type_size) uint8."""
        raise NotImplementedError

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(n, type_size) uint8 -> scales (n, 1) float32, level indices (n, block_size) int32."""
        raise NotImplementedError

    @classmethod
    def dequantize_parts(cls, parts: tuple[jax.Array, ...]) -> jax.Array:
        d, idx = parts  # (n, 1), (n, B)
        return d * cls.level_grid()[idx]  # (n, B), one float32 product, as gguf-py


class TQ2_0(GridFormat, ggml_type=GGMLQuantizationType.TQ2_0):
    """ggml TQ2_0: 256 weights, 64 bytes of 2-bit codes then fp16 d; value = (q-1)*d.

    Byte j of the 64 holds, in bit pairs 0,2,4,6, the codes of weights
    32*k + j%32 + 128*(j//32) for k = 0..3 (gguf-py's TQ2_0 layout).
    """

    scale_offsets = (64,)
    llama_activation = "q8_k"
    levels = (-1, 0, 1, 2)

    @classmethod
    def pack(cls, d: jax.Array, idx: jax.Array) -> jax.Array:
        n = idx.shape[0]
        codes = idx.astype(jnp.uint8).reshape(n, 2, 4, 32)  # (n, half, k, j)
        shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
        qs = jnp.sum(codes << shifts, axis=2, dtype=jnp.uint8).reshape(n, 64)  # (n, 64); disjoint bits, sum == or
        return jnp.concatenate([qs, fp16_to_bytes(d)], axis=-1)  # (n, 66)

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
        n = blocks.shape[0]
        qs = blocks[:, :64].reshape(n, 2, 1, 32)  # (n, half, 1, j)
        shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
        idx = ((qs >> shifts) & 0x03).reshape(n, 256).astype(jnp.int32)  # (n, 256)
        return bytes_to_fp16(blocks[:, 64:66]), idx


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class IQ4_NL(GridFormat, ggml_type=GGMLQuantizationType.IQ4_NL):
    """ggml IQ4_NL: 32 weights, fp16 d then 16 bytes; value = d * kvalues[idx].

    Byte j holds idx[j] in its low nibble and idx[j + 16] in its high nibble.
    """

    scale_offsets = (0,)
    llama_activation = "q8_0"
    levels = KVALUES_IQ4NL

    @classmethod
    def pack(cls, d: jax.Array, idx: jax.Array) -> jax.Array:
        nib = idx.astype(jnp.uint8)  # (n, 32)
        qs = nib[:, :16] | (nib[:, 16:] << 4)  # (n, 16)
        return jnp.concatenate([fp16_to_bytes(d), qs], axis=-1)  # (n, 18)

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
        qs = blocks[:, 2:18]  # (n, 16)
        idx = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.int32)  # (n, 32)
        return bytes_to_fp16(blocks[:, :2]), idx


class Q8_0(BlockFormat, ggml_type=GGMLQuantizationType.Q8_0):
    """ggml Q8_0: 32 weights, fp16 d then 32 int8; value = q * d."""

    scale_offsets = (0,)
    llama_activation = "q8_0"

    @classmethod
    def pack(cls, d: jax.Array, q: jax.Array) -> jax.Array:
        """d (n,) fp16 values, q (n, 32) integer-valued in -128..127 -> (n, 34) uint8."""
        q8 = jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8)  # (n, 32)
        return jnp.concatenate([fp16_to_bytes(d), q8], axis=-1)  # (n, 34)

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(n, 34) uint8 -> d (n, 1), q (n, 32) float32."""
        d = bytes_to_fp16(blocks[:, :2])  # (n, 1)
        return d, jax.lax.bitcast_convert_type(blocks[:, 2:], jnp.int8).astype(jnp.float32)  # (n, 32)

    @classmethod
    def dequantize_parts(cls, parts: tuple[jax.Array, ...]) -> jax.Array:
        d, q = parts  # (n, 1), (n, 32)
        return q * d  # (n, 32)
