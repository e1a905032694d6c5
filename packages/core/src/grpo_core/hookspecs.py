"""The hooks a grpo plugin may implement (entry-point group `grpo`).

A plugin is any importable module or object with functions decorated by
`grpo_core.hookimpl`. Each hook returns a list of spec records. Hook names and
arguments are stable: arguments are only ever added, never renamed.

Every example below is a complete plugin module: `tests/e2e/test_hookspec_examples.py`
runs one training step of the tiny config with each.
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
        from grpo_losses import TokenLogps

        @dataclass(frozen=True)
        class Options:
            upcast: bool = True

        def build(options: Options):
            def token_logps(hidden, lm_head, targets, temperature=1.0, *, entropy=False):
                logits = jnp.einsum("bth,hv->btv", hidden, lm_head) / temperature
                if options.upcast:
                    logits = logits.astype(jnp.float32)
                logp = jax.nn.log_softmax(logits, axis=-1)
                target_logp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
                ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1) if entropy else None
                return TokenLogps(target_logp.astype(jnp.float32), ent)
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
            param_rules = ()                    # every weight replicated
            activation_rules = (("batch", "dp"),)

            def mesh_shape(self, devices=None):
                return (len(devices or jax.devices()), 1, 1)

            def build_mesh(self, devices=None):
                devices = np.asarray(devices or jax.devices())
                return Mesh(devices.reshape(self.mesh_shape(list(devices))), ("dp", "fsdp", "tp"))

        @hookimpl
        def grpo_meshes():
            return [MeshSpec("data_only", lambda options: DataOnly(), Options,
                             "Pure data parallelism")]
    """


@hookspec
def grpo_rollouts() -> list[RolloutSpec]:
    """Rollout backends (`rollout.backend: <name>`): `grpo_core.contracts.RolloutBackend`s.

    Example (a uniform random sampler: the shape of a wrapper around another engine)::

        import math
        import jax, jax.numpy as jnp, numpy as np
        from grpo_core import NoOptions, RolloutSpec, hookimpl
        from grpo_core.rollout_records import RolloutResult, trim_batch

        class UniformSampler:
            vocab = None

            def load_weights(self, model):
                self.vocab = model.config.vocab_size  # an engine would copy the weights here

            def release_weights(self):
                pass

            def generate(self, prompts, key, sampling, *, pad_token_id=0, batch_sharding=None):
                rows = [list(p) for p in prompts for _ in range(sampling.n)]
                width, shape = max(map(len, rows)), (len(rows), sampling.max_new_tokens)
                pad = [width - len(row) for row in rows]  # left padding
                ids = np.array([[pad_token_id] * k + row for k, row in zip(pad, rows)], np.int32)
                mask = np.array([[0] * k + [1] * (width - k) for k in pad], np.int32)
                put = lambda x: x if batch_sharding is None else jax.device_put(x, batch_sharding)  # [rows, T]
                return RolloutResult(
                    prompt_ids=put(jnp.asarray(ids)), prompt_mask=put(jnp.asarray(mask)),
                    completion_ids=put(jax.random.randint(key, shape, 0, self.vocab)),
                    completion_mask=put(jnp.ones(shape, jnp.int32)), lengths=jnp.full(shape[0], shape[1]),
                    sampler_logps=put(jnp.full(shape, -math.log(self.vocab))), finished=jnp.zeros(shape[0], bool),
                    num_prompts=len(prompts), n=sampling.n)

            def trim(self, result):
                return trim_batch(result)

        @hookimpl
        def grpo_rollouts():
            return [RolloutSpec("uniform", lambda options: UniformSampler(), NoOptions, "Uniformly random tokens")]
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
    """Tasks selectable with `task.name: <name>`; a task implements `grpo_core.contracts.Task`.

    Example::

        from dataclasses import dataclass
        from grpo_core import TaskSpec, hookimpl
        from grpo_core.contracts import Example

        @dataclass(frozen=True)
        class Options:
            size: int = 100

        class Echo:
            use_chat_template = False

            def __init__(self, options, *, seed=0, process_index=0, process_count=1):
                numbers = range(process_index, options.size, process_count)  # this process's share
                self.examples = [Example(f"Repeat {i}", str(i), id=f"echo/{i}") for i in numbers]
                self.position = 0

            def train_batch(self, n):
                start, self.position = self.position, self.position + n
                return [self.examples[i % len(self.examples)] for i in range(start, start + n)]

            def test_examples(self, limit=None):
                return self.examples[:limit]

            def state(self):
                return {"position": self.position}

            def restore(self, state):
                self.position = state["position"]

        @hookimpl
        def grpo_tasks():
            return [TaskSpec("echo", Echo, Options, "Repeat a number")]
    """
