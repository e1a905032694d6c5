"""grpo-jax core: plugin hooks and registry, run configuration, Qwen models."""

from grpo_core.hookspecs import hookimpl
from grpo_core.specs import (AdvantageSpec, CommandSpec, LossSpec, MeshSpec, NoOptions, PluginSpec, RewardSpec,
                             RolloutSpec, TaskSpec)
from grpo_core.specs import EnvironmentSpec, GraderSpec, ModelFamilySpec, ToolSpec

__all__ = [
    "hookimpl",
    "AdvantageSpec",
    "CommandSpec",
    "LossSpec",
    "MeshSpec",
    "NoOptions",
    "PluginSpec",
    "RewardSpec",
    "RolloutSpec",
    "TaskSpec",
    "ToolSpec",
    "EnvironmentSpec",
    "ModelFamilySpec",
    "GraderSpec",
]
