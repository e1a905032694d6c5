"""What a rollout returns, the trimmed training batch built from it, and the scored groups a
step sampler returns (`Sampled`, see grpo_core.step_samplers)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Training sequence widths are rounded up to a multiple of this: few compiled shapes,
# little padding.
DEFAULT_TRIM_BUCKET = 16


@struct.dataclass
class RolloutResult:
    """K completions per prompt; N = num_prompts * n rows, rows p*n .. p*n+n-1 share prompt p.

    prompt_ids       [N, Tp] int32  left-padded prompts (Tp a prompt bucket)
    prompt_mask      [N, Tp] int32  1 on real prompt tokens
    completion_ids   [N, Tn] int32  sampled tokens, pad id after a row ended (Tn = max_new_tokens)
    completion_mask  [N, Tn] int32  1 on sampled tokens, the stop token included
    lengths          [N]     int32  completion_mask.sum(1)
    sampler_logps    [N, Tn] f32    the sampler's log-prob of each token at the sampling
                                    temperature (unfiltered by default, see SamplingParams);
                                    0 where completion_mask is 0
    finished         [N]     bool   ended on a stop token (False: cut at max_new_tokens)
    loss_mask        [N, Tn] int32  or None (= completion_mask): 1 on the tokens the loss trains on;
                                    a multi-turn row's tool-turn tokens are real (completion_mask 1,
                                    attended to) but not the model's (loss_mask 0, sampler_logps 0)
    experts          [N, Tn, L, k] int8/int16 or None: a mixture-of-experts model's routing of each
                                    completion token in each layer in the rollout, -1 where none was
                                    recorded (SamplingParams.record_routing; routing replay)
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    lengths: jax.Array
    sampler_logps: jax.Array
    finished: jax.Array
    num_prompts: int = struct.field(pytree_node=False, default=0)
    n: int = struct.field(pytree_node=False, default=1)
    loss_mask: jax.Array | None = None  # last: positional construction keeps its meaning
    experts: jax.Array | None = None

    @property
    def group_ids(self) -> np.ndarray:
        """[N] index of the prompt each row was sampled from."""
        return np.arange(self.num_prompts * self.n) // self.n


@struct.dataclass
class TrainBatch:
    """Prompt + completion as one left-padded sequence batch, cut to the longest real row.

    Column t holds token t; `sampler_logps[:, t]` is the log-prob of token t given the
    tokens before it, so with targets = input_ids[:, 1:] the matching logps are
    sampler_logps[:, 1:] and the loss mask is completion_mask[:, 1:].

    input_ids        [N, T] int32
    attention_mask   [N, T] int32  1 on real prompt and completion tokens
    completion_mask  [N, T] int32  1 on completion tokens the loss trains on (the result's loss_mask)
    sampler_logps    [N, T] f32    0 outside the completion
    experts          [N, T, L, k]  the result's routing record (-1 on prompt columns), or None
    prompt_width: columns [0, prompt_width) are prompt, the rest completion.
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    sampler_logps: jax.Array
    prompt_width: int = struct.field(pytree_node=False, default=0)
    experts: jax.Array | None = None


def trimmed_widths(prompt_len: int, completion_len: int, prompt_cap: int, completion_cap: int,
                   bucket: int) -> tuple[int, int]:
    """(prompt columns, completion columns) covering the real lengths, total rounded up to
    a multiple of bucket (never past the caps); extra columns go to the completion side."""
    total = min(math.ceil((prompt_len + completion_len) / bucket) * bucket, prompt_cap + completion_cap)
    completion_width = min(completion_cap, total - prompt_len)
    return total - completion_width, completion_width


def trim_batch(result: RolloutResult, bucket: int = DEFAULT_TRIM_BUCKET) -> TrainBatch:
    """Cut prompt + completion to the real maximum length of the batch, rounded to bucket.

    Reads the per-row lengths back to the host (two small vectors) to pick the width.
    """
    if bucket < 1:
        raise ValueError(f"trim bucket={bucket} must be >= 1.")
    prompt_len = int(jnp.max(jnp.sum(result.prompt_mask, axis=1)))
    completion_len = max(int(jnp.max(result.lengths)), 1)
    prompt_w, completion_w = trimmed_widths(
        prompt_len, completion_len, result.prompt_ids.shape[1], result.completion_ids.shape[1], bucket)

    def join(prompt_part, completion_part):  # [N, Tp], [N, Tn] -> [N, prompt_w + completion_w]
        return jnp.concatenate([prompt_part[:, prompt_part.shape[1] - prompt_w:],
                                completion_part[:, :completion_w]], axis=1)

    zeros_i = jnp.zeros_like(result.prompt_mask)
    return TrainBatch(
        input_ids=join(result.prompt_ids, result.completion_ids),
        attention_mask=join(result.prompt_mask, result.completion_mask),
        completion_mask=join(zeros_i, result.completion_mask if result.loss_mask is None else result.loss_mask),
        sampler_logps=join(jnp.zeros(result.prompt_ids.shape, jnp.float32), result.sampler_logps),
        prompt_width=prompt_w,
        experts=None if result.experts is None else join(unrecorded_prompt(result), result.experts),
    )


def routing_record_dtype(num_experts: int) -> jnp.dtype:
    """The narrowest int holding a routing record's -1 .. num_experts - 1 (RolloutResult.experts)."""
    return jnp.dtype(jnp.int8 if num_experts <= 128 else jnp.int16)


