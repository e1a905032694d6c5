"""The Qwen families: Qwen2 / Qwen2.5 (`qwen2`: q/k/v biases) and Qwen3 (`qwen3`: per-head
q/k RMSNorm, explicit head_dim, optional biases on all four attention projections)."""

from __future__ import annotations

from typing import Any

from grpo_core.model_families import ModelFamily, unsupported


class Qwen2Family(ModelFamily):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    attention_bias = True

    def validate(self, cfg: Any) -> None:
        if not cfg.attention_bias:
            raise unsupported("attention_bias", cfg.attention_bias, "True for qwen2 (HF Qwen2 always has q/k/v bias)")

    def hf_extras(self, cfg: Any) -> dict[str, Any]:
        return {"use_sliding_window": False}  # HF Qwen2 has no attention_bias key: its biases are fixed


class Qwen3Family(ModelFamily):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    writes_head_dim = True

    def qk_norm(self, cfg: Any) -> bool:
        return True

    def o_bias(self, cfg: Any) -> bool:
        # HF Qwen3 biases all four projections together.
        return bool(cfg.attention_bias)

    def hf_extras(self, cfg: Any) -> dict[str, Any]:
        return {"attention_bias": cfg.attention_bias, "use_sliding_window": False}

    def tiny_changes(self) -> dict[str, Any]:
        return {"head_dim": 16}  # head_dim * heads != hidden, as in the released Qwen3 models


QWEN2 = Qwen2Family()
QWEN3 = Qwen3Family()
