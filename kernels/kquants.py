"""ggml k-quants, the reading half: the block layouts and values of q2_k, q3_k, q4_k, q5_k, q6_k.

A k-quant super-block holds 256 weights in sub-blocks of 16 or 32. Each
sub-block has an integer scale code ls (and, for q2_k/q4_k/q5_k, a min code
lm); the super-block has fp16 d (and dmin). A weight with code q is

    affine (q2_k, q4_k, q5_k):  (d * ls) * q - dmin * lm,   q in [0, nmax]
    symmetric (q3_k, q6_k):     (d * ls) * q,               q in [-n, n - 1]

How the codes and scales are chosen is ``kquants_encode.py``.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType

from moeheal.kernels.formats import BlockFormat, bytes_to_fp16, fp16_to_bytes

QK_K = 256


class KQuant(BlockFormat):
    """A ggml k-quant: 256 weights in sub-blocks with integer scale (and min) codes.

    A subclass gives its geometry (``sub_block``, ``code_range`` of the
    weight codes, ``scale_range`` of the sub-block scale codes), whether it has
    mins, and ``pack`` / ``unpack``.
    """

    fp16_parts = (0, 1)  # d, dmin (dmin is 0 where the format has no mins)
    llama_activation = "q8_k"
    sub_block: ClassVar[int]
    has_min: ClassVar[bool]
    code_range: ClassVar[tuple[int, int]]
    scale_range: ClassVar[tuple[int, int]]

    @classmethod
    def code_scale_parts(cls) -> tuple[tuple[int, int, int], ...]:
        """(part, lo, hi) of the integer sub-block scale codes `unpack` returns: ls, and lm where the
        format has mins, each in ``scale_range``."""
        lo, hi = cls.scale_range
        return ((2, lo, hi), (3, lo, hi)) if cls.has_min else ((2, lo, hi),)

    @classmethod
    def pack(cls, d: jax.Array, dmin: jax.Array, ls: jax.Array, lm: jax.Array, q: jax.Array) -> jax.Array:
        """d, dmin (n,) fp16 values; ls, lm (n, k) and q (n, 256) integer-valued -> (n, type_size) uint8."""
        raise NotImplementedError

    @classmethod
    def unpack(cls, blocks: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """(n, type_size) uint8 -> d, dmin (n, 1), ls, lm (n, k), q (n, 256), all float32 (dmin, lm 0 if none)."""
        raise NotImplementedError

    @classmethod
    def dequantize_parts(cls, parts: tuple[jax.Array, ...]) -> jax.Array:
        d, dmin, ls, lm, q = parts  # (n, 1) x2, (n, k) x2, (n, 256)
        n = q.shape[0]
        k = QK_K // cls.sub_block
        dl = (d * ls)[..., None]  # (n, k, 1), float32 products as gguf-py
        values = dl * q.reshape(n, k, cls.sub_block)  # (n, k, S)
        if cls.has_min:
            # where both operands are NaN, numpy keeps the first one's payload; XLA may not, so say it
            values = jnp.where(jnp.isnan(values), values, values - (dmin * lm)[..., None])  # (n, k, S)
        return values.reshape(n, QK_K)


def _pack_2bit(q: jax.Array) -> jax.Array:
    """(n, 256) codes in [0, 3] -> (n, 64): byte 32h + l holds weights 128h + 32j + l in bits 2j."""
    n = q.shape[0]
    codes = q.astype(jnp.uint8).reshape(n, 2, 4, 32)  # (n, half, j, l)
    shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
    return jnp.sum(codes << shifts, axis=2, dtype=jnp.uint8).reshape(n, 64)  # disjoint bits: sum == or


def _unpack_2bit(qs: jax.Array) -> jax.Array:
    """(n, 64) -> (n, 256) codes in [0, 3] (the inverse of ``_pack_2bit``)."""
    n = qs.shape[0]
    shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)


def _pack_bits(bits: jax.Array) -> jax.Array:
    """(n, 256) bits -> (n, 32): bit j of byte l is weight 32j + l (q3_k's hmask, q5_k's qh)."""
    n = bits.shape[0]
    shifts = jnp.arange(8, dtype=jnp.uint8).reshape(1, 8, 1)
    return jnp.sum(bits.astype(jnp.uint8).reshape(n, 8, 32) << shifts, axis=1, dtype=jnp.uint8)  # (n, 32)


def _unpack_bits(packed: jax.Array) -> jax.Array:
    """(n, 32) -> (n, 256) bits (the inverse of ``_pack_bits``)."""
    n = packed.shape[0]
    shifts = jnp.arange(8, dtype=jnp.uint8).reshape(1, 8, 1)
    return ((packed[:, None, :] >> shifts) & 1).reshape(n, QK_K)


def _pack_scales_k4(ls: jax.Array, lm: jax.Array) -> jax.Array:
    """q4_k/q5_k's 12 scale bytes from 6-bit codes ls, lm (n, 8) (ggml's get_scale_min_k4 layout)."""
    ls, lm = ls.astype(jnp.uint8), lm.astype(jnp.uint8)  # (n, 8) x2
    first = (ls[:, :4] & 63) | ((ls[:, 4:] >> 4) << 6)  # (n, 4)
    second = (lm[:, :4] & 63) | ((lm[:, 4:] >> 4) << 6)  # (n, 4)
    third = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)  # (n, 4)
    return jnp.concatenate([first, second, third], axis=-1)  # (n, 12)


def _unpack_scales_k4(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(n, 12) -> ls, lm (n, 8) float32 (the inverse of ``_pack_scales_k4``)."""
    d, m, md = scales[:, :4], scales[:, 4:8], scales[:, 8:]  # (n, 4) x3
    ls = jnp.concatenate([d & 63, (md & 0xF) | ((d >> 6) << 4)], axis=-1)  # (n, 8)
    lm = jnp.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)  # (n, 8)
    return ls.astype(jnp.float32), lm.astype(jnp.float32)


