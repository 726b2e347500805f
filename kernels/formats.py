"""ggml block formats in JAX: the registry, the scaled-grid formats (tq2_0,
iq4_nl) and q8_0; the k-quants live in ``kquants.py`` and register here too.

Each format is a small class in the style of gguf-py's ``quants.py``,
registered by its ggml type: its geometry comes from ``gguf.GGML_QUANT_SIZES``,
it packs and unpacks ggml's exact byte layout, quantizes blocks, says where its
fp16 super-block scales live (what alpha multiplies) and whether GPTQ rounding
applies. The pipeline asks the registry (``format_of``) and never names a
format. The bytes are ggml's, so llama.cpp and gguf-py read our output as is;
what is ours is how the scales and the codes are chosen.

tq2_0 and iq4_nl are "scaled grid" formats: a block stores one fp16 scale d and
per weight an index into a fixed grid of levels, value = d * level. We choose d
and the indices to minimise the importance-weighted squared error
``sum_i w_i (x_i - d * level_i)^2`` by scanning candidate scales (both signs,
so asymmetric grids are used in either orientation), assigning nearest levels,
refitting d in closed form, and scoring each candidate *after* rounding d to
fp16 and re-assigning the levels, so the error we minimise is the error of the
bytes we write.

Every function here is a pure, jit-able function of arrays: no files, no config.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# ---------------------------------------------------------------------------
# fp16 scale <-> bytes (little endian, as ggml stores ggml_fp16_t)
# ---------------------------------------------------------------------------


def fp16_round(d: jax.Array) -> jax.Array:
    """Round float32 scales to the nearest fp16 value, returned as float32."""
    return d.astype(jnp.float16).astype(jnp.float32)


def fp16_to_bytes(d: jax.Array) -> jax.Array:
    """(n,) or (n, 1) float32 scales (the latter as ``unpack`` returns them) -> (n, 2) uint8, little-endian fp16."""
    bits = jax.lax.bitcast_convert_type(d.reshape(d.shape[0]).astype(jnp.float16), jnp.uint16)  # (n,)
    return jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)  # (n, 2)


def bytes_to_fp16(b: jax.Array) -> jax.Array:
    """(n, 2) uint8 little-endian fp16 -> (n, 1) float32 (exact widening)."""
    bits = b[:, 0].astype(jnp.uint16) | (b[:, 1].astype(jnp.uint16) << 8)  # (n,)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[:, None]  # (n, 1)


# ---------------------------------------------------------------------------
# Importance-weighted scale search over a fixed grid of levels
# ---------------------------------------------------------------------------


def _is_long_integer_run(levels: Sequence[float]) -> bool:
    """True for grids of more than 8 consecutive integers (the k-quants' code and scale grids)."""
    return len(levels) > 8 and all(float(b) - float(a) == 1.0 and float(a).is_integer()
                                   for a, b in zip(levels[:-1], levels[1:]))


def round_ties_down(y: jax.Array, lo: float, hi: float) -> jax.Array:
    """Nearest integer in [lo, hi], ties to the lower one, as a float.

    Exactly the midpoint count of ``nearest_level_value`` on a run of
    consecutive integers (``r - y`` is exact: r and y are within one of each
    other), in a constant number of ops however long the run.
    """
    r = jnp.round(y)  # (...,) ties to even
    r = jnp.where(r - y == 0.5, r - 1.0, r)  # (...,) ties down
    return jnp.clip(r, lo, hi)


def nearest_level(y: jax.Array, levels: Sequence[float]) -> jax.Array:
    """Index of the grid level nearest to each y (levels sorted ascending).

    Counting the midpoints below y is branch-free and works for any sorted
    grid (4 levels for tq2_0, 16 non-uniform ones for iq4_nl). The levels are
    Python constants, so the loop unrolls into elementwise ops XLA fuses.
    Long runs of consecutive integers (k-quant grids of up to 256 levels)
    round arithmetically instead, with the same ties.
    """
    if _is_long_integer_run(levels):
        return (round_ties_down(y, levels[0], levels[-1]) - levels[0]).astype(jnp.int32)  # (...,)
    idx = jnp.zeros(y.shape, jnp.int32)  # (...,)
    for lo, hi in zip(levels[:-1], levels[1:]):
        idx = idx + (y > 0.5 * (lo + hi)).astype(jnp.int32)
    return idx


def nearest_level_value(y: jax.Array, levels: Sequence[float]) -> jax.Array:
    """The grid level nearest to each y, by the same midpoint comparisons.

    A staircase sum instead of ``levels[nearest_level(y)]``: no gather, which
    is what the scale search evaluates tens of times per block.
    """
    if _is_long_integer_run(levels):
        return round_ties_down(y, levels[0], levels[-1]).astype(jnp.float32)  # (...,)
    value = jnp.full(y.shape, levels[0], jnp.float32)  # (...,)
    for lo, hi in zip(levels[:-1], levels[1:]):
        value = value + jnp.where(y > 0.5 * (lo + hi), hi - lo, 0.0)
    return value


def scaled(x: jax.Array, d: jax.Array) -> jax.Array:
    """x (n, B) / d (n,), with 0 where d = 0 (a zero scale represents every weight as 0)."""
    safe_d = jnp.where(d == 0, 1.0, d)  # (n,)
    return jnp.where(d[:, None] == 0, 0.0, x / safe_d[:, None])  # (n, B)


def assign_levels(x: jax.Array, d: jax.Array, levels: Sequence[float]) -> jax.Array:
    """Nearest level indices of x (n, B) for per-block scales d (n,)."""
    return nearest_level(scaled(x, d), levels)  # (n, B)


def weighted_error(x: jax.Array, w: jax.Array, d: jax.Array, q: jax.Array) -> jax.Array:
    """sum_i w_i (x_i - d q_i)^2 per block: x, w, q (n, B), d (n,) -> (n,)."""
    r = x - d[:, None] * q  # (n, B)
    return jnp.sum(w * r * r, axis=-1)  # (n,)


def refit_scale(x: jax.Array, w: jax.Array, q: jax.Array, d_fallback: jax.Array) -> jax.Array:
    """Weighted least-squares scale for fixed levels q: sum w x q / sum w q^2.

    Falls back to ``d_fallback`` where the denominator vanishes (all weights 0
    or every level 0), where any scale is as good as any other.
    """
    num = jnp.sum(w * x * q, axis=-1)  # (n,)
    den = jnp.sum(w * q * q, axis=-1)  # (n,)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), d_fallback)  # (n,)


def search_grid_scale(
    x: jax.Array, w: jax.Array, levels: Sequence[float], divisors: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Choose fp16 scale and level indices per block minimising weighted error.

    x, w: (n, B) float32 weights and importance; levels: the K grid values,
    ascending, as Python floats; divisors (C,)
    candidate ratios: candidate scale = x_ext / divisor, where x_ext is the
    block's signed largest-magnitude value (as ggml's make_qx_quants starts
    from). Positive and negative divisors try both orientations of an
    asymmetric grid. Each candidate is refit by weighted least squares; both
    the raw and the refit scale are rounded to fp16, the levels re-assigned for
    the rounded scale, and scored; the best survives (d = 0, all weights 0,
    is the starting point). Scanning over candidates and carrying only the
    best scale keeps memory at O(n * B) whatever the number of candidates; the
    levels are assigned once at the end.

    Returns (d (n,) float32 holding fp16 values, idx (n, B) int32).
    """
    amax_pos = jnp.argmax(jnp.abs(x), axis=-1)  # (n,)
    x_ext = jnp.take_along_axis(x, amax_pos[:, None], axis=-1)[:, 0]  # (n,)
    grid = tuple(float(v) for v in levels)

    def keep_better(best: tuple[jax.Array, jax.Array], d: jax.Array) -> tuple[jax.Array, jax.Array]:
        err_b, d_b = best
        d16 = fp16_round(d)  # (n,)
        err = weighted_error(x, w, d16, nearest_level_value(scaled(x, d16), grid))  # (n,)
        better = err < err_b  # (n,)
        return jnp.where(better, err, err_b), jnp.where(better, d16, d_b)

    def step(best, divisor):
        d_cand = x_ext / divisor  # (n,)
        q = nearest_level_value(scaled(x, d_cand), grid)  # (n, B)
        d_fit = refit_scale(x, w, q, d_cand)  # (n,)
        return keep_better(keep_better(best, d_cand), d_fit), None

    init = (jnp.sum(w * x * x, axis=-1), jnp.zeros(x.shape[:1], jnp.float32))  # error and d of the all-zero block
    (_, d), _ = jax.lax.scan(step, init, divisors.astype(jnp.float32))
    return d, assign_levels(x, d, grid)


def uniform_importance(x: jax.Array, importance: jax.Array | None) -> jax.Array:
    """Importance as an array shaped like x; 1 everywhere when none is given."""
    return jnp.ones_like(x) if importance is None else jnp.broadcast_to(importance, x.shape).astype(jnp.float32)


# ---------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------


FORMATS: dict[str, type[BlockFormat]] = {}
FORMATS_BY_TYPE: dict[GGMLQuantizationType, type[BlockFormat]] = {}


class BlockFormat:
    """A ggml block format: geometry, type, (de)quantization of blocks, scales.

    A concrete subclass names its ggml type in the class statement
    (``class TQ2_0(GridFormat, ggml_type=GGMLQuantizationType.TQ2_0)``); the
    name, block and type sizes and bits per weight then come from gguf-py, so
    they cannot drift from ggml's, and the class is registered in ``FORMATS``.

    ``scale_offsets`` are the byte offsets in a block of the fp16 super-block
    scales that a global factor multiplies (the scale d; for formats with a min
    also dmin, so that every dequantized value is multiplied by the factor).

    ``unpack`` splits blocks into their parts (fp16 scales, integer scale codes,
    weight codes, as float or integer arrays), ``pack`` writes them back, and
    ``dequantize_parts`` computes the values from the parts with the same float32
    products as gguf-py. Dequantizing is the two composed, so code that tunes a
    part (the fp16 scales at ``fp16_parts``, or the codes) and decodes it through
    ``dequantize_parts`` sees exactly the values the written bytes will decode to,
    and JAX can differentiate the values with respect to the float parts.

    GPTQ rounding (``supports_gptq``) sees a block as ``block_size //
    sub_block`` sub-blocks: ``gptq_block_plan`` fixes what is shared by the
    block when its first column starts, ``gptq_sub_plan`` what is shared by a
    sub-block when its first column starts (both from the weights as updated
    by the error feedback so far), ``gptq_round`` rounds one column given the
    sub-block's plan and ``gptq_pack`` writes the block's bytes. Codebook
    formats round ``gptq_group`` columns at once (``gptq_round_group``).
    """

    name: ClassVar[str]
    ggml_type: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    bits_per_weight: ClassVar[float]
    scale_offsets: ClassVar[tuple[int, ...]]
    fp16_parts: ClassVar[tuple[int, ...]] = (0,)  # positions in ``unpack``'s parts of the stored fp16 scales
    supports_gptq: ClassVar[bool] = False
    sub_block: ClassVar[int]
    # What llama.cpp's CPU backend converts the other operand (the activations) of a matrix product
    # with this format to before the dot products (ggml-cpu.c type_traits_cpu[...].vec_dot_type):
    # "q8_0" (an fp16 scale per 32) or "q8_k" (a float32 scale per 256); `kernels.narrow` says when
    # that conversion overflows.
    llama_activation: ClassVar[str]
    gptq_group: ClassVar[int] = 1

    def __init_subclass__(cls, ggml_type: GGMLQuantizationType | None = None, **kwargs: Any) -> None:
        """Register a concrete format; families (no ggml_type) stay abstract."""
        super().__init_subclass__(**kwargs)
        if ggml_type is None:
            return
        cls.ggml_type = ggml_type
        cls.name = ggml_type.name.lower()
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[ggml_type]
        cls.bits_per_weight = cls.type_size * 8 / cls.block_size
        FORMATS[cls.name] = cls
        FORMATS_BY_TYPE[ggml_type] = cls

    @classmethod
    def quantize_blocks(cls, x: jax.Array, importance: jax.Array | None = None) -> jax.Array:
        """(n, block_size) float32 [+ (n, block_size) importance] -> (n, type_size) uint8."""
        raise NotImplementedError

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
        blocks = raw.reshape(-1, cls.type_size).copy()  # (n, type_size)
        for off in cls.scale_offsets:
            old = blocks[:, off:off + 2].view(np.float16)[:, 0].astype(np.float32)  # (n,)
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
            blocks[:, off:off + 2] = new[:, None].view(np.uint8)
        return blocks.reshape(raw.shape)

    @classmethod
    def gptq_block_plan(cls, x: jax.Array, importance: jax.Array) -> Any:
        """GPTQ: what a block fixes when it starts; x, importance (n, block_size)."""
        raise NotImplementedError

    @classmethod
    def gptq_sub_plan(cls, plan: Any, x: jax.Array, importance: jax.Array) -> Any:
        """GPTQ: what a sub-block fixes when it starts; x, importance (n, sub_block)."""
        raise NotImplementedError

    @classmethod
    def gptq_round(cls, sub: Any, col: jax.Array) -> tuple[jax.Array, jax.Array]:
        """GPTQ: one column (n,) -> codes (n,) int32 and their dequantized values (n,)."""
        raise NotImplementedError

    @classmethod
    def gptq_round_group(cls, sub: Any, cols: jax.Array, upper: jax.Array) -> tuple[jax.Array, jax.Array]:
        """GPTQ: ``gptq_group`` columns (n, g) rounded together -> codes (n, g) int32 and values (n, g).

        upper (g, g) is the group's block of the upper Cholesky factor U of
        H^-1: the group's error e costs ``|| e U^-1 ||^2``. For one column
        the nearest level is best whatever U, so this rounds it with ``gptq_round``.
        """
        code, value = cls.gptq_round(sub, cols[:, 0])  # (n,) x2
        return code[:, None], value[:, None]

    @classmethod
    def gptq_pack(cls, plan: Any, subs: Any, codes: jax.Array) -> jax.Array:
        """GPTQ: block plan, sub plans stacked on a leading sub-block axis, codes (n, block_size) -> bytes."""
        raise NotImplementedError


def format_of(fmt: str | GGMLQuantizationType) -> type[BlockFormat]:
    """The format class registered under a name ("q2_k") or a ggml type; ValueError names the known ones."""
    cls = FORMATS_BY_TYPE.get(fmt) if isinstance(fmt, GGMLQuantizationType) else FORMATS.get(fmt)
    if cls is None:
        raise ValueError(f"unknown format {fmt!r}; known: {sorted(FORMATS)}")
    return cls


class GridFormat(BlockFormat):
    """A block of one fp16 scale and per-weight indices into a fixed level grid."""

    levels: ClassVar[tuple[int, ...]]
    divisors: ClassVar[tuple[float, ...]]
    supports_gptq = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A grid block is one GPTQ sub-block."""
        super().__init_subclass__(**kwargs)
        if "ggml_type" in kwargs:
            cls.sub_block = cls.block_size

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
    def search(cls, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Importance-weighted scale search: (n, B) x, w -> d (n,), idx (n, B)."""
        return search_grid_scale(x, w, cls.levels, jnp.asarray(cls.divisors, jnp.float32))

    @classmethod
    def quantize_blocks(cls, x: jax.Array, importance: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)  # (n, B)
        d, idx = cls.search(x, uniform_importance(x, importance))  # (n,), (n, B)
        return cls.pack(d, idx)  # (n, type_size)

    @classmethod
    def dequantize_parts(cls, parts: tuple[jax.Array, ...]) -> jax.Array:
        d, idx = parts  # (n, 1), (n, B)
        return d * cls.level_grid()[idx]  # (n, B), one float32 product, as gguf-py

    @classmethod
    def gptq_block_plan(cls, x: jax.Array, importance: jax.Array) -> jax.Array:
        """The block's fp16 scale d (n,), by the same search as plain rounding."""
        d, _ = cls.search(x, importance)  # (n,)
        return d

    @classmethod
    def gptq_sub_plan(cls, plan: jax.Array, x: jax.Array, importance: jax.Array) -> jax.Array:
        """The block is the sub-block: its scale is already fixed."""
        return plan

    @classmethod
    def gptq_round(cls, sub: jax.Array, col: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = scaled(col[:, None], sub)  # (n, 1)
        return nearest_level(y, cls.levels)[:, 0], sub * nearest_level_value(y, cls.levels)[:, 0]  # (n,) x2

    @classmethod
    def gptq_pack(cls, plan: jax.Array, subs: jax.Array, codes: jax.Array) -> jax.Array:
        return cls.pack(plan, codes)  # (n, type_size)


def _tq2_0_divisors() -> tuple[float, ...]:
    """Candidate x_ext / d ratios for tq2_0's levels {-1, 0, 1, 2}.

    Positive ratios put the block's extreme on the grid's long side, negative
    ones on its short side. With 256 weights per block the best scale clips
    the few extremes hard (measured optimum ratios reach ~9 on heavy-tailed
    data), hence the wide geometric spread; 40 candidates come within 0.1% of
    a 900-candidate scan. The endpoints 1 and -1 are exactly gguf-py's
    d = max|x| choice, so we never do worse than it.
    """
    long_side = np.geomspace(1.0, 10.0, 24)  # (24,)
    short_side = -np.geomspace(1.0, 7.0, 16)  # (16,)
    return tuple(float(v) for v in np.concatenate([long_side, short_side]))


class TQ2_0(GridFormat, ggml_type=GGMLQuantizationType.TQ2_0):
    """ggml TQ2_0: 256 weights, 64 bytes of 2-bit codes then fp16 d; value = (q-1)*d.

    Byte j of the 64 holds, in bit pairs 0,2,4,6, the codes of weights
    32*k + j%32 + 128*(j//32) for k = 0..3 (gguf-py's TQ2_0 layout).
    """

    scale_offsets = (64,)
    llama_activation = "q8_k"
    levels = (-1, 0, 1, 2)
    divisors = _tq2_0_divisors()

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


def _iq4_nl_divisors() -> tuple[float, ...]:
    """Candidate x_ext / d ratios for iq4_nl's grid (-127 .. 113).

    ggml's own candidates (ratio 127, and t - 127 for t in -7..7) plus a wider
    geometric spread on both sides: 32-weight blocks still gain from clipping
    their extreme (a 1000-candidate scan puts a quarter of the optimum ratios
    outside ggml's range); on random data the wide set cuts the weighted error
    by 3-8% over ggml's set alone and comes within 0.4% of the dense scan.
    """
    ggml_own = np.concatenate([[127.0], np.arange(-7, 8) - 127.0])  # (16,)
    wide = np.geomspace(100.0, 220.0, 12)  # (12,)
    return tuple(float(v) for v in np.concatenate([ggml_own, wide, -wide]))


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class IQ4_NL(GridFormat, ggml_type=GGMLQuantizationType.IQ4_NL):
    """ggml IQ4_NL: 32 weights, fp16 d then 16 bytes; value = d * kvalues[idx].

    Byte j holds idx[j] in its low nibble and idx[j + 16] in its high nibble.
    Candidate ratios include ggml's own, so our search is a superset of
    quantize_row_iq4_nl_impl's.
    """

    scale_offsets = (0,)
    llama_activation = "q8_0"
    levels = KVALUES_IQ4NL
    divisors = _iq4_nl_divisors()

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


def round_half_away(v: jax.Array) -> jax.Array:
    """Round to nearest, ties away from zero, with gguf-py's np_roundf arithmetic."""
    a = jnp.abs(v)
    floored = jnp.floor(a)
    return jnp.sign(v) * (floored + jnp.floor(2 * (a - floored)))


class Q8_0(BlockFormat, ggml_type=GGMLQuantizationType.Q8_0):
    """ggml Q8_0: 32 weights, fp16 d = max|x|/127 then 32 int8; value = q * d.

    Round-to-nearest is already close to optimal at 8 bits, so importance is
    accepted for a uniform interface and ignored; the bytes equal ggml's
    reference quantizer (and gguf-py's) exactly.
    """

    scale_offsets = (0,)
    llama_activation = "q8_0"

    @classmethod
    def quantize_blocks(cls, x: jax.Array, importance: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)  # (n, 32)
        d = jnp.max(jnp.abs(x), axis=-1) / 127  # (n,)
        inv_d = jnp.where(d == 0, 0.0, 1 / jnp.where(d == 0, 1.0, d))  # (n,)
        q = round_half_away(x * inv_d[:, None]).astype(jnp.int8)  # (n, 32)
        return jnp.concatenate([fp16_to_bytes(d), jax.lax.bitcast_convert_type(q, jnp.uint8)], axis=-1)  # (n, 34)

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


@partial(jax.jit, static_argnames=("fmt",))
def dequantize_blocks_jit(fmt: str, blocks: jax.Array) -> jax.Array:
    """Jitted ``FORMATS[fmt].dequantize_blocks``; compiled once per (fmt, shape)."""
    return FORMATS[fmt].dequantize_blocks(blocks)
