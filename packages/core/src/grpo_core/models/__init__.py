"""Qwen2 / Qwen2.5 / Qwen3 models in Flax NNX with Hugging Face parity."""

from grpo_core.models.attention import KVCache
from grpo_core.models.hf_io import export_pretrained, load_pretrained
from grpo_core.models.config import QwenConfig
from grpo_core.models.presets import PRESETS
from grpo_core.models.qwen import REMAT_MODES, QwenModel, init_from_config, positions_from_mask

__all__ = [
    "PRESETS",
    "REMAT_MODES",
    "KVCache",
    "QwenConfig",
    "QwenModel",
    "export_pretrained",
    "init_from_config",
    "load_pretrained",
    "positions_from_mask",
]
