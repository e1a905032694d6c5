"""Typed records that plugins return from the `grpo_*` hooks.

Every record names one thing a config can select (`loss.impl: fused`,
`mesh.strategy: auto`, ...), the callable that builds it, the dataclass that
validates its `options:` block, and a one-line description for `grpo-run plugins`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar


@dataclass(frozen=True)
class NoOptions:
    """Options dataclass for plugins that take no options."""


@dataclass(frozen=True)
class PluginSpec:
    """Common shape of every spec record.

    name:        the value a config uses to select this entry.
    factory:     builds the object from a validated options instance
                 (see the subclass for the exact call signature).
    options:     a frozen dataclass type; the section's `options:` mapping is
                 validated against it (unknown keys and wrong types are errors).
    description: one line shown by `grpo-run plugins`.
    """

    kind: ClassVar[str] = "plugin"
    name: str
    factory: Callable[..., Any]
    options: type = NoOptions
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"{type(self).__name__}.name must be a non-empty string, got {self.name!r}")
        if not callable(self.factory):
            raise TypeError(f"{type(self).__name__} {self.name!r}: factory must be callable, got {self.factory!r}")
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(
                f"{type(self).__name__} {self.name!r}: options must be a dataclass type, got {self.options!r}"
            )


@dataclass(frozen=True)
class LossSpec(PluginSpec):
    """A per-token log-prob implementation selected by `loss.impl`:
    `factory(options) -> grpo_core.contracts.TokenLogpsImpl` (optionally a `MeshAwareLoss`).

    provides_entropy: false for an implementation that cannot return the entropy;
    configs that need it (`loss.top_entropy_quantile` < 1) are then refused at load."""

    kind: ClassVar[str] = "loss"
    provides_entropy: bool = True


@dataclass(frozen=True)
class MeshSpec(PluginSpec):
    """A mesh strategy selected by `mesh.strategy`: `factory(options) -> grpo_core.contracts.MeshStrategy`.
    `mesh.strategy: "dp,fsdp,tp"` (e.g. "1,-1,2") selects the `explicit` strategy with that shape."""

    kind: ClassVar[str] = "mesh"


@dataclass(frozen=True)
class RolloutSpec(PluginSpec):
    """A rollout backend selected by `rollout.backend`: `factory(options) -> grpo_core.contracts.RolloutBackend`."""

    kind: ClassVar[str] = "rollout"


@dataclass(frozen=True)
class RewardSpec(PluginSpec):
    """A reward function named in `task.rewards`: `factory(options) -> grpo_core.contracts.RewardFn`;
    the runner's completions are `grpo_core.contracts.CompletionText` strings."""

    kind: ClassVar[str] = "reward"


@dataclass(frozen=True)
class TaskSpec(PluginSpec):
    """A task selected by `task.name`: `factory(options, *, seed, process_index, process_count) ->
    grpo_core.contracts.Task` (optionally a `ListableTask`)."""

    kind: ClassVar[str] = "task"


@dataclass(frozen=True)
class AdvantageSpec(PluginSpec):
    """An advantage estimator selected by `loss.advantage_estimator` (options: `loss.advantage_options`):
    `factory(options, setup: grpo_core.advantage_records.AdvantageSetup) ->
    grpo_core.contracts.AdvantageEstimator`; a ValueError from it refuses the config."""

    kind: ClassVar[str] = "advantage"


@dataclass(frozen=True)
class CommandSpec(PluginSpec):
    """A `grpo-run <name> ...` subcommand: `factory(argv) -> exit code`, called with the arguments
    after the name. A `grpo_core.errors.UserError` it raises prints as one line and exits 2."""

    kind: ClassVar[str] = "command"


SPEC_TYPES: dict[str, type[PluginSpec]] = {
    spec.kind: spec for spec in (LossSpec, MeshSpec, RolloutSpec, RewardSpec, TaskSpec, AdvantageSpec, CommandSpec)
}


# ---- multi-turn rollouts: tools and environments ----------------------------------------
@dataclass(frozen=True)
class ToolSpec(PluginSpec):
    """A tool a multi-turn rollout offers the policy by name: `factory(options) ->
    grpo_core.contracts.Tool`, built once per run and called from several threads at once."""

    kind: ClassVar[str] = "tool"


@dataclass(frozen=True)
class EnvironmentSpec(PluginSpec):
    """A multi-turn environment selected by name: `factory(options) ->
    grpo_core.contracts.Environment`, called once per rollout row (each row has its own state)."""

    kind: ClassVar[str] = "environment"


@dataclass(frozen=True)
class ModelFamilySpec(PluginSpec):
    """A decoder family selected by its HF `model_type` (the name) in `model.architecture` or a
    checkpoint's config.json: `factory(options) -> grpo_core.model_families.ModelFamily`."""

    kind: ClassVar[str] = "model_family"


@dataclass(frozen=True)
class GraderSpec(PluginSpec):
    """A grader named by a task's `grader` option (the `dataset` task's `task.options.grader`):
    `factory(options) -> grpo_core.contracts.Grader`, built once per task."""

    kind: ClassVar[str] = "grader"


SPEC_TYPES.update({spec.kind: spec for spec in (ToolSpec, EnvironmentSpec, ModelFamilySpec, GraderSpec)})