def _pack_nibbles(q: jax.Array) -> jax.Array:
    """(n, 256) 4-bit codes -> (n, 128): byte 32c + l holds weight 64c + l (low) and 64c + 32 + l (high)."""
    n = q.shape[0]
    nib = q.astype(jnp.uint8).reshape(n, 4, 2, 32)  # (n, c, half, l)
    return (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n, 128)


def _unpack_nibbles(qs: jax.Array) -> jax.Array:
    """(n, 128) -> (n, 256) 4-bit codes (the inverse of ``_pack_nibbles``)."""
    n = qs.shape[0]
    shifts = jnp.array([0, 4], jnp.uint8).reshape(1, 1, 2, 1)
    return ((qs.reshape(n, 4, 1, 32) >> shifts) & 0xF).reshape(n, QK_K)


class Q2_K(KQuant, ggml_type=GGMLQuantizationType.Q2_K):
    """ggml Q2_K: 16 x 16 weights; scales[16] (ls | lm << 4), qs[64] (tq2_0's layout), fp16 d, fp16 dmin."""

    scale_offsets = (80, 82)
    sub_block = 16
    has_min = True
    code_range = (0, 3)
    scale_range = (0, 15)

    @classmethod
    def pack(cls, d, dmin, ls, lm, q):
        scales = ls.astype(jnp.uint8) | (lm.astype(jnp.uint8) << 4)  # (n, 16)
        return jnp.concatenate([scales, _pack_2bit(q), fp16_to_bytes(d), fp16_to_bytes(dmin)], axis=-1)  # (n, 84)

    @classmethod
    def unpack(cls, blocks):
        sc = blocks[:, :16]  # (n, 16)
        q = _unpack_2bit(blocks[:, 16:80]).astype(jnp.float32)  # (n, 256)
        return (bytes_to_fp16(blocks[:, 80:82]), bytes_to_fp16(blocks[:, 82:84]),
                (sc & 0xF).astype(jnp.float32), (sc >> 4).astype(jnp.float32), q)


class Q3_K(KQuant, ggml_type=GGMLQuantizationType.Q3_K):
    """ggml Q3_K: 16 x 16 weights, q in [-4, 3]; hmask[32] (bit set: q >= 0), qs[64] (low 2 bits of q + 4),
    scales[12] (6-bit ls + 32: low nibbles in bytes 0-7, high bit pairs in bytes 8-11), fp16 d."""

    scale_offsets = (108,)
    sub_block = 16
    has_min = False
    code_range = (-4, 3)
    scale_range = (-32, 31)

    @classmethod
    def pack(cls, d, dmin, ls, lm, q):
        n = q.shape[0]
        codes = (q + 4).astype(jnp.uint8)  # (n, 256) in [0, 7]
        l6 = (ls + 32).astype(jnp.uint8)  # (n, 16) in [0, 63]
        low = (l6[:, :8] & 0xF) | ((l6[:, 8:] & 0xF) << 4)  # (n, 8)
        shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 4, 1)
        high = jnp.sum(((l6 >> 4) & 3).reshape(n, 4, 4) << shifts, axis=1, dtype=jnp.uint8)  # (n, 4)
        return jnp.concatenate([_pack_bits(codes >> 2), _pack_2bit(codes & 3), low, high, fp16_to_bytes(d)],
                               axis=-1)  # (n, 110)

    @classmethod
    def unpack(cls, blocks):
        n = blocks.shape[0]
        q = _unpack_2bit(blocks[:, 32:96]).astype(jnp.float32) - 4.0 * (1 - _unpack_bits(blocks[:, :32])).astype(
            jnp.float32)  # (n, 256)
        low = blocks[:, 96:104]  # (n, 8)
        high = blocks[:, 104:108]  # (n, 4)
        shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 4, 1)
        l6 = (jnp.concatenate([low & 0xF, low >> 4], axis=-1)
              | (((high[:, None, :] >> shifts) & 3).reshape(n, 16) << 4))  # (n, 16)
        ls = l6.astype(jnp.float32) - 32.0  # (n, 16)
        d = bytes_to_fp16(blocks[:, 108:110])  # (n, 1)
        return d, jnp.zeros_like(d), ls, jnp.zeros_like(ls), q


