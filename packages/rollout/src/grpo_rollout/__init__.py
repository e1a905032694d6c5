"""grpo_rollout: the `jax` rollout backend (KV-cached, fully jitted Qwen decode).

    from grpo_rollout import JaxRollout, SamplingParams
    result = JaxRollout().generate_from_lists(model, prompts, jax.random.key(0),
                                              SamplingParams(max_new_tokens=64, n=8))
    batch = result.trim()
"""

from grpo_rollout.backend import JaxRollout, JaxRolloutOptions
from grpo_rollout.prompts import DEFAULT_PROMPT_BUCKETS, bucket_length, fit_to_bucket, left_pad
from grpo_rollout.result import RolloutResult, TrainBatch, trim_batch
from grpo_rollout.sampling import SamplingParams, sample_next

__all__ = [
    "DEFAULT_PROMPT_BUCKETS",
    "JaxRollout",
    "JaxRolloutOptions",
    "RolloutResult",
    "SamplingParams",
    "TrainBatch",
    "bucket_length",
    "fit_to_bucket",
    "left_pad",
    "sample_next",
    "trim_batch",
]
