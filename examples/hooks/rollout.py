"""Example `grpo_rollouts` plugin: Rollout backends (`rollout.backend: <name>`): `grpo_core.contracts.RolloutBackend`s.

A complete plugin module (register it in pyproject.toml as
`[project.entry-points.grpo] my_plugin = "my_plugin.plugin"`); tests/e2e/test_hookspec_examples.py
trains one step of the tiny config with it.
"""

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
