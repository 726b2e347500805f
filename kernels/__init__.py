"""Pure array math (arrays in, arrays out; no files, no config), one concern per module.

- reading ggml blocks: ``decode`` (the registry of formats, ``format_of``,
  ``dequantize``) over the layouts in ``formats``, ``kquants``, ``iquants``;
- writing them: ``encode`` (``quantize``, ``quantize_experts``, the registry
  of encoders) over the searches in ``formats_encode``, ``kquants_encode``,
  ``iquants_encode``, ``iq1m_encode``, GPTQ in ``gptq``, learned rounding in ``learned``;
- routing (``routing``), cache-aware routing (``moce``), and the statistics
  the stages fit (``importance``, ``alpha``, ``ridge``, ``allocate``, ``kld``,
  ``ngram``, ``narrow``, ``e2e``), and the optimiser both learners use (``adam``);
- the host's BLAS held at one thread where its thread count would decide bytes
  (``threads``).

This file only re-exports, and lazily: importing any module of the package
runs it first, and a stage's code identity is the closure of what it imports,
so an import here would reach every stage. ``kernels.quantize`` and the rest
of ``API`` (the notebook API of docs/SPEC.md) are imported from their modules
on first use; the project's own code imports the module that defines a name,
which its code identity then names.
"""

from __future__ import annotations

import importlib
from typing import Any

# The package-level API: name -> the module of this package that defines it.
API = {
    "quantize": "encode", "quantize_experts": "encode", "gptq_schedule": "encode", "expert_mesh": "encode",
    "ENCODERS": "encode", "encoder_of": "encode",
    "dequantize": "decode", "FORMATS": "decode", "format_of": "decode", "bits_per_weight": "decode",
    "damp_hessian": "gptq", "GptqSchedule": "gptq",
}
__all__ = sorted(API)


def __getattr__(name: str) -> Any:
    """``kernels.<name>`` for a name of ``API``, from its module (imported now if it was not)."""
    if name not in API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{API[name]}"), name)
