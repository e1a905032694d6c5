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
    """A per-token log-prob implementation selected by `loss.impl`.

    `factory(options) -> impl`, with `impl` callable as
        impl(hidden, lm_head, targets, temperature=1.0, *, entropy=False) -> TokenLogps
    hidden [B, T, H] and lm_head [H, V] (float32 or bfloat16), targets [B, T] int
    in [0, V), temperature > 0 (python float or scalar array). The result is a
    NamedTuple `(logp, entropy)` of float32 [B, T]: logp = log_softmax(hidden @
    lm_head / temperature)[target], entropy of that softmax (None unless
    `entropy=True`). Differentiable w.r.t. hidden and lm_head (temperature gets a
    zero cotangent). Padding positions are computed like any token; the loss
    masks them. V may be sharded over the `tp` mesh axis. The GRPO math on top
    (`grpo_losses.grpo_loss`) is shared by every implementation; see
    `grpo_losses.logps.TokenLogpsImpl`.

    provides_entropy: false for an implementation that cannot return the entropy;
    configs that need it (`loss.top_entropy_quantile` < 1) are then refused at load.
    """

    kind: ClassVar[str] = "loss"
    provides_entropy: bool = True


@dataclass(frozen=True)
class MeshSpec(PluginSpec):
    """A mesh strategy: `factory(options) -> strategy`, where the strategy has

      strategy.mesh_shape(devices=None) -> (dp, fsdp, tp)   sizes covering `devices`
      strategy.build_mesh(devices=None) -> jax.sharding.Mesh
          axes ("dp", "fsdp", "tp"), all AxisType.Auto; devices default to jax.devices()
      strategy.param_rules, strategy.activation_rules
          tuples of (logical_name, mesh_axis | tuple of mesh axes | None) pairs,
          e.g. (("embed", "fsdp"), ("heads", "tp"), ("batch", ("dp", "fsdp")))

    `mesh.strategy: "dp,fsdp,tp"` (e.g. "1,-1,2") selects the `explicit` strategy
    with that shape. The built-in strategies are `grpo_meshes.MeshStrategy`s."""

    kind: ClassVar[str] = "mesh"


@dataclass(frozen=True)
class RolloutSpec(PluginSpec):
    """A rollout backend: `factory(options) -> backend` implementing
    `grpo_core.contracts.RolloutBackend` (load_weights, release_weights, generate from
    token-id lists, trim), with `SamplingParams` and `RolloutResult` from
    `grpo_core.contracts` / `grpo_core.rollout_records`; the built-in `jax` backend is
    `grpo_rollout.JaxRollout`."""

    kind: ClassVar[str] = "rollout"


@dataclass(frozen=True)
class RewardSpec(PluginSpec):
    """A reward function: `factory(options) -> fn` with
    `fn(completions: list[str], answers: list[str]) -> list[float]`. The runner's
    completions are `grpo_core.contracts.CompletionText` strings, which also carry
    their token count, the token budget and whether they ended on a stop token."""

    kind: ClassVar[str] = "reward"


@dataclass(frozen=True)
class TaskSpec(PluginSpec):
    """A task (dataset of prompts with reference answers):
    `factory(options, *, seed, process_index, process_count) -> task` implementing
    `grpo_core.contracts.Task` (train_batch, test_examples, state, restore,
    use_chat_template), whose examples are `grpo_core.contracts.Example`s."""

    kind: ClassVar[str] = "task"


SPEC_TYPES: dict[str, type[PluginSpec]] = {
    spec.kind: spec for spec in (LossSpec, MeshSpec, RolloutSpec, RewardSpec, TaskSpec)
}
