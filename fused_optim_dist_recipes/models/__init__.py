"""Models for the fine-tuning job and the benchmarks, and how to shard them."""

from fused_optim_dist_recipes.models.llama import (
    BYTE_VOCAB_SIZE,
    PRESETS,
    Llama,
    LlamaConfig,
    TransformerBlock,
)
from fused_optim_dist_recipes.models.parallelize import apply_fsdp

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "TransformerBlock",
    "apply_fsdp",
]
