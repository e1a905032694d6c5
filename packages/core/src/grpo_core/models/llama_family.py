"""The Llama 3.x family (`llama`): the plain decoder (no attention biases, no q/k norm, tied or
untied head) with Llama 3's RoPE frequency scaling (`rope_scaling.rope_type: llama3`).

llama3 scaling (Meta's Llama 3.1 release; transformers `_compute_llama3_parameters`): with
wavelength w = 2 pi / f of each inverse frequency f and L = original_max_position_embeddings,
frequencies with w > L / low_freq_factor are divided by `factor`, those with
w < L / high_freq_factor are kept, and in between they are interpolated with
s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor):  f' = (1 - s) f / factor + s f.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from grpo_core.model_families import ModelFamily, default_frequencies, rope_type, unsupported

LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")


class LlamaFamily(ModelFamily):
    name = "llama"
    architecture = "LlamaForCausalLM"

    def validate(self, cfg: Any) -> None:
        if cfg.attention_bias:
            raise unsupported("attention_bias", cfg.attention_bias, "false for llama (Llama 3 has no attention bias)")

    def rope_scaling(self, block: dict | None) -> tuple | None:
        kind = rope_type(block)
        if kind == "default":
            return None
        if kind != "llama3":
            raise unsupported("rope_scaling.rope_type", kind, "'default' | 'llama3'")
        missing = [key for key in LLAMA3_KEYS if key not in block]
        if missing:
            raise ValueError(f"config.json: rope_scaling of rope_type 'llama3' lacks {', '.join(missing)}; "
                             f"it needs {', '.join(LLAMA3_KEYS)}.")
        if float(block["high_freq_factor"]) <= float(block["low_freq_factor"]):
            raise unsupported("rope_scaling.high_freq_factor", block["high_freq_factor"],
                              f"a value above low_freq_factor={block['low_freq_factor']}")
        return (("rope_type", "llama3"), *((key, block[key]) for key in LLAMA3_KEYS))

    def rope_frequencies(self, cfg: Any) -> jnp.ndarray:
        inv_freq = default_frequencies(cfg.head_dim, cfg.rope_theta)
        if cfg.rope_scaling is None:
            return inv_freq
        return llama3_frequencies(inv_freq, **{k: v for k, v in cfg.rope_scaling if k != "rope_type"})


def llama3_frequencies(inv_freq: jnp.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_position_embeddings: int) -> jnp.ndarray:
    """Llama 3's scaled inverse frequencies (module docstring), in f32."""
    context = float(original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > context / low_freq_factor
    short_waves = wavelength < context / high_freq_factor
    smooth = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(long_waves, inv_freq / factor, jnp.where(short_waves, inv_freq, between)).astype(jnp.float32)


LLAMA = LlamaFamily()
