"""Architectures of published Qwen checkpoints, so a memory plan for a Hub id needs no
download. Values are those of each model's `config.json` on the Hugging Face Hub."""

from __future__ import annotations

from grpo_core.models import QwenConfig

_QWEN25_INSTRUCT = dict(model_type="qwen2", vocab_size=151936, rope_theta=1_000_000.0,
                        max_position_embeddings=32768, torch_dtype="bfloat16", bos_token_id=151643,
                        eos_token_id=151645)

KNOWN_ARCHITECTURES: dict[str, QwenConfig] = {
    "Qwen/Qwen2.5-0.5B-Instruct": QwenConfig(
        **_QWEN25_INSTRUCT, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B-Instruct": QwenConfig(
        **_QWEN25_INSTRUCT, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B-Instruct": QwenConfig(
        **_QWEN25_INSTRUCT, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": QwenConfig(
        **{**_QWEN25_INSTRUCT, "vocab_size": 152064}, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        tie_word_embeddings=False),
    "Qwen/Qwen3-1.7B": QwenConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=40960, torch_dtype="bfloat16", bos_token_id=151643,
        eos_token_id=151645),
}


def known_architecture(hub_id: str) -> QwenConfig | None:
    """The architecture of a listed Hub id (case-insensitive), or None."""
    by_lower = {name.lower(): config for name, config in KNOWN_ARCHITECTURES.items()}
    return by_lower.get(hub_id.strip("/").lower())
