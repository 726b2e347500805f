"""Block formats, every registered one: ggml byte compatibility, the registry, rescaling the stored
scales, importance, and the quality of our scale search.

Outside references: gguf-py's dequantizers (bit for bit) and its Q8_0 / TQ2_0
quantizers; ggml's iq4_nl search and float64 re-implementations of ours live
in tests/reference_quants.py.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moeheal.kernels.decode import FORMATS, bits_per_weight, dequantize, format_of
from moeheal.kernels.encode import ENCODERS, encoder_of, quantize, quantize_experts
from moeheal.kernels.formats_encode import IQ4_NLEncoder as IQ4_NL, TQ2_0Encoder as TQ2_0
from moeheal.kernels.iquants import IQuant
from tests import reference_quants as ref

pytestmark = pytest.mark.compile_bound  # tests/conftest.py

SPECIAL_FP16 = np.array(
    [0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x0001, 0x8001, 0x03FF, 0x0000, 0x8000, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF],
    dtype=np.uint16,
)  # inf, -inf, NaNs, subnormals, +-0, +-1, +-max


def random_weights(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Test weights of a given distribution, float32, scaled like LLM weights."""
    if kind == "t3":
        x = rng.standard_t(3, shape)
    elif kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "outliers":
        x = rng.standard_normal(shape)
        mask = rng.random(shape) < 0.002
        x[mask] *= 30
    elif kind == "skewed":
        x = rng.gamma(0.5, 1.0, shape) - 0.3
    else:
        raise AssertionError(kind)
    return (0.02 * x).astype(np.float32)


# one format per code path (grid, q8_0, affine and symmetric k-quants): what the
# slower API tests cover; byte layouts are checked for every format
PATH_FORMATS = ["iq4_nl", "q2_k", "q3_k", "q8_0", "tq2_0"]


def weighted_error_of(x: np.ndarray, raw: np.ndarray, fmt: str, importance: np.ndarray) -> float:
    """sum_ij importance_j (x_ij - deq_ij)^2 with gguf-py's dequantizer, float64."""
    deq = gguf.quants.dequantize(raw, ENCODERS[fmt].ggml_type).reshape(x.shape)
    return float(np.sum(ref.weighted_error(x, np.broadcast_to(importance, x.shape), deq)))


