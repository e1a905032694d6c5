"""The hooks a grpo plugin may implement (entry-point group `grpo`).

A plugin is any importable module or object with functions decorated by
`grpo_core.hookimpl`. Each hook returns a list of spec records. Hook names and
arguments are stable: arguments are only ever added, never renamed.
"""

from __future__ import annotations

import pluggy

from grpo_core.specs import LossSpec, MeshSpec, RewardSpec, RolloutSpec, TaskSpec

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def grpo_losses() -> list[LossSpec]:
    """Loss implementations selectable with `loss.impl: <name>`.

    Example (module `my_loss/plugin.py`, registered in pyproject.toml as
    `[project.entry-points.grpo] my_loss = "my_loss.plugin"`)::

        from dataclasses import dataclass
        import jax, jax.numpy as jnp
        from grpo_core import LossSpec, hookimpl

        @dataclass(frozen=True)
        class Options:
            upcast: bool = True

        def build(options: Options):
            def token_logps(hidden, lm_head, targets, temperature=1.0, *, entropy=False):
                from grpo_losses import TokenLogps
                logits = jnp.einsum("bth,hv->btv", hidden, lm_head) / temperature
                logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                target_logp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
                ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1) if entropy else None
                return TokenLogps(target_logp, ent)
            return token_logps

        @hookimpl
        def grpo_losses():
            return [LossSpec("naive", build, Options, "Naive logits-materialising loss")]
    """


@hookspec
def grpo_meshes() -> list[MeshSpec]:
    """Mesh strategies selectable with `mesh.strategy: <name>`.

    Example::

        from dataclasses import dataclass
        import jax, numpy as np
        from jax.sharding import Mesh
        from grpo_core import MeshSpec, hookimpl

        @dataclass(frozen=True)
        class Options:
            pass

        class DataOnly:
            def build_mesh(self, devices=None):
                devices = np.asarray(devices or jax.devices())
                return Mesh(devices.reshape(-1, 1, 1), ("dp", "fsdp", "tp"))

        @hookimpl
        def grpo_meshes():
            return [MeshSpec("data_only", lambda options: DataOnly(), Options,
                             "Pure data parallelism")]
    """


@hookspec
def grpo_rollouts() -> list[RolloutSpec]:
    """Rollout backends selectable with `rollout.backend: <name>`.

    Example::

        from dataclasses import dataclass
        from grpo_core import RolloutSpec, hookimpl

        @dataclass(frozen=True)
        class Options:
            max_batch: int = 64

        class MyBackend:
            def __init__(self, options):
                self.options = options
            def generate(self, model, prompt_ids, prompt_mask, key, sampling):
                ...  # returns a rollout result record

        @hookimpl
        def grpo_rollouts():
            return [RolloutSpec("mine", MyBackend, Options, "My sampler")]
    """


@hookspec
def grpo_rewards() -> list[RewardSpec]:
    """Reward functions selectable under `task.rewards: {<name>: <weight>}`.

    Example::

        from dataclasses import dataclass
        from grpo_core import RewardSpec, hookimpl

        @dataclass(frozen=True)
        class Options:
            target: int = 100

        def build(options: Options):
            def shortness(completions, answers):
                return [1.0 if len(c) <= options.target else 0.0 for c in completions]
            return shortness

        @hookimpl
        def grpo_rewards():
            return [RewardSpec("short", build, Options, "1 when the completion is short")]
    """


@hookspec
def grpo_tasks() -> list[TaskSpec]:
    """Tasks selectable with `task.name: <name>`.

    Example::

        from dataclasses import dataclass
        from grpo_core import TaskSpec, hookimpl

        @dataclass(frozen=True)
        class Options:
            size: int = 100

        class Echo:
            def __init__(self, options):
                self.rows = [{"question": f"Repeat {i}", "answer": str(i)}
                             for i in range(options.size)]

        @hookimpl
        def grpo_tasks():
            return [TaskSpec("echo", Echo, Options, "Repeat a number")]
    """