def unrecorded_prompt(result: RolloutResult) -> jax.Array:
    """-1 (no record) for every prompt column of the result's routing record: [N, Tp, L, k]."""
    return jnp.full((*result.prompt_ids.shape, *result.experts.shape[2:]), -1, result.experts.dtype)


class Scores(NamedTuple):
    """The rewards of a step's rows: weighted total, unweighted per-function values, failure counts."""

    total: np.ndarray                 # [N] float32, sum of weight * per_fn
    per_fn: dict[str, np.ndarray]     # name -> [N] float32
    errors: dict[str, int]            # name -> samples whose reward could not be computed
    episodes: Mapping[str, np.ndarray] = {}  # a multi-turn rollout's per-row turns (StepRewards.episodes)


class Sampled(NamedTuple):
    """The groups a step trains on (what a `StepSampler` returns first): the prompts' examples,
    the rollout of their rows (group g is rows g*n .. g*n+n-1) and the rows' scores."""

    examples: list
    result: RolloutResult
    scores: Scores


# ---- waste of a rollout: what the decode loop ran against what it kept ----------------
@dataclass
class DecodeTally:
    """Decode work of one training step, summed over its rollouts.

    decode_steps:   decode-loop iterations run (a synchronous rollout runs as many as its
                    longest row is long: every row waits for it).
    slot_steps:     rows x decode_steps: the token slots the loop paid for.
    sampled_tokens: completion tokens sampled into those slots.
    """

    decode_steps: int = 0
    slot_steps: int = 0
    sampled_tokens: int = 0

    def add(self, rows: int, steps: int, tokens: int) -> None:
        self.decode_steps += int(steps)
        self.slot_steps += int(rows) * int(steps)
        self.sampled_tokens += int(tokens)

    def add_synchronous(self, lengths: np.ndarray) -> None:
        """A rollout that decodes until its last row stops: max(lengths) decode steps."""
        lengths = np.asarray(lengths)
        self.add(lengths.shape[0], int(lengths.max(initial=0)), int(lengths.sum()))

    @classmethod
    def synchronous(cls, lengths: np.ndarray) -> "DecodeTally":
        """The tally of one synchronous rollout of rows with these completion lengths."""
        tally = cls()
        tally.add_synchronous(lengths)
        return tally

    def __add__(self, other: "DecodeTally") -> "DecodeTally":
        return DecodeTally(self.decode_steps + other.decode_steps, self.slot_steps + other.slot_steps,
                           self.sampled_tokens + other.sampled_tokens)


def waste_metrics(tally: DecodeTally, kept_lengths: np.ndarray, prefix: str = "train-rollout/") -> dict:
    """Decode steps, completion tokens kept (the rows that reach the update), slot
    utilisation (= sampled tokens / (rows x decode steps)) and the kept length distribution."""
    kept = np.asarray(kept_lengths, np.int64)
    utilisation = tally.sampled_tokens / tally.slot_steps if tally.slot_steps else 0.0
    return {f"{prefix}decode_steps": tally.decode_steps, f"{prefix}tokens_kept": int(kept.sum()),
            f"{prefix}slot_utilisation": float(utilisation),
            f"{prefix}length_p50": float(np.percentile(kept, 50)) if kept.size else 0.0,
            f"{prefix}length_p90": float(np.percentile(kept, 90)) if kept.size else 0.0,
            f"{prefix}length_max": int(kept.max(initial=0))}
