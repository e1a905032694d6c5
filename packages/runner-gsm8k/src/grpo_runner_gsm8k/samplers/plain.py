"""The synchronous step: `rollout.prompts_per_step` fresh prompts from the task, `rollout.n`
completions each, every row decoded to its end in one rollout, then scored.

`scored_rollout` is that one rollout; the refill sampler runs it again while too few groups
are informative.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from grpo_core.contracts import Policy
from grpo_core.rollout_records import DecodeTally, Sampled, Scores, waste_metrics
from grpo_core.step_samplers import loaded

from grpo_runner_gsm8k.multihost import gather_objects, host_array
from grpo_runner_gsm8k.training.scoring import score
from grpo_runner_gsm8k.tokens import decode_completions, tokenize_prompts, with_prompts


def score_groups(run: Any, examples: list, completions: list) -> Scores:
    """The run's rewards of the rows of `examples`' groups (row i belongs to example i // n)."""
    n = run.cfg.rollout.n
    answers = [ex.answer for ex in examples for _ in range(n)]
    return score(run.inputs.rewards, with_prompts(completions, examples, n, run.cfg.task.system_prompt), answers)


def scored_rollout(run: Any, policy: Policy, key: jax.Array) -> tuple[Sampled, DecodeTally, dict[str, float]]:
    """(fresh prompts rolled out with `policy` and scored, the decode work, its seconds)."""
    start = time.monotonic()
    inputs = run.inputs
    examples = gather_objects(inputs.task.train_batch(inputs.prompts_per_process))
    prompts = tokenize_prompts(run, examples)
    with loaded(run.rollout, policy) as backend:
        result = backend.generate(prompts, key, run.sampling, pad_token_id=inputs.tokenizer.pad_token_id,
                                  batch_sharding=run.rollout_sharding)
    jax.block_until_ready(result.completion_ids)
    work = DecodeTally.synchronous(host_array(result.lengths))
    reward_start = time.monotonic()
    scores = score_groups(run, examples, decode_completions(inputs.tokenizer, result))
    seconds = {"rollout_s": reward_start - start, "reward_s": time.monotonic() - reward_start}
    return Sampled(examples, result, scores), work, seconds


class PlainSampler:
    """One rollout per step (`StepSampler`)."""

    def __init__(self, run: Any):
        self.run = run

    def sample(self, policy: Policy, key: jax.Array, step: int) -> tuple[Sampled, dict[str, Any], dict[str, float]]:
        sampled, work, seconds = scored_rollout(self.run, policy, key)
        return sampled, waste_metrics(work, host_array(sampled.result.lengths)), seconds
