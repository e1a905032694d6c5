"""Segmented decoding (grpo_rollout.segments) samples what the one-loop decode samples: greedy
tokens identical, sampled tokens identical with log-probs within 1e-5 (f32: the segments' softmax
sums are shorter by masked slots that add exactly 0, so only the summation order may differ), on
qwen2 and qwen3, shared and repeated prompt caches, and on 8 devices in every decode layout."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.contracts import Policy
from grpo_core.testing import assert_same_rollout
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams
from grpo_rollout.decode import LoopState
from grpo_rollout.segments import run_segments, segment_count, segment_ranges, segmented_seconds

PROMPTS = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30], [88, 1]]
STOP_IDS = tuple(range(100, 108))  # about one token in sixteen ends a row
SAMPLED = SamplingParams(max_new_tokens=7, n=2, temperature=0.9, stop_token_ids=STOP_IDS)
GREEDY = SamplingParams(max_new_tokens=7, n=2, greedy=True)
LAYOUTS = {"gathered": True, "sharded": False, "model_parallel": "model_parallel", "head_parallel": "head_parallel"}


@pytest.fixture
def segment_calls(monkeypatch):
    """The `until` of each decode call (None: the last segment's, the one-loop program)."""
    import grpo_rollout.backend as backend

    calls, jitted = [], backend.decode

    def recording(*args, until=None, **kwargs):
        calls.append(until)
        return jitted(*args, until=until, **kwargs)

    monkeypatch.setattr(backend, "decode", recording)
    return calls


def assert_same_samples(model, params, segment_calls, batch_sharding=None, **options):
    """One loop against 3 segments (steps 1-2, 3-4, 5-6) with otherwise equal options."""
    results = []
    for segments in (1, 3):
        segment_calls.clear()
        rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), decode_segments=segments, **options))
        rollout.load_weights(Policy.of(model))
        results.append(rollout.generate(PROMPTS, jax.random.key(7), params, batch_sharding=batch_sharding))
    whole, segmented = results
    assert segment_calls == [3, 5, None]  # every segment ran: some row was still live at step 5
    assert_same_rollout(segmented, whole)
    return whole


def test_segments_cover_the_decode_steps_in_aligned_views():
    assert segment_ranges(7, 3) == [(1, 3), (3, 5), (5, 7)]
    ranges = segment_ranges(1024, segment_count("auto", 1024))
    assert ranges[0] == (1, 129) and ranges[-1] == (897, 1024) and len(ranges) == 8
    assert all(end == first for (_, end), (first, _) in zip(ranges, ranges[1:]))
    assert all((end - 1) % 8 == 0 for _, end in ranges[:-1])  # the views (end - 1 slots) are whole tiles
    assert segment_count("auto", 255) == 1 and segment_count("auto", 256) == 2 and segment_count("auto", 4096) == 8
    assert segment_ranges(2, 4) == [(1, 2)]  # more segments than steps: one per step at most


def test_the_host_stops_calling_segments_once_every_row_ended():
    calls = []

    def decoder_for(until):
        def run(weights, cache, state, key):
            calls.append(until)
            return cache, state.replace(done=jnp.ones_like(state.done))
        return run

    state = LoopState(step=jnp.ones((), jnp.int32), last=jnp.zeros(2, jnp.int32), done=jnp.zeros(2, bool),
                      lengths=jnp.zeros(2, jnp.int32), tokens=jnp.zeros((2, 7), jnp.int32), logps=jnp.zeros((2, 7)))
    run_segments(decoder_for, None, None, state, None, 7, 3)
    assert calls == [3]


def test_auto_ranks_a_segmented_decode_with_one_setup_per_segment():
    """A projector's seconds are one setup plus the steps; 3 segments pay the setup 3 times, which
    turns a gathered layout (a setup, cheaper steps) from the faster into the slower."""
    projector = lambda program, steps: program["setup"] + steps * program["step"]  # noqa: E731
    gathered, split = {"setup": 1.0, "step": 0.5}, {"setup": 0.0, "step": 0.625}
    assert segmented_seconds(projector, gathered, 10, 1) == 6.0 < segmented_seconds(projector, split, 10, 1) == 6.25
    assert segmented_seconds(projector, gathered, 10, 3) == 8.0 > segmented_seconds(projector, split, 10, 3) == 6.25


@pytest.mark.parametrize("bad", [0, -2, "four", True, 2.5])
def test_decode_segments_must_be_auto_or_a_positive_whole_number(bad):
    with pytest.raises(ValueError, match="decode_segments=.* must be auto or a whole number >= 1"):
        JaxRolloutOptions(decode_segments=bad)


@pytest.mark.parametrize(("model_type", "shared_prompt"), [("qwen2", False), ("qwen3", True)])
def test_segmented_decode_samples_the_one_loop_decodes_tokens(model_type, shared_prompt, segment_calls):
    model = init_from_config(QwenConfig.tiny(model_type, tie_word_embeddings=model_type == "qwen3"), seed=3)
    sampled = assert_same_samples(model, SAMPLED, segment_calls, shared_prompt=shared_prompt)
    assert 0 < int(sampled.finished.sum()) < len(sampled.finished)  # stopped and running rows both covered
    assert_same_samples(model, GREEDY, segment_calls, shared_prompt=shared_prompt)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_segmented_decode_in_every_decode_layout(mesh, layout, segment_calls):
    """4 prompts x 2 samples over 8 devices, FSDP-sharded weights, the shared prompt cache."""
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp", "tp")))
    whole = assert_same_samples(sharded, SAMPLED, segment_calls, batch_sharding, gather_weights=LAYOUTS[layout])
    assert whole.completion_ids.sharding.spec[0] == ("dp", "fsdp", "tp")
