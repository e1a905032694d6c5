"""A `grpo_rollouts` plugin: uniformly random tokens (`rollout.backend: uniform`), the shape of
a wrapper around another engine; a `grpo_core.contracts.RolloutBackend` that `grpo-run --plan`
can plan (`PlannableRollout`)."""

import math
import jax, jax.numpy as jnp, numpy as np
from grpo_core import NoOptions, RolloutSpec, hookimpl
from grpo_core.contracts import RolloutWidths
from grpo_core.rollout_records import DEFAULT_TRIM_BUCKET, RolloutResult, trim_batch, trimmed_widths


def draw(shape, vocab, batch_sharding):
    """The one device program of a rollout: uniformly random tokens [rows, new tokens]."""
    return jax.jit(lambda key: jax.random.randint(key, shape, 0, vocab), out_shardings=batch_sharding)


class UniformSampler:
    vocab = None

    def load_weights(self, policy):
        self.vocab = policy.config.vocab_size  # an engine would copy policy.weights here

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
            completion_ids=draw(shape, self.vocab, batch_sharding)(key),
            completion_mask=put(jnp.ones(shape, jnp.int32)), lengths=jnp.full(shape[0], shape[1]),
            sampler_logps=put(jnp.full(shape, -math.log(self.vocab))), finished=jnp.zeros(shape[0], bool),
            num_prompts=len(prompts), n=sampling.n)

    def trim(self, result):
        return trim_batch(result)

    # `grpo-run --plan` (optional: grpo_core.contracts.PlannableRollout)
    def widths(self, max_prompt_length, max_new_tokens):
        prompt, completion = max_prompt_length, max_new_tokens  # prompts are padded to the longest only
        return RolloutWidths(prompt, *trimmed_widths(prompt, completion, prompt, completion, DEFAULT_TRIM_BUCKET))

    def compile_phases(self, shapes, compiler):
        shape = (shapes.prompts * shapes.sampling.n, shapes.sampling.max_new_tokens)
        sample = draw(shape, shapes.policy.config.vocab_size, shapes.batch_sharding)
        compiler.compile("rollout sample", lambda: sample.lower(shapes.key).compile(), (shapes.key,))


@hookimpl
def grpo_rollouts():
    return [RolloutSpec("uniform", lambda options: UniformSampler(), NoOptions, "Uniformly random tokens")]
