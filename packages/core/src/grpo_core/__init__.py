"""grpo-jax core: plugin hooks and registry, run configuration, Qwen models."""

from grpo_core.hookspecs import hookimpl
from grpo_core.specs import (AdvantageSpec, LossSpec, MeshSpec, NoOptions, PluginSpec, RewardSpec, RolloutSpec,
                             TaskSpec)

__all__ = [
    "hookimpl",
    "AdvantageSpec",
    "LossSpec",
    "MeshSpec",
    "NoOptions",
    "PluginSpec",
    "RewardSpec",
    "RolloutSpec",
    "TaskSpec",
]
