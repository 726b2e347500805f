"""When llama.cpp's CPU backend turns a finite float32 activation into inf.

Our runner multiplies float32 activations by float32 weights. llama.cpp's CPU
backend first converts the activations (the second operand of `ggml_mul_mat`)
to its `vec_dot_type` for the weight's type (ggml-cpu.c, `type_traits_cpu`):

- `q8_0` (weights Q8_0, IQ4_NL, Q4_0, Q5_0, MXFP4): 32 values, int8 codes, scale
  d = max|x| / 127 stored in **fp16** (`quantize_row_q8_0`). Once d rounds to
  fp16 inf (d >= 65520, max|x| >= about 8.32e6) every dot product with that block
  is inf, or NaN where the codes sum to 0 (0 * inf).
- `q8_1` (Q4_1, Q5_1): as q8_0, plus s = d * sum(codes) in fp16, which can
  overflow from 2048 on when a block's values share a sign; only d is checked
  here (no format of ours is Q4_1/Q5_1; an outside GGUF's is caught by llama-check).
- `q8_k` (k-quants, i-quants but IQ4_NL, TQ1_0/TQ2_0): 256 values, int8 codes,
  scale in float32 (`quantize_row_q8_K_ref`): finite for every finite input.
- `f16` (F16 weights, and the K and V caches at llama.cpp's default `f16`
  cache type): values at or beyond 65520 round to inf.
- `bf16` (BF16 weights): float32's exponent range; only values within half a
  bf16 step of float32's largest overflow.
- `f32` (F32 weights: norms, routers): no conversion.

`overflows` emulates exactly the conversion of the largest |activation|: each
of these is monotone in |x| (and a block's scale depends only on its largest
|x|), so the largest value over a tensor overflows iff some block does.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType

from moeheal.kernels.decode import FORMATS_BY_TYPE

T = GGMLQuantizationType
# The activation types of the weight types that are no block format of ours (ggml-cpu.c's
# `type_traits_cpu`): plain floats, and what an outside GGUF may hold.
OTHER_ACTIVATION = {T.F32: "f32", T.F16: "f16", T.BF16: "bf16",
                    T.Q4_0: "q8_0", T.Q5_0: "q8_0", T.MXFP4: "q8_0", T.Q4_1: "q8_1", T.Q5_1: "q8_1",
                    T.IQ4_XS: "q8_k", T.IQ3_S: "q8_k", T.IQ1_S: "q8_k", T.IQ1_M: "q8_k", T.TQ1_0: "q8_k"}
ACTIVATIONS = ("f32", "bf16", "f16", "q8_0", "q8_1", "q8_k")


def llama_activation(ggml_type: GGMLQuantizationType) -> str:
    """The type llama.cpp's CPU backend converts activations to before multiplying them by a
    weight of `ggml_type` (its `vec_dot_type`)."""
    if ggml_type in FORMATS_BY_TYPE:
        return FORMATS_BY_TYPE[ggml_type].llama_activation
    if ggml_type in OTHER_ACTIVATION:
        return OTHER_ACTIVATION[ggml_type]
    raise ValueError(f"no llama.cpp activation type known for weights of type {ggml_type.name}")


def _bf16_rounds_to_inf(peak: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even on the upper 16 bits of float32."""
    bits = peak.astype(np.float32).view(np.uint32).astype(np.uint64)  # (n,)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # (n,) bf16 bits
    return (rounded & 0x7F80) == 0x7F80  # exponent all ones: inf (or NaN)


def overflows(activation: str, peak: np.ndarray | float) -> np.ndarray:
    """Per largest |activation| `peak` (float32, >= 0; NaN or inf count as overflowing):
    whether llama.cpp's conversion to `activation` (one of ACTIVATIONS) makes it inf or NaN."""
    peak = np.atleast_1d(np.asarray(peak, np.float32))  # (n,)
    bad = ~np.isfinite(peak)  # (n,)
    with np.errstate(over="ignore"):
        if activation in ("q8_0", "q8_1"):  # q8_1's fp16 sum s = d * sum(codes) is not modelled
            return bad | ~np.isfinite((peak / np.float32(127)).astype(np.float16))  # its fp16 scale d
        if activation == "f16":
            return bad | ~np.isfinite(peak.astype(np.float16))
    if activation == "bf16":
        return bad | _bf16_rounds_to_inf(peak)
    if activation in ("q8_k", "f32"):
        return bad
    raise ValueError(f"unknown activation type {activation!r}; known: {', '.join(ACTIVATIONS)}")


@lru_cache(maxsize=None)
def overflow_limit(activation: str) -> float:
    """The smallest float32 |activation| whose conversion to `activation` overflows (inf where
    only a non-finite value does): what a report prints beside a peak."""
    if activation in ("q8_k", "f32"):
        return float("inf")
    lo, hi = np.float32(1.0), np.finfo(np.float32).max  # overflows(hi) for every narrow type
    while np.nextafter(lo, hi) < hi:  # bisect on float32 values: monotone
        mid = np.float32(lo / 2 + hi / 2)
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if overflows(activation, mid)[0] else (mid, hi)
    return float(hi)
