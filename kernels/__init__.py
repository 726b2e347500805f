"""Pure array math (arrays in, arrays out; no files, no config), one concern per module.

Nothing is imported here: a stage's code identity is the closure of the
modules it imports, and importing any module of this package runs this file
first, so whatever it imported would reach every stage. Import what you use
from its module:

- reading ggml blocks: ``decode`` (the registry of formats, ``format_of``,
  ``dequantize``) over the layouts in ``formats``, ``kquants``, ``iquants``;
- writing them: ``encode`` (``quantize``, ``quantize_experts``, the registry
  of encoders) over the searches in ``formats_encode``, ``kquants_encode``,
  ``iquants_encode``, GPTQ in ``gptq``, learned rounding in ``learned``;
- routing (``routing``), cache-aware routing (``moce``), and the statistics
  the stages fit (``importance``, ``alpha``, ``ridge``, ``allocate``, ``kld``,
  ``ngram``, ``narrow``, ``e2e``).
"""
