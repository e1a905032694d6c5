"""The hooks a grpo plugin may implement (entry-point group `grpo`).

A plugin is any importable module or object with functions decorated by
`grpo_core.hookimpl`. Each hook returns a list of spec records (`grpo_core.specs`) whose
factories build the objects described in `grpo_core.contracts`. Hook names and arguments
are stable: arguments are only ever added, never renamed.

A complete plugin module per hook is in `examples/hooks/` (loss.py, mesh.py, rollout.py,
reward.py, task.py, advantage.py, command.py, step_end.py, tool.py, environment.py, model_family.py,
grader.py);
`tests/e2e/test_hookspec_examples.py` trains a short run with each (those of kinds that do not
overlap together).
"""

from __future__ import annotations

from typing import Any

import pluggy

from grpo_core.specs import AdvantageSpec, CommandSpec, LossSpec, MeshSpec, RewardSpec, RolloutSpec, TaskSpec
from grpo_core.specs import EnvironmentSpec, GraderSpec, ModelFamilySpec, ToolSpec

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def grpo_losses() -> list[LossSpec]:
    """Loss implementations (`contracts.TokenLogpsImpl`) selectable with `loss.impl: <name>`."""


@hookspec
def grpo_meshes() -> list[MeshSpec]:
    """Mesh strategies (`contracts.MeshStrategy`) selectable with `mesh.strategy: <name>`."""


@hookspec
def grpo_rollouts() -> list[RolloutSpec]:
    """Rollout backends (`contracts.RolloutBackend`) selectable with `rollout.backend: <name>`."""


@hookspec
def grpo_rewards() -> list[RewardSpec]:
    """Reward functions (`contracts.RewardFn`) selectable under `task.rewards: {<name>: <weight>}`."""


@hookspec
def grpo_tasks() -> list[TaskSpec]:
    """Tasks (`contracts.Task`) selectable with `task.name: <name>`."""


@hookspec
def grpo_advantages() -> list[AdvantageSpec]:
    """Advantage estimators (`contracts.AdvantageEstimator`) selectable with `loss.advantage_estimator: <name>`."""


@hookspec
def grpo_commands() -> list[CommandSpec]:
    """Subcommands of `grpo-run` (`grpo-run <name> ...`); the built-in ones register the same way."""


@hookspec
def grpo_step_end(step: int, metrics: dict[str, Any], run_dir: str) -> None:
    """Called on every process after each training step is logged, with that step's metrics and the run directory."""


@hookspec
def grpo_tools() -> list[ToolSpec]:
    """Tools (`contracts.Tool`) a multi-turn rollout offers the policy by name."""


@hookspec
def grpo_environments() -> list[EnvironmentSpec]:
    """Multi-turn environments (`contracts.Environment`), one fresh instance per rollout row."""


@hookspec
def grpo_model_families() -> list[ModelFamilySpec]:
    """Decoder families (`model_families.ModelFamily`) selected by a config.json's `model_type`."""


@hookspec
def grpo_graders() -> list[GraderSpec]:
    """Graders (`contracts.Grader`) selectable by name where a task takes one (`task.options.grader` of `dataset`)."""
