"""What the jitted rollout phases hand back: a finished loop state as a RolloutResult, and the
abstract outputs of a compiled phase (the next phase's inputs in `--plan`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpo_core.contracts import SamplingParams
from grpo_core.rollout_records import RolloutResult


def abstract_outputs(compiled: Any) -> Any:
    """The outputs of a compiled function as sharded ShapeDtypeStructs."""
    return jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                        compiled.out_info, compiled.output_shardings)


def finish(ids: jax.Array, mask: jax.Array, state, sampling: SamplingParams) -> RolloutResult:
    """Final loop state -> RolloutResult (masks from the per-row lengths)."""
    columns = jnp.arange(sampling.max_new_tokens)[None, :]
    completion_mask = (columns < state.lengths[:, None]).astype(jnp.int32)  # [N, Tn]
    return RolloutResult(
        prompt_ids=ids, prompt_mask=mask, completion_ids=state.tokens, completion_mask=completion_mask,
        lengths=state.lengths, sampler_logps=state.logps, finished=state.done,
        num_prompts=ids.shape[0] // sampling.n, n=sampling.n, experts=state.experts,
    )
