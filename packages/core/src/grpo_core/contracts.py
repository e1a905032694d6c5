"""What the runner asks of each plugin kind (loss, mesh strategy, rollout backend, reward
function, task, advantage estimator), typed, so that a plugin package providing one needs
`grpo-core` alone. A spec's factory (`grpo_core.specs`) builds the object a protocol here
describes; members a plugin may leave out are their own protocols, checked with `isinstance`.

The rollout backend's contracts (grpo_core.rollout_contracts), the task's (grpo_core.task_contracts), the
multi-turn kinds (`Tool`, `Environment`: grpo_core.multi_turn) and the `StepSampler` the loop drives
(grpo_core.step_samplers) live in their own modules and are importable from here like the others.

Built-in implementations: grpo_losses, grpo_meshes, grpo_rollout, grpo_runner_gsm8k; `examples/hooks/` has each anew.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import jax
from jax.sharding import Mesh

from grpo_core.advantage_records import AdvantageResult, AdvantageSetup, StepRewards
from grpo_core.multi_turn import (Environment, EnvironmentStep, SavedEnvironment, Tool,  # noqa: F401 (re-exported)
                                   ToolError)
from grpo_core.rollout_contracts import (KeptCacheRollout, MemoryCheckedRollout, PhaseCompiler,  # noqa: F401 (re-exported)
                                         PlannableRollout, Policy, ProjectingRollout, RolloutBackend, RolloutShapes,
                                         RolloutWidths, SamplingParams)
from grpo_core.rollout_records import RolloutResult, Sampled, Scores, TrainBatch  # noqa: F401 (re-exported)
from grpo_core.step_samplers import CarryingSampler, StepSampler, loaded  # noqa: F401 (re-exported)
from grpo_core.task_contracts import (CompletionText, ConversationText, Example, ListableTask,  # noqa: F401 (re-exported)
                                      Task)

Array = jax.Array


# ---- loss (`LossSpec.factory(options) -> TokenLogpsImpl`) ---------------------------
class TokenLogps(NamedTuple):
    """Per-token results of a loss implementation, both float32 [B, T].

    logp:    log p(target) under softmax(logits / temperature).
    entropy: entropy of that softmax; None unless asked for with `entropy=True`.
    """

    logp: Array
    entropy: Array | None = None


class TokenLogpsImpl(Protocol):
    """What `LossSpec.factory(options)` returns: `log_softmax(hidden @ lm_head / T)[target]`.

    Call as `impl(hidden, lm_head, targets, temperature=1.0, *, entropy=False)`:
      hidden  [B, T, H] float32 or bfloat16
      lm_head [H, V]    same dtype family; V may be sharded over the `tp` mesh axis
      targets [B, T]    int, every entry in [0, V) (padding positions too; mask later)
      temperature       python float or scalar array (> 0)
    Returns `TokenLogps` (float32 [B, T]), differentiable w.r.t. hidden and lm_head (the
    temperature gets a zero cotangent). The GRPO math on top is shared by every impl.
    """

    def __call__(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array = 1.0,
                 *, entropy: bool = False) -> TokenLogps: ...


@runtime_checkable
class MeshAwareLoss(Protocol):
    """Optional member of a loss implementation that must know the run's mesh (e.g. to
    run its kernel per device under shard_map): the run calls it once and uses the result."""

    def on_mesh(self, mesh: Mesh) -> TokenLogpsImpl: ...


# ---- mesh strategy (`MeshSpec.factory(options) -> MeshStrategy`) ----------------------
@runtime_checkable
class MeshStrategy(Protocol):
    """How devices form the ("dp", "fsdp", "tp") mesh and how logical axes map onto it.

    param_rules / activation_rules: tuples of (logical_name, mesh_axis | tuple of mesh
    axes | None) pairs, e.g. (("embed", "fsdp"), ("heads", "tp"), ("batch", ("dp", "fsdp"))).
    """

    param_rules: tuple
    activation_rules: tuple

    def mesh_shape(self, devices: Sequence[Any] | None = None) -> tuple[int, int, int]:
        """(dp, fsdp, tp) sizes covering `devices` (default: jax.devices())."""

    def build_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        """The Mesh with axes ("dp", "fsdp", "tp"), all AxisType.Auto, over `devices`."""


# ---- reward (`RewardSpec.factory(options) -> RewardFn`) -------------------------------
class RewardFn(Protocol):
    """Scores decoded completions: one float per completion. `answers[i]` is the task's
    reference final answer for `completions[i]` (e.g. "72")."""

    def __call__(self, completions: list[str], answers: list[str]) -> Sequence[float]: ...


# ---- grader (`GraderSpec.factory(options) -> Grader`) ---------------------------------------
class Grader(Protocol):
    """Grades decoded completions against references: one (answer, correct) pair per completion,
    `answer` the text it read from the completion (None: none found) and `correct` the verdict."""

    def __call__(self, completions: Sequence[str], references: Sequence[str]) -> Sequence[tuple[str | None, bool]]: ...


# ---- advantage estimator (`AdvantageSpec.factory(options, setup: AdvantageSetup)`) ----------
@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns one step's rewards into one advantage per row; `grpo_core.advantage_records`
    holds its records (`AdvantageSetup`, `StepRewards`, `AdvantageResult`) and the zero-std
    rule (`zero_std_groups`) every estimator shares."""

    def __call__(self, rewards: StepRewards) -> AdvantageResult: ...
