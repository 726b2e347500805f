"""The MoE families we run, one file each; `ARCHITECTURES` maps llama.cpp's name to each."""

from moeheal.pipeline.model.arch import deepseek2, mixtral, olmoe, qwen2moe, qwen3moe, qwen3next  # noqa: F401  (each registers itself)
from moeheal.pipeline.model.arch.base import ARCHITECTURES, Architecture, Routing

__all__ = ["ARCHITECTURES", "Architecture", "Routing"]