class Q4_K(KQuant, ggml_type=GGMLQuantizationType.Q4_K):
    """ggml Q4_K: 8 x 32 weights, q in [0, 15]; fp16 d, fp16 dmin, scales[12] (6-bit ls, lm), qs[128]."""

    scale_offsets = (0, 2)
    sub_block = 32
    has_min = True
    code_range = (0, 15)
    scale_range = (0, 63)

    @classmethod
    def pack(cls, d, dmin, ls, lm, q):
        return jnp.concatenate([fp16_to_bytes(d), fp16_to_bytes(dmin), _pack_scales_k4(ls, lm), _pack_nibbles(q)],
                               axis=-1)  # (n, 144)

    @classmethod
    def unpack(cls, blocks):
        ls, lm = _unpack_scales_k4(blocks[:, 4:16])  # (n, 8) x2
        return (bytes_to_fp16(blocks[:, 0:2]), bytes_to_fp16(blocks[:, 2:4]), ls, lm,
                _unpack_nibbles(blocks[:, 16:144]).astype(jnp.float32))


class Q5_K(KQuant, ggml_type=GGMLQuantizationType.Q5_K):
    """ggml Q5_K: Q4_K plus a fifth bit per weight, qh[32] (bit j of byte l: weight 32j + l), q in [0, 31]."""

    scale_offsets = (0, 2)
    sub_block = 32
    has_min = True
    code_range = (0, 31)
    scale_range = (0, 63)

    @classmethod
    def pack(cls, d, dmin, ls, lm, q):
        codes = q.astype(jnp.uint8)  # (n, 256)
        return jnp.concatenate([fp16_to_bytes(d), fp16_to_bytes(dmin), _pack_scales_k4(ls, lm),
                                _pack_bits(codes >> 4), _pack_nibbles(codes & 0xF)], axis=-1)  # (n, 176)

    @classmethod
    def unpack(cls, blocks):
        ls, lm = _unpack_scales_k4(blocks[:, 4:16])  # (n, 8) x2
        q = _unpack_nibbles(blocks[:, 48:176]) | (_unpack_bits(blocks[:, 16:48]) << 4)  # (n, 256)
        return bytes_to_fp16(blocks[:, 0:2]), bytes_to_fp16(blocks[:, 2:4]), ls, lm, q.astype(jnp.float32)


class Q6_K(KQuant, ggml_type=GGMLQuantizationType.Q6_K):
    """ggml Q6_K: 16 x 16 weights, q in [-32, 31]; ql[128] (low nibbles of q + 32), qh[64] (high bit pairs),
    int8 scales[16], fp16 d."""

    scale_offsets = (208,)
    sub_block = 16
    has_min = False
    code_range = (-32, 31)
    scale_range = (-128, 127)

    @classmethod
    def pack(cls, d, dmin, ls, lm, q):
        n = q.shape[0]
        codes = (q + 32).astype(jnp.uint8).reshape(n, 2, 2, 64)  # (n, half, quarter pair, byte)
        ql = (codes[:, :, 0] & 0xF) | ((codes[:, :, 1] & 0xF) << 4)  # (n, 2, 64)
        shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
        qh = jnp.sum((codes.reshape(n, 2, 4, 32) >> 4) << shifts, axis=2, dtype=jnp.uint8)  # (n, 2, 32)
        scales = jax.lax.bitcast_convert_type(ls.astype(jnp.int8), jnp.uint8)  # (n, 16)
        return jnp.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales, fp16_to_bytes(d)], axis=-1)  # (n, 210)

    @classmethod
    def unpack(cls, blocks):
        n = blocks.shape[0]
        ql = (blocks[:, :128].reshape(n, 2, 1, 64) >> jnp.array([0, 4], jnp.uint8).reshape(1, 1, 2, 1)) & 0xF
        qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)) & 3
        q = (ql.reshape(n, QK_K) | (qh.reshape(n, QK_K) << 4)).astype(jnp.float32) - 32.0  # (n, 256)
        ls = jax.lax.bitcast_convert_type(blocks[:, 192:208], jnp.int8).astype(jnp.float32)  # (n, 16)
        d = bytes_to_fp16(blocks[:, 208:210])  # (n, 1)
        return d, jnp.zeros_like(d), ls, jnp.zeros_like(ls), q
