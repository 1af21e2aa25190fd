"""Decoder models (Qwen3 and Llama families) and their configs."""

from envace_jax.models.config import PRESETS, ModelConfig, get_preset
from envace_jax.models.decoder import (
    CACHE_LOGICAL_AXES,
    Decoder,
    KVCache,
    abstract_model,
    init_cache,
    param_paths,
)

__all__ = [
    "CACHE_LOGICAL_AXES",
    "PRESETS",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "abstract_model",
    "get_preset",
    "init_cache",
    "param_paths",
]
