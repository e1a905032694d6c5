"""Named architectures: tiny ones per family (tests, `grpo-bench`) and the released checkpoints'
shapes, by preset name and by Hub id, so a memory plan for a Hub id needs no download."""

from __future__ import annotations

from grpo_core.models.config import QwenConfig

PRESETS: dict[str, QwenConfig] = {
    "tiny-qwen2": QwenConfig.tiny("qwen2"),
    "tiny-qwen3": QwenConfig.tiny("qwen3"),
    "tiny-llama": QwenConfig.tiny("llama"),
    "tiny-gemma3_text": QwenConfig.tiny("gemma3_text"),
    "qwen2.5-0.5b": QwenConfig(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": QwenConfig(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": QwenConfig(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": QwenConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-14B/32B(-Instruct) config.json
    "qwen2.5-14b": QwenConfig(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": QwenConfig(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": QwenConfig(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-1.7b": QwenConfig(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-8b": QwenConfig(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
}

# Published checkpoints by Hub id: their presets plus what their config.json adds, so a
# memory plan for a Hub id needs no download.
_HUB_PRESETS = {
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-3B-Instruct": "qwen2.5-3b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "Qwen/Qwen2.5-14B-Instruct": "qwen2.5-14b",
    "Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "Qwen/Qwen3-8B": "qwen3-8b",
}
HUB_ARCHITECTURES: dict[str, QwenConfig] = {
    hub_id: PRESETS[preset].replace(torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
    for hub_id, preset in _HUB_PRESETS.items()
}


def preset(name: str, **changes) -> QwenConfig:
    """Preset `name` with `changes` applied; an unknown name lists the available ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(sorted(PRESETS))}.")
    return PRESETS[name].replace(**changes)


def hub_architecture(hub_id: str) -> QwenConfig | None:
    """The architecture of a listed Hub id (case-insensitive), or None."""
    by_lower = {name.lower(): config for name, config in HUB_ARCHITECTURES.items()}
    return by_lower.get(hub_id.strip("/").lower())
