"""The built-in model families, registered through the `grpo` entry point like any plugin's."""

from grpo_core.hookspecs import hookimpl
from grpo_core.models.config import BUILTIN_FAMILIES
from grpo_core.specs import ModelFamilySpec

DESCRIPTIONS = {
    "qwen2": "Qwen2 / Qwen2.5: q/k/v biases",
    "qwen3": "Qwen3: per-head q/k RMSNorm, explicit head_dim",
    "llama": "Llama 3.x: no attention biases, llama3 RoPE scaling",
    "gemma3_text": "Gemma 3 (text): 5:1 sliding-window/global layers, four (1 + w) norms, GeGLU, scaled embeddings",
    "qwen3_moe": "Qwen3-MoE: Qwen3 attention, top-k routed SwiGLU experts (dropless grouped matmul)",
}


@hookimpl
def grpo_model_families() -> list[ModelFamilySpec]:
    return [ModelFamilySpec(family.name, lambda options, family=family: family, description=DESCRIPTIONS[family.name])
            for family in BUILTIN_FAMILIES]
