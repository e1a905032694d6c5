"""A model family plugin: Qwen2's layout (q/k/v biases, plain RoPE, no q/k norm) published under
its own HF `model_type`, `biased_decoder`. A family is written as its difference from the
shared decoder (`grpo_core.model_families.ModelFamily`); this one only fixes the attention biases.

Select it with `model.architecture.model_type: biased_decoder` (or a checkpoint whose config.json
says so); its exports carry `"architectures": ["BiasedDecoderForCausalLM"]`.
"""

from typing import Any

from grpo_core import ModelFamilySpec, hookimpl
from grpo_core.model_families import ModelFamily, unsupported


class BiasedDecoder(ModelFamily):
    name = "biased_decoder"
    architecture = "BiasedDecoderForCausalLM"
    attention_bias = True  # the default of model.architecture.attention_bias

    def validate(self, cfg: Any) -> None:
        if not cfg.attention_bias:
            raise unsupported("attention_bias", cfg.attention_bias, "true for biased_decoder")

    def hf_extras(self, cfg: Any) -> dict[str, Any]:
        return {"attention_bias": True, "mlp_bias": False}


@hookimpl
def grpo_model_families() -> list[ModelFamilySpec]:
    return [ModelFamilySpec("biased_decoder", lambda options: BiasedDecoder(),
                            description="Qwen2's layout (q/k/v biases) under its own model_type")]
