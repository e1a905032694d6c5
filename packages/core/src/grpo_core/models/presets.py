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

# Other families' released checkpoints, from their config.json (Gemma 3 4B/12B: its `text_config`).
_GEMMA3_TEXT = dict(model_type="gemma3_text", head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                    sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                    rope_scaling={"rope_type": "linear", "factor": 8.0}, vocab_size=262_144,
                    max_position_embeddings=131_072, tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106])
_RELEASED = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                         rope_theta=500_000.0, max_position_embeddings=131_072, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         bos_token_id=128_000, eos_token_id=[128_001, 128_008, 128_009]),
    "gemma-3-4b": dict(_GEMMA3_TEXT, hidden_size=2560, intermediate_size=10_240, num_hidden_layers=34,
                       num_attention_heads=8, num_key_value_heads=4),
    "gemma-3-12b": dict(_GEMMA3_TEXT, hidden_size=3840, intermediate_size=15_360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40_960, tie_word_embeddings=False, router_aux_loss_coef=0.001,
                          bos_token_id=151_643, eos_token_id=151_645),
}
PRESETS.update({name: QwenConfig.from_hf_dict({**d, "torch_dtype": "bfloat16"}) for name, d in _RELEASED.items()})

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
HUB_ARCHITECTURES.update({
    "meta-llama/Llama-3.1-8B-Instruct": PRESETS["llama-3.1-8b"],
    "google/gemma-3-4b-it": PRESETS["gemma-3-4b"],
    "google/gemma-3-12b-it": PRESETS["gemma-3-12b"],
    "Qwen/Qwen3-30B-A3B": PRESETS["qwen3-30b-a3b"],
})


def preset(name: str, **changes) -> QwenConfig:
    """Preset `name` with `changes` applied; an unknown name lists the available ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(sorted(PRESETS))}.")
    return PRESETS[name].replace(**changes)


def hub_architecture(hub_id: str) -> QwenConfig | None:
    """The architecture of a listed Hub id (case-insensitive), or None."""
    by_lower = {name.lower(): config for name, config in HUB_ARCHITECTURES.items()}
    return by_lower.get(hub_id.strip("/").lower())
