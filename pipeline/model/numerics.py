"""Where llama.cpp would overflow what our float32 forward pass keeps finite.

llama.cpp's CPU backend converts the activations entering a matrix product to a
narrower type that depends on the weight's type (`kernels.narrow`), and stores
the attention's keys and values in an f16 cache by default. A variant whose
float32 forward pass is finite can therefore print NaN in llama.cpp. The runner
can record, per layer, the largest |activation| at every such site
(`Runner.forward(peaks=...)`), and `check_peaks` says which would overflow.

Sites are named by the weight the activation is multiplied by (its GGUF short
name, `ffn_down_shexp.weight`; `output.weight` for the output projection) or
`cache_k` / `cache_v` for the keys and values written to the KV cache.

The probes cost nothing on the normal path: `probe` traces a host callback only
when the layer's `params` carry `PEAK_LAYER`, a dict key and therefore static
under jit, so a probing pass compiles its own graph and a plain one is the graph
it always was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa

from moeheal.kernels.narrow import llama_activation, overflow_limit, overflows

if TYPE_CHECKING:
    from moeheal.pipeline.gguf.model import GGUFModel

PEAK_LAYER = "peaks.layer"  # the key in a layer's params that turns its probes on; its value: the layer index
CACHE_K, CACHE_V = "cache_k", "cache_v"  # the K and V written to llama.cpp's KV cache
KV_CACHE_TYPE = "f16"  # llama.cpp's default cache type (-ctk / -ctv)
OUTPUT_LAYER = -1  # the layer index recorded for the output projection
PEAKS_SCHEMA = pa.schema([("variant", pa.string()), ("layer", pa.int32()), ("site", pa.string()),
                          ("tensor", pa.string()), ("ggml_type", pa.string()), ("activation", pa.string()),
                          ("peak", pa.float64()), ("overflow_at", pa.float64()), ("overflow", pa.bool_())])


class ActivationPeaks:
    """The largest |activation| seen per (layer, site) over the forward passes it records."""

    def __init__(self) -> None:
        self.peaks: dict[tuple[int, str], float] = {}

    def add(self, layer: int, site: str, peak: float) -> None:
        key = (layer, site)
        old = self.peaks.get(key, 0.0)
        self.peaks[key] = peak if np.isnan(peak) or np.isnan(old) else max(old, peak)  # NaN sticks


_ACTIVE: list[ActivationPeaks] = []  # the recorder `probe`'s callbacks report to (innermost `recording`)


@contextmanager
def recording(peaks: ActivationPeaks) -> Iterator[ActivationPeaks]:
    """Probes report to `peaks` inside the block; every callback has run when it exits."""
    _ACTIVE.append(peaks)
    try:
        yield peaks
    finally:
        jax.effects_barrier()
        _ACTIVE.pop()


def _report(site: str, layer: np.ndarray, peak: np.ndarray) -> None:
    if _ACTIVE:
        _ACTIVE[-1].add(int(layer), site, float(peak))


def probe(params: dict, site: str, x: jax.Array) -> None:
    """Report max|x| of the activation entering `site` when `params` carry PEAK_LAYER; traces
    nothing otherwise. x (..., n) any shape."""
    if PEAK_LAYER in params:
        jax.debug.callback(partial(_report, site), params[PEAK_LAYER], jnp.max(jnp.abs(x)))  # () each


def site_tensor(model: GGUFModel, layer: int, site: str) -> str | None:
    """The GGUF tensor a site multiplies its activation by (None for the KV cache)."""
    if site in (CACHE_K, CACHE_V):
        return None
    return site if layer == OUTPUT_LAYER else f"blk.{layer}.{site}"


def peak_rows(model: GGUFModel, variant: str, peaks: ActivationPeaks,
              kv_cache: str = KV_CACHE_TYPE) -> list[dict]:
    """One `PEAKS_SCHEMA` row per recorded (layer, site): its weight's type, the activation type
    llama.cpp converts to (`kv_cache` for the cache), the peak, the smallest overflowing value and
    whether the peak overflows."""
    types = {name: t for name, (t, _, _) in model.tensor_sizes().items()}
    rows = []
    for (layer, site), peak in sorted(peaks.peaks.items()):
        tensor = site_tensor(model, layer, site)
        ggml_type = types[tensor].name if tensor is not None else kv_cache.upper()
        activation = llama_activation(types[tensor]) if tensor is not None else kv_cache
        rows.append({"variant": variant, "layer": layer, "site": site, "tensor": tensor, "ggml_type": ggml_type,
                     "activation": activation, "peak": peak, "overflow_at": overflow_limit(activation),
                     "overflow": bool(overflows(activation, peak)[0])})
    return rows


def overflow_message(variant: str, gguf: str, rows: list[dict]) -> str | None:
    """One line naming the variant, its file and its first overflowing site; None when none overflows."""
    bad = [r for r in rows if r["overflow"]]
    if not bad:
        return None
    r = bad[0]
    where = "the output projection" if r["layer"] == OUTPUT_LAYER else f"layer {r['layer']}"
    more = f" (and {len(bad) - 1} more sites)" if len(bad) > 1 else ""
    return (f"variant {variant}: {gguf}: llama.cpp's CPU backend would turn activations into inf/NaN: {where} "
            f"{r['site']} ({r['ggml_type']}, activations converted to {r['activation']}): max |x| "
            f"{r['peak']:.4g} >= {r['overflow_at']:.4g}{more}")
