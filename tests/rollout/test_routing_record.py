"""A mixture-of-experts rollout records the experts each completion token was routed to: exactly
the routing of a cache-free forward over the same tokens, and it reaches the training batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.contracts import Policy, SamplingParams
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.router_stats import routing_of
from grpo_rollout import JaxRollout, JaxRolloutOptions
from grpo_rollout.decode import LoopState, with_routing_record

MOE = QwenConfig.tiny("qwen3_moe", vocab_size=64)
PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1]]
SAMPLING = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, stop_token_ids=(0, 1, 2), record_routing=True)


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_rollout_records_the_experts_a_forward_routes_its_tokens_to(shared_prompt):
    model = init_from_config(MOE, seed=0)
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(4,), trim_bucket=4, shared_prompt=shared_prompt))
    rollout.load_weights(Policy.of(model))
    result = rollout.generate(PROMPTS, jax.random.key(0), SAMPLING, pad_token_id=0)
    rows, width = result.completion_ids.shape
    assert result.experts.shape == (rows, width, MOE.num_hidden_layers, MOE.num_experts_per_tok)
    assert result.experts.dtype == jnp.int8
    batch = rollout.trim(result)
    own = np.asarray(routing_of(model, batch.input_ids, batch.attention_mask))
    record = np.asarray(batch.experts).astype(np.int32)
    prompt = batch.prompt_width
    # A completion token is routed when the next step feeds it: all but each row's last one.
    fed = np.arange(batch.input_ids.shape[1])[None] < prompt + np.asarray(result.lengths)[:, None] - 1
    fed[:, :prompt] = False
    assert fed.sum() >= rows  # some rows feed several tokens
    np.testing.assert_array_equal(record[fed], own[fed])
    assert (record[~fed] == -1).all()  # prompt columns, last tokens and padding have no record


def test_a_record_only_when_asked_and_for_a_mixture_of_experts():
    state = LoopState(step=jnp.zeros((), jnp.int32), last=jnp.zeros(3, jnp.int32), done=jnp.zeros(3, bool),
                      lengths=jnp.zeros(3, jnp.int32), tokens=jnp.zeros((3, 6), jnp.int32),
                      logps=jnp.zeros((3, 6), jnp.float32))
    assert with_routing_record(state, MOE, SAMPLING).experts.shape == (3, 6, MOE.num_hidden_layers, 2)
    assert with_routing_record(state, MOE, SAMPLING.__class__(max_new_tokens=6)).experts is None
    assert with_routing_record(state, QwenConfig.tiny("qwen3"), SAMPLING).experts is None
    wide = with_routing_record(state, MOE.replace(num_experts=129), SAMPLING).experts
    assert wide.dtype == jnp.int16 and int(wide.min()) == -1
