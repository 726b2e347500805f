"""ggml codebook i-quants, the reading half: the block layouts and values of iq2_xxs, iq2_xs,
iq2_s, iq3_xxs and iq1_m.

An i-quant super-block holds 256 weights and one fp16 scale d. Its weights
come in groups (8, or 4 for iq3_xxs) whose magnitudes are one point of a
fixed grid (gguf-py's tables: 256 to 1024 points of positive values), plus
one sign per weight; sub-blocks of 32 or 16 weights carry a 4-bit scale code
l. A weight's value is

    (d * (0.5 + l) * unit) * grid[point][i] * sign,   unit = 1/4 (1/2 for iq3_xxs)

iq2_xxs, iq2_xs and iq3_xxs store 7 sign bits per 8 weights; the eighth makes
the count of negatives even (gguf-py's ``ksigns``). iq2_s stores all 8.

iq1_m stores no signs: a group of 8 takes one of 2048 points of {-1, 0, 1}^8
(gguf-py's iq1s grid) shifted by a stored delta of +-1/8, so its grid here
is the 4096 shifted points (``grid_values``); its sub-blocks of 16 carry a
3-bit code l with the scale d * (2 l + 1), i.e. unit 2, and its fp16 d is
spread over the top nibbles of the four 16-bit words of sub-block codes
(``fp16_scale_bits``). How the points, signs and scales are chosen is
``iquants_encode.py`` (iq1_m's: ``iq1m_encode.py``).
"""

from __future__ import annotations

from typing import ClassVar

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from moeheal.kernels.formats import BlockFormat, bytes_to_fp16, fp16_to_bytes
from moeheal.kernels.kquants import QK_K

KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8)  # (128,): 7 stored bits -> 8 with even parity


def gguf_grid(quant: type) -> np.ndarray:
    """gguf-py's grid of a format, (points, group) float32: the magnitudes a group of weights can take."""
    quant.init_grid()
    return np.asarray(quant.grid, np.float32).reshape(quant.grid_shape)


def _u32_bytes(words: jax.Array) -> jax.Array:
    """(..., m) uint32 -> (..., 4 m) uint8, little endian."""
    shifts = jnp.array([0, 8, 16, 24], jnp.uint32)
    return ((words[..., None] >> shifts) & 0xFF).astype(jnp.uint8).reshape(*words.shape[:-1], -1)