# --------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_dequantize_is_bit_identical_to_gguf_py(fmt: str) -> None:
    cls = ENCODERS[fmt]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (3072, cls.type_size), dtype=np.uint8)  # random codes and scales
    bits = cls.fp16_scale_bits(raw)  # (n, S): d (and dmin)
    for j in range(bits.shape[1]):
        scales = (rng.standard_normal(1500) * 0.01).astype(np.float16)  # finite, both signs
        bits[:1500, j] = scales.view(np.uint16)
        bits[1500:1500 + SPECIAL_FP16.size, j] = SPECIAL_FP16
    raw = cls.with_fp16_scale_bits(raw, bits)
    raw[-1] = 0  # an all-zero block
    shape = (3072 * cls.block_size // 1024, 1024)
    ours = dequantize(raw, fmt, shape)
    with np.errstate(invalid="ignore"):
        theirs = gguf.quants.dequantize(raw.reshape(shape[0], -1), cls.ggml_type)
    assert ours.dtype == np.float32 and ours.shape == shape
    if jax.default_backend() == "cpu":
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    else:  # GPUs canonicalise NaN payloads; every number (inf, subnormal, -0 included) stays exact
        numbers = ~np.isnan(theirs)
        assert np.array_equal(np.isnan(ours), ~numbers)
        assert np.array_equal(ours[numbers].view(np.uint32), theirs[numbers].view(np.uint32))


def test_tq2_0_negative_scale_mirrors_the_grid() -> None:
    codes = np.arange(256) % 4  # every code
    packed = np.zeros(64, np.uint8)
    for i, c in enumerate(codes):  # gguf-py's layout, spelt out
        packed[32 * (i // 128) + i % 32] |= c << (2 * ((i % 128) // 32))
    raw = np.concatenate([packed, np.array([-0.5], np.float16).view(np.uint8)])[None]
    values = dequantize(raw, "tq2_0", (1, 256))[0]
    assert np.array_equal(values, -0.5 * (codes - 1.0))
    assert np.array_equal(values, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.TQ2_0)[0])


def test_q8_0_quantize_is_byte_identical_to_gguf_py() -> None:
    rng = np.random.default_rng(1)
    x = random_weights(rng, (64, 1024), "t3")
    x[3, :32] = 0.0  # all-zero block
    x[4, 32:64] = 0.125  # constant block
    x[5, :] = np.round(x[5] * 1e3) / 1e3  # many ties after scaling
    assert np.array_equal(quantize(x, "q8_0"), gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0))


@functools.cache
def quantized(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed weights (64, 512) and their ``fmt`` bytes without importance: one compiled quantizer per
    format, shared by the tests below. Rows 0-3 are degenerate blocks: zero, an fp16-exact constant, a
    small negative constant, a lone spike among zeros."""
    x = random_weights(np.random.default_rng(1), (64, 512), "t3")
    x[:4] = 0.0
    x[1] = 0.375
    x[2] = -0.01
    x[3, 7] = 1.5
    return x, quantize(x, fmt)  # (64, 512), (64, bytes)


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_parts_round_trip_and_name_the_stored_scales(fmt: str) -> None:
    """pack(unpack(b)) == b for quantizer-made blocks, and ``fp16_parts`` are the stored fp16 numbers
    (``fp16_scale_bits``): what tunes parts and packs them (learned rounding, end-to-end tuning) writes
    the bytes it decoded."""
    cls = ENCODERS[fmt]
    _, raw = quantized(fmt)
    raw = raw.reshape(-1, cls.type_size)  # (n, type_size)
    parts = cls.unpack(raw)
    assert np.array_equal(np.asarray(cls.pack(*parts)), raw)
    assert np.array_equal(np.asarray(cls.dequantize_parts(parts)), np.asarray(cls.dequantize_blocks(raw)))
    stored = cls.fp16_scale_bits(raw).view(np.float16).astype(np.float32)  # (n, S)
    assert stored.shape[1] >= 1
    for index, column in zip(cls.fp16_parts, stored.T):
        assert np.array_equal(np.asarray(parts[index]).reshape(-1), column)


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_scale_scales_multiplies_every_value(fmt: str) -> None:
    """Alpha's rescaling of a quantized matrix: only the fp16 scales change, each is one float32 product
    rounded to fp16 (as calibrate has always done), and every value is multiplied by the factor."""
    cls = ENCODERS[fmt]
    x, raw = quantized(fmt)
    scaled = cls.scale_scales(raw, 0.8)
    assert scaled.shape == raw.shape and scaled.dtype == np.uint8
    n_scales = cls.fp16_scale_bits(raw.reshape(-1, cls.type_size)[:1]).shape[1]
    scale_bits = cls.with_fp16_scale_bits(np.zeros((1, cls.type_size), np.uint8),
                                          np.full((1, n_scales), 0xFFFF, np.uint16))[0]  # (type_size,)
    blocks, blocks_scaled = raw.reshape(-1, cls.type_size), scaled.reshape(-1, cls.type_size)
    assert np.array_equal(blocks & ~scale_bits, blocks_scaled & ~scale_bits)  # codes untouched
    before, after = dequantize(raw, fmt, x.shape), dequantize(scaled, fmt, x.shape)
    np.testing.assert_allclose(after, 0.8 * before, rtol=2e-3, atol=1e-3 * np.abs(before).max())
    old = cls.fp16_scale_bits(blocks).view(np.float16).astype(np.float32)  # (n, S)
    expected = (old * np.float32(0.8)).astype(np.float16)
    assert np.array_equal(cls.fp16_scale_bits(blocks_scaled).view(np.float16), expected)
    assert np.array_equal(cls.scale_scales(raw, 1.0), raw)


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_scale_scales_refuses_to_overflow_or_underflow_fp16(fmt: str) -> None:
    """Never a silent inf, NaN or zero scale; zero scales stay zero (nothing is lost)."""
    cls = ENCODERS[fmt]
    _, raw = quantized(fmt)  # every scale far below 1 and far above 1e-9 (0.02-sized weights)
    with pytest.raises(ValueError, match="not a finite fp16"):
        cls.scale_scales(raw, 1e10)
    with pytest.raises(ValueError, match="underflows fp16 to zero"):
        cls.scale_scales(raw, 1e-9)
    with pytest.raises(ValueError, match="not finite"):
        cls.scale_scales(raw, float("nan"))
    with pytest.raises(ValueError, match="whole"):
        cls.scale_scales(raw.reshape(-1)[:-1], 2.0)
    zero = np.zeros_like(raw)  # all-zero blocks: zero scales (and dmin), whatever the codes say
    assert np.array_equal(cls.scale_scales(zero, 1e-9), zero)


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_degenerate_blocks(fmt: str) -> None:
    """All-zero rows decode to zeros, a lone spike keeps its size, nothing turns inf or NaN; where the format
    has a zero level and evenly spaced codes (all but the codebook i-quants), constants are kept to fp16
    precision and the spike's block loses almost nothing."""
    x, raw = quantized(fmt)
    deq = dequantize(raw, fmt, x.shape)
    assert np.all(np.isfinite(deq))
    assert np.array_equal(deq[0], np.zeros_like(deq[0]))
    assert abs(deq[3, 7] - 1.5) < 0.1
    if not issubclass(ENCODERS[fmt], IQuant):  # codebooks: no zero level, groups of eight rounded to grid points
        np.testing.assert_allclose(deq[1:3], x[1:3], rtol=2e-3, atol=0)
        # iq4_nl has no zero level: the spike's block pays |d| per zero weight
        assert np.sum((deq[3] - x[3]) ** 2) < 5e-3 * np.sum(x[3] ** 2)
    if fmt == "tq2_0":  # d = x at level 1 represents an fp16-exact constant or spike exactly
        assert np.array_equal(deq[[0, 1, 3]], x[[0, 1, 3]])


# --------------------------------------------------------------------------- quality


@pytest.mark.parametrize("kind", ["t3", "normal", "outliers", "skewed"])
def test_tq2_0_beats_gguf_py_quantizer(kind: str) -> None:
    rng = np.random.default_rng(2)
    x = random_weights(rng, (96, 1024), kind)
    importance = rng.gamma(0.7, 1.0, 1024).astype(np.float32)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.TQ2_0)
    for imp in (importance, np.ones(1024, np.float32)):
        ours = quantize(x, "tq2_0", imp)
        err_ours = weighted_error_of(x, ours, "tq2_0", imp)
        err_theirs = weighted_error_of(x, theirs, "tq2_0", imp)
        assert err_ours <= err_theirs
        assert err_ours < 0.7 * err_theirs  # not a tie: the search is far better than max-scaling


@pytest.mark.parametrize("cls", [TQ2_0, IQ4_NL], ids=lambda c: c.name)
def test_jax_search_equals_float64_reference(cls) -> None:
    rng = np.random.default_rng(3)
    n = 400 if cls is TQ2_0 else 1600
    x = random_weights(rng, (n, cls.block_size), "t3")
    w = rng.gamma(0.7, 1.0, x.shape).astype(np.float32)
    raw = np.asarray(cls.quantize_blocks(x, w))
    d_ours, idx_ours = (np.asarray(a) for a in cls.unpack(raw))
    d_ref, idx_ref = ref.grid_search(x, w, np.asarray(cls.levels, np.float64), np.asarray(cls.divisors))
    levels = np.asarray(cls.levels, np.float64)
    err_ours = ref.weighted_error(x, w, d_ours * levels[idx_ours])  # (n,)
    err_ref = ref.weighted_error(x, w, d_ref[:, None] * levels[idx_ref])  # (n,)
    assert abs(err_ours.sum() / err_ref.sum() - 1) < 1e-5
    np.testing.assert_allclose(err_ours, err_ref, rtol=1e-3, atol=0)
    assert np.mean(np.all(idx_ours == idx_ref, axis=1)) > 0.97  # whole blocks identical
    assert np.mean(idx_ours == idx_ref) > 0.995


# Q8_0 rounds to nearest and ignores importance by design (kernels.formats.Q8_0)
IGNORES_IMPORTANCE = {"q8_0"}


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_importance_changes_the_result_for_the_better(fmt: str) -> None:
    """Per-column importance spanning ~4 decades: the importance-weighted error of the bytes quantized with it
    is clearly below that of the bytes quantized without it, for every format that reads importance."""
    x, uniform = quantized(fmt)
    importance = np.exp(2.0 * np.random.default_rng(4).standard_normal(x.shape[1])).astype(np.float32)
    with_imp = quantize(x, fmt, importance)
    if fmt in IGNORES_IMPORTANCE:
        assert np.array_equal(with_imp, uniform)
        return
    err_with = weighted_error_of(x, with_imp, fmt, importance)
    err_uniform = weighted_error_of(x, uniform, fmt, importance)
    assert err_with < 0.9 * err_uniform


def test_iq4_nl_beats_ggml_search() -> None:
    rng = np.random.default_rng(5)
    x = random_weights(rng, (300, 32), "t3")
    w = rng.gamma(0.7, 1.0, x.shape).astype(np.float32)
    ours = dequantize(np.asarray(IQ4_NL.quantize_blocks(x, w)), "iq4_nl", x.shape)
    err_ours = ref.weighted_error(x, w, ours)  # (n,)
    err_ggml = ref.weighted_error(x, w, ref.ggml_iq4_nl(x, w))  # (n,)
    assert np.all(err_ours <= err_ggml * (1 + 1e-5))  # superset of ggml's candidates, block by block
    assert err_ours.sum() < 0.99 * err_ggml.sum()


# --------------------------------------------------------------------------- API


@pytest.mark.parametrize("fmt", PATH_FORMATS)
def test_quantize_experts_equals_quantize_per_expert(fmt: str) -> None:
    rng = np.random.default_rng(6)
    w = random_weights(rng, (5, 8, 512), "t3")
    importance = rng.gamma(1.0, 1.0, (5, 512)).astype(np.float32)
    # a batch of 2 experts: three batches, the last one padded
    stacked = quantize_experts(w, fmt, importance, batch_weights=2 * 8 * 512)
    assert stacked.shape == (5, 8, 512 // ENCODERS[fmt].block_size * ENCODERS[fmt].type_size)
    for e in range(5):
        assert np.array_equal(stacked[e], quantize(w[e], fmt, importance[e]))


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_registry_answers_what_the_pipeline_asks(fmt: str) -> None:
    """Every format has a decoder and an encoder derived from it, found by name and by ggml type."""
    assert sorted(ENCODERS) == sorted(FORMATS)
    cls, enc = FORMATS[fmt], ENCODERS[fmt]
    assert format_of(fmt) is cls and format_of(cls.ggml_type) is cls
    assert encoder_of(fmt) is enc and encoder_of(cls.ggml_type) is enc and issubclass(enc, cls)
    assert enc.supports_gptq == (fmt != "q8_0")
    assert all(0 <= off <= cls.type_size - 2 for off in cls.scale_offsets)
    assert cls.fp16_scale_bits(np.zeros((1, cls.type_size), np.uint8)).shape[1] == max(1, len(cls.scale_offsets))


def test_bits_per_weight() -> None:
    assert bits_per_weight("tq2_0") == 2.0625
    assert bits_per_weight("iq4_nl") == 4.5
    assert bits_per_weight("q8_0") == 8.5
    assert bits_per_weight("q2_k") == 2.625
    assert bits_per_weight("q4_k") == 4.5
    assert bits_per_weight("iq1_m") == 1.75  # 56 bytes per 256


def test_bad_input_is_refused() -> None:
    x = np.zeros((2, 300), np.float32)
    with pytest.raises(ValueError, match="multiple"):
        quantize(x, "tq2_0")
    with pytest.raises(ValueError, match="unknown format 'q9_k'"):
        quantize(np.zeros((2, 256), np.float32), "q9_k")
    with pytest.raises(ValueError, match="unknown format"):
        format_of(gguf.GGMLQuantizationType.IQ3_S)  # a ggml type without a class here
    with pytest.raises(ValueError, match="importance"):
        quantize(np.zeros((2, 256), np.float32), "tq2_0", np.ones(128, np.float32))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(65, np.uint8), "tq2_0", (1, 256))


def test_fp16_round_is_a_cast_to_fp16_bit_for_bit() -> None:
    """`fp16_round` (arithmetic, so that no compiler drops it: a cast's round trip can be) against NumPy's
    cast on every finite fp16 value, the midpoints between neighbours (ties to even) and their float32
    neighbours, the overflow edge and a million random float32 bit patterns, subnormals included."""
    from moeheal.kernels.formats import fp16_round

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # (65536,)
    every = np.unique(every[np.isfinite(every)].astype(np.float32))  # sorted
    mid = ((every[1:].astype(np.float64) + every[:-1]) / 2).astype(np.float32)  # exact: 11 bits + 1
    bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([every, mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf), bits.view(np.float32),
                        np.float32([65504, 65519.996, 65520, 1e30, -1e30, np.inf, -np.inf, 0.0, -0.0, 2.0**-25])])
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    got = np.asarray(jax.jit(fp16_round)(jnp.asarray(x)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), x[got.view(np.uint32) != want.view(np.uint32)][:5]
    assert np.isnan(np.asarray(fp16_round(jnp.float32(np.nan))))
