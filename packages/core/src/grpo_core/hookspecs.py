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
    """Rollout backends selectable with `rollout.backend: <name>`; a backend implements
    `grpo_core.contracts.RolloutBackend` and needs `grpo-core` alone.

    Example (a uniform random sampler: the shape of a wrapper around another engine)::

        import math
        from dataclasses import dataclass
        import jax, jax.numpy as jnp, numpy as np
        from grpo_core import RolloutSpec, hookimpl
        from grpo_core.rollout_records import RolloutResult, trim_batch

        @dataclass(frozen=True)
        class Options:
            prompt_width: int = 64

        class UniformSampler:
            def __init__(self, options):
                self.options, self.vocab = options, None

            def load_weights(self, model):
                self.vocab = model.config.vocab_size  # an engine would copy the weights here

            def release_weights(self):
                pass

            def generate(self, prompts, key, sampling, *, pad_token_id=0, batch_sharding=None):
                rows = [list(p) for p in prompts for _ in range(sampling.n)]
                width, new = self.options.prompt_width, sampling.max_new_tokens
                ids = np.full((len(rows), width), pad_token_id, np.int32)
                for i, row in enumerate(rows):
                    ids[i, width - len(row):] = row
                lengths = np.array([len(row) for row in rows])
                mask = (np.arange(width) >= width - lengths[:, None]).astype(np.int32)
                put = lambda x: x if batch_sharding is None else jax.device_put(x, batch_sharding)  # [rows, T]
                return RolloutResult(
                    prompt_ids=put(jnp.asarray(ids)), prompt_mask=put(jnp.asarray(mask)),
                    completion_ids=put(jax.random.randint(key, (len(rows), new), 0, self.vocab)),
                    completion_mask=put(jnp.ones((len(rows), new), jnp.int32)),
                    lengths=jnp.full(len(rows), new, jnp.int32),
                    sampler_logps=put(jnp.full((len(rows), new), -math.log(self.vocab))),
                    finished=jnp.zeros(len(rows), bool),
                    num_prompts=len(prompts), n=sampling.n)

            def trim(self, result):
                return trim_batch(result)

        @hookimpl
        def grpo_rollouts():
            return [RolloutSpec("uniform", UniformSampler, Options, "Uniformly random tokens")]
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