def _bytes_u32(b: jax.Array) -> jax.Array:
    """(..., 4 m) uint8 -> (..., m) uint32, little endian."""
    b = b.reshape(*b.shape[:-1], -1, 4).astype(jnp.uint32)  # (..., m, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _sign_masks(neg: jax.Array) -> jax.Array:
    """(n, 256) negative flags -> (n, 32) uint32 masks: bit i of mask j is weight 8 j + i."""
    n = neg.shape[0]
    bits = neg.reshape(n, 32, 8).astype(jnp.uint32) << jnp.arange(8, dtype=jnp.uint32)  # (n, 32, 8)
    return jnp.sum(bits, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum == or


def _mask_signs(masks: jax.Array) -> jax.Array:
    """(n, 32) 8-bit masks -> (n, 256) negative flags (the inverse of ``_sign_masks``)."""
    n = masks.shape[0]
    return ((masks[..., None].astype(jnp.uint32) >> jnp.arange(8, dtype=jnp.uint32)) & 1).astype(bool).reshape(n, QK_K)


def _parity_signs(s7: jax.Array) -> jax.Array:
    """(n, 32) 7-bit sign codes -> (n, 256) negative flags through gguf-py's ksigns table."""
    return _mask_signs(jnp.asarray(KSIGNS)[s7.astype(jnp.int32)])


def _sign_scale_words(neg: jax.Array, l: jax.Array) -> jax.Array:
    """(n, 256) negative flags, (n, 8) scale codes -> (n, 8) uint32: per 32 weights 4 x 7 sign bits, l << 28
    (iq2_xxs, iq3_xxs)."""
    n = neg.shape[0]
    s7 = (_sign_masks(neg) & 127).reshape(n, 8, 4)  # (n, J, 4)
    words = jnp.sum(s7 << jnp.array([0, 7, 14, 21], jnp.uint32), axis=-1, dtype=jnp.uint32)  # (n, J)
    return words | (l.astype(jnp.uint32) << 28)


def _word_scales_signs(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(n, 8) uint32 -> scale codes (n, 8) float32, negative flags (n, 256) (the inverse of ``_sign_scale_words``)."""
    s7 = (words[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 127  # (n, J, 4)
    return (words >> 28).astype(jnp.float32), _parity_signs(s7.reshape(words.shape[0], 32))


def _pack_nibble_scales(l: jax.Array) -> jax.Array:
    """(n, 16) 4-bit codes -> (n, 8): byte j holds l[2j] low, l[2j+1] high (iq2_xs, iq2_s)."""
    l = l.astype(jnp.uint8)
    return l[:, 0::2] | (l[:, 1::2] << 4)


def _unpack_nibble_scales(b: jax.Array) -> jax.Array:
    """(n, 8) -> (n, 16) 4-bit codes (the inverse of ``_pack_nibble_scales``)."""
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], 16)


class IQuant(BlockFormat):
    """A ggml i-quant: per group a grid point and signs, per sub-block a 4-bit scale, per 256 an fp16 d.

    A subclass names its gguf-py class (``quant``, whose grid it uses), the
    weights per grid point (``group``) and per scale code (``sub_block``),
    the ``unit`` of the scale codes, whether the signs have even parity, and
    ``pack`` / ``unpack``. A format whose grid carries the signs (iq1_m) sets
    ``signed`` False: its ``neg`` part is all False.
    """

    llama_activation = "q8_k"
    scale_offsets = (0,)
    quant: ClassVar[type]
    sub_block: ClassVar[int]
    group: ClassVar[int]
    unit: ClassVar[float]
    parity: ClassVar[bool]
    signed: ClassVar[bool] = True  # a sign per weight is stored beside the grid point
    scale_levels: ClassVar[int] = 16  # sub-block scale codes l in [0, scale_levels)

    @classmethod
    def grid_values(cls) -> np.ndarray:
        """(K, group) float32 grid values, as NumPy (what ``grid`` puts on the device)."""
        return gguf_grid(cls.quant)

    @classmethod
    def grid(cls) -> jax.Array:
        """(K, group) float32 grid values."""
        return jnp.asarray(cls.grid_values())

    @classmethod
    def pack(cls, d: jax.Array, l: jax.Array, idx: jax.Array, neg: jax.Array) -> jax.Array:
        """d (n,) fp16 values, l (n, J) scale codes, idx (n, 256 / group) grid points, neg (n, 256) bool -> bytes."""
        raise NotImplementedError

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(n, type_size) uint8 -> d (n, 1) float32, l (n, J) float32, idx (n, 256 / group) int32, neg (n, 256)."""
        raise NotImplementedError

    @classmethod
    def dequantize_parts(cls, parts: tuple[jax.Array, ...]) -> jax.Array:
        d, l, idx, neg = parts  # (n, 1), (n, J), (n, 256 / group), (n, 256)
        n = idx.shape[0]
        db = d * (0.5 + l) * jnp.float32(cls.unit)  # (n, J), float32 products in gguf-py's order
        per_weight = jnp.repeat(db, cls.sub_block, axis=1)  # (n, 256)
        values = per_weight * cls.grid()[idx].reshape(n, QK_K)  # (n, 256)
        # gguf-py multiplies by -1, which leaves a NaN as it is; XLA would turn the product into a negation
        return jnp.where(neg & ~jnp.isnan(values), -values, values)  # (n, 256)


class IQ2_XXS(IQuant, ggml_type=GGMLQuantizationType.IQ2_XXS):
    """ggml IQ2_XXS: fp16 d, then per 32 weights 4 point bytes and a u32 of 4 x 7 sign bits and l << 28."""

    quant = gguf.quants.IQ2_XXS
    group = 8
    sub_block = 32
    unit = 0.25
    parity = True

    @classmethod
    def pack(cls, d, l, idx, neg):
        n = idx.shape[0]
        words = _sign_scale_words(neg, l)  # (n, J)
        qs = jnp.concatenate([idx.astype(jnp.uint8).reshape(n, 8, 4), _u32_bytes(words[..., None])], axis=-1)
        return jnp.concatenate([fp16_to_bytes(d), qs.reshape(n, 64)], axis=-1)  # (n, 66)

    @classmethod
    def unpack(cls, blocks):
        n = blocks.shape[0]
        qs = blocks[:, 2:].reshape(n, 8, 8)  # (n, J, 8): 4 point bytes, one u32
        l, neg = _word_scales_signs(_bytes_u32(qs[..., 4:])[..., 0])  # (n, J), (n, 256)
        return bytes_to_fp16(blocks[:, :2]), l, qs[..., :4].reshape(n, 32).astype(jnp.int32), neg


class IQ2_XS(IQuant, ggml_type=GGMLQuantizationType.IQ2_XS):
    """ggml IQ2_XS: fp16 d, per 8 weights a u16 (9-bit point | 7 sign bits << 9), scales[8] (two l per byte)."""

    quant = gguf.quants.IQ2_XS
    group = 8
    sub_block = 16
    unit = 0.25
    parity = True

    @classmethod
    def pack(cls, d, l, idx, neg):
        n = idx.shape[0]
        words = idx.astype(jnp.uint32) | ((_sign_masks(neg) & 127) << 9)  # (n, 32)
        qs = jnp.stack([words & 0xFF, words >> 8], axis=-1).astype(jnp.uint8).reshape(n, 64)  # (n, 64)
        return jnp.concatenate([fp16_to_bytes(d), qs, _pack_nibble_scales(l)], axis=-1)  # (n, 74)

    @classmethod
    def unpack(cls, blocks):
        q = blocks[:, 2:66].reshape(-1, 32, 2).astype(jnp.int32)  # (n, 32, 2)
        words = q[..., 0] | (q[..., 1] << 8)  # (n, 32)
        return (bytes_to_fp16(blocks[:, :2]), _unpack_nibble_scales(blocks[:, 66:74]).astype(jnp.float32),
                words & 511, _parity_signs(words >> 9))


class IQ2_S(IQuant, ggml_type=GGMLQuantizationType.IQ2_S):
    """ggml IQ2_S: fp16 d, qs[32] (low 8 bits of the 10-bit points), signs[32] (all 8 bits),
    qh[8] (2 high bits of point j at bits 2 (j % 4) of byte j / 4), scales[8] (two l per byte)."""

    quant = gguf.quants.IQ2_S
    group = 8
    sub_block = 16
    unit = 0.25
    parity = False

    @classmethod
    def pack(cls, d, l, idx, neg):
        n = idx.shape[0]
        idx = idx.astype(jnp.uint32)  # (n, 32)
        high = (idx >> 8).reshape(n, 8, 4) << jnp.array([0, 2, 4, 6], jnp.uint32)  # (n, 8, 4)
        qh = jnp.sum(high, axis=-1, dtype=jnp.uint32).astype(jnp.uint8)  # (n, 8)
        return jnp.concatenate([fp16_to_bytes(d), (idx & 0xFF).astype(jnp.uint8), _sign_masks(neg).astype(jnp.uint8),
                                qh, _pack_nibble_scales(l)], axis=-1)  # (n, 82)

    @classmethod
    def unpack(cls, blocks):
        n = blocks.shape[0]
        qh = (blocks[:, 66:74, None] >> jnp.array([0, 2, 4, 6], jnp.uint8)) & 3  # (n, 8, 4)
        idx = blocks[:, 2:34].astype(jnp.int32) | (qh.reshape(n, 32).astype(jnp.int32) << 8)  # (n, 32)
        return (bytes_to_fp16(blocks[:, :2]), _unpack_nibble_scales(blocks[:, 74:82]).astype(jnp.float32), idx,
                _mask_signs(blocks[:, 34:66]))


class IQ3_XXS(IQuant, ggml_type=GGMLQuantizationType.IQ3_XXS):
    """ggml IQ3_XXS: fp16 d, qs[64] (one point byte per 4 weights), then per 32 weights a u32 of
    4 x 7 sign bits and l << 28."""

    quant = gguf.quants.IQ3_XXS
    group = 4
    sub_block = 32
    unit = 0.5
    parity = True

    @classmethod
    def pack(cls, d, l, idx, neg):
        words = _sign_scale_words(neg, l)  # (n, J)
        return jnp.concatenate([fp16_to_bytes(d), idx.astype(jnp.uint8), _u32_bytes(words)], axis=-1)  # (n, 98)

    @classmethod
    def unpack(cls, blocks):
        l, neg = _word_scales_signs(_bytes_u32(blocks[:, 66:98]))  # (n, J), (n, 256)
        return bytes_to_fp16(blocks[:, :2]), l, blocks[:, 2:66].astype(jnp.int32), neg


IQ1M_DELTA = 0.125  # ggml's IQ1M_DELTA (= IQ1S_DELTA, gguf-py's IQ1_M.delta)
IQ1M_GRID_POINTS = 2048  # points of the unshifted {-1, 0, 1}^8 grid; index + 2048 is the point shifted by -delta


class IQ1_M(IQuant, ggml_type=GGMLQuantizationType.IQ1_M):
    """ggml IQ1_M: qs[32] (low 8 bits of the 11-bit points), qh[16] (per 16 weights two nibbles: the
    point's 3 high bits, then the delta's sign), scales[8] (four u16: 4 x 3-bit l, then a nibble of fp16 d).

    A group's value is d * (2 l + 1) * (grid[point] +- 1/8): ``grid_values`` lists the 2048 points
    shifted by +1/8, then by -1/8, so the point index here is the stored one plus 2048 where the delta
    bit is set, and the value is d * (0.5 + l) * 2 * grid[index] (exactly gguf-py's float32 products:
    doubling is exact). No sign bits: ``neg`` is all False.
    """

    quant = gguf.quants.IQ1_M
    group = 8
    sub_block = 16
    unit = 2.0
    parity = False
    signed = False
    scale_levels = 8
    scale_offsets = ()  # d is not stored in two whole bytes: ``fp16_scale_bits``

    @classmethod
    def grid_values(cls) -> np.ndarray:
        base = gguf_grid(cls.quant)  # (2048, 8) in {-1, 0, 1}
        return np.concatenate([base + np.float32(IQ1M_DELTA), base - np.float32(IQ1M_DELTA)])  # (4096, 8), exact

    @classmethod
    def pack(cls, d, l, idx, neg):
        """``neg`` is not stored (the grid carries the signs) and must be all False."""
        n = idx.shape[0]
        idx = idx.astype(jnp.uint32)  # (n, 32)
        point, shift = idx % IQ1M_GRID_POINTS, idx // IQ1M_GRID_POINTS  # (n, 32) x2
        nib = ((point >> 8) | (shift << 3)).reshape(n, 16, 2)  # (n, 16, 2)
        qh = (nib[..., 0] | (nib[..., 1] << 4)).astype(jnp.uint8)  # (n, 16)
        words = jnp.sum(l.astype(jnp.uint32).reshape(n, 4, 4) << jnp.array([0, 3, 6, 9], jnp.uint32), axis=-1,
                        dtype=jnp.uint32)  # (n, 4): disjoint bits, sum == or
        bits = jax.lax.bitcast_convert_type(d.reshape(n).astype(jnp.float16), jnp.uint16).astype(jnp.uint32)  # (n,)
        words = words | (((bits[:, None] >> jnp.array([0, 4, 8, 12], jnp.uint32)) & 0xF) << 12)  # (n, 4)
        sc = jnp.stack([words & 0xFF, words >> 8], axis=-1).astype(jnp.uint8).reshape(n, 8)  # (n, 8)
        return jnp.concatenate([(point & 0xFF).astype(jnp.uint8), qh, sc], axis=-1)  # (n, 56)

    @classmethod
    def unpack(cls, blocks):
        n = blocks.shape[0]
        qh = blocks[:, 32:48, None].astype(jnp.int32) >> jnp.array([0, 4], jnp.int32)  # (n, 16, 2)
        qh = qh.reshape(n, 32)  # (n, 32): the nibble of each group
        idx = blocks[:, :32].astype(jnp.int32) | ((qh & 7) << 8) | (((qh >> 3) & 1) * IQ1M_GRID_POINTS)  # (n, 32)
        words = blocks[:, 48:56].reshape(n, 4, 2).astype(jnp.uint32)  # (n, 4, 2)
        words = words[..., 0] | (words[..., 1] << 8)  # (n, 4)
        l = (words[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint32)) & 7  # (n, 4, 4)
        bits = jnp.sum((words >> 12) << jnp.array([0, 4, 8, 12], jnp.uint32), axis=-1, dtype=jnp.uint32)  # (n,)
        d = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)[:, None]  # (n, 1)
        return d, l.reshape(n, 16).astype(jnp.float32), idx, jnp.zeros((n, QK_K), bool)

    @classmethod
    def fp16_scale_bits(cls, blocks: np.ndarray) -> np.ndarray:
        words = np.ascontiguousarray(np.asarray(blocks, np.uint8)[:, 48:56]).view("<u2")  # (n, 4)
        bits = (words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0xF0) | ((words[:, 2] >> 4) & 0xF00) | (words[:, 3] & 0xF000)
        return bits.astype(np.uint16)[:, None]  # (n, 1)

    @classmethod
    def with_fp16_scale_bits(cls, blocks: np.ndarray, bits: np.ndarray) -> np.ndarray:
        out = np.array(blocks, np.uint8)  # (n, 56), a copy
        words = np.ascontiguousarray(out[:, 48:56]).view("<u2") & np.uint16(0x0FFF)  # (n, 4): the codes kept
        b = np.asarray(bits, np.uint16).reshape(-1, 1)  # (n, 1)
        words |= ((b >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)) << np.uint16(12)
        out[:, 48:56] = words.astype("<u2").view(np.uint8)
        return out
