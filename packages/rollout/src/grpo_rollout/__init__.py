"""grpo_rollout: the `jax` rollout backend (KV-cached, fully jitted Qwen decode); it
re-exports the rollout contract of `grpo_core.contracts`.

    from grpo_rollout import JaxRollout, Policy, SamplingParams
    rollout = JaxRollout()
    rollout.load_weights(Policy.of(model))
    result = rollout.generate(prompts, jax.random.key(0), SamplingParams(max_new_tokens=64, n=8))
    batch = rollout.trim(result)
"""

from grpo_core.contracts import Policy, RolloutBackend, SamplingParams
from grpo_core.rollout_records import RolloutResult, TrainBatch, trim_batch
from grpo_rollout.backend import JaxRollout, JaxRolloutOptions
from grpo_rollout.prompts import DEFAULT_PROMPT_BUCKETS, bucket_length, fit_to_bucket, left_pad
from grpo_rollout.sampling import sample_next

__all__ = [
    "DEFAULT_PROMPT_BUCKETS",
    "JaxRollout",
    "JaxRolloutOptions",
    "Policy",
    "RolloutBackend",
    "RolloutResult",
    "SamplingParams",
    "TrainBatch",
    "bucket_length",
    "fit_to_bucket",
    "left_pad",
    "sample_next",
    "trim_batch",
]
