"""Partial-rollout rounds with each live group's prompt stored once in a prompt table
(grpo_rollout.kept_shared): the same pool, run on the shared table and on one unshared cache
row per slot (kept, or each slot's prefix re-prefilled), samples the same tokens with log-probs
within 1e-5 (f32; the two differ only in the order of the softmax sums), rows carried across
rounds and steps, admitted mid-way and re-admitted after a restore."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.contracts import Policy
from grpo_core.testing import with_random_adapters
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams
from grpo_rollout.kept_shared import PromptTable, table_size
from grpo_rollout.partial import PartialPool

STOP_IDS = tuple(range(100, 108))  # about one token in sixteen stops a row
SLOTS, N = 8, 2


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request):
    return init_from_config(QwenConfig.tiny(request.param, tie_word_embeddings=request.param == "qwen3"), seed=3)


def run_pool(model, shared: bool, kv_cache: str, table: int, greedy: bool = False, steps: int = 4, restore_at: int = 2,
             batch_sharding=None, gather_weights=False):
    """(groups trained, (cached, groups) of every round) of a pool whose rounds run on a prompt table
    (shared) or on one cache row per slot."""
    options = JaxRolloutOptions(prompt_buckets=(4, 8, 16, 32), shared_prompt=shared, gather_weights=gather_weights)
    rollout = JaxRollout(options)
    rollout.load_weights(Policy.of(model))
    rounds = []

    def generate(prefixes, key, budget, cached, groups):
        rounds.append((list(cached), list(groups.ids)))
        sampling = SamplingParams(max_new_tokens=budget, n=1, temperature=0.7, greedy=greedy, stop_token_ids=STOP_IDS)
        if kv_cache == "reprefill" and not shared:  # each slot's whole prefix prefilled (grpo_rollout.backend.generate)
            return rollout.generate(prefixes, key, sampling, batch_sharding=batch_sharding)
        if kv_cache == "reprefill":  # as the runner re-prefills on the table: every slot admitted, nothing kept
            result = rollout.generate_round(prefixes, [False] * len(prefixes), key, sampling, groups=groups,
                                            batch_sharding=batch_sharding)
            rollout.release_kept_cache()
            return result
        return rollout.generate_round(prefixes, cached, key, sampling, groups=groups, batch_sharding=batch_sharding)

    rng = np.random.default_rng(0)
    draw = lambda: [({"id": "p"}, rng.integers(1, 99, size=int(rng.integers(1, 12))).tolist())]  # noqa: E731
    pool = PartialPool(slots=SLOTS, n=N, budget=3, max_new_tokens=12, kv_cache=kv_cache, prompt_table=table)
    groups = []
    for version in range(steps):
        if version == restore_at:
            pool.restore(json.loads(json.dumps(pool.state())))
        groups += pool.step(generate, draw, jax.random.key(version), version, max_groups=2)[0]
    return groups, rounds


def assert_same_rollouts(shared_groups, plain_groups):
    assert [g.prompt for g in shared_groups] == [g.prompt for g in plain_groups]
    for shared, plain in zip(shared_groups, plain_groups):
        for a, b in zip(shared.rows, plain.rows):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logps, b.logps, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_cache", ["across_steps", "within_step", "reprefill"])
def test_the_prompt_table_samples_what_one_cache_row_per_slot_samples(model, kv_cache):
    shared, rounds = run_pool(model, True, kv_cache, table_size(SLOTS, N))
    plain, _ = run_pool(model, False, kv_cache, table_size(SLOTS, N))
    assert_same_rollouts(shared, plain)
    assert kv_cache == "reprefill" or any(any(c) and not all(c) for c, _ in rounds)  # slots kept and admitted
    assert any(len(set(ids)) < len(ids) for _, ids in rounds)  # a group with several rows in the slots
    assert any(len(row.tokens) > 3 for g in shared for row in g.rows)  # rows carried across rounds


def test_the_prompt_table_with_per_token_lora_adapters():
    """Adapters on every projection of qwen3 (q/k norms too), rows carried across rounds and steps."""
    lora = with_random_adapters(init_from_config(QwenConfig.tiny("qwen3"), seed=4))
    shared, _ = run_pool(lora, True, "across_steps", table_size(SLOTS, N))
    assert_same_rollouts(shared, run_pool(lora, False, "across_steps", table_size(SLOTS, N))[0])


def test_greedy_rows_wait_for_a_table_slot_and_sample_the_same_tokens(model):
    shared, rounds = run_pool(model, True, "across_steps", table=3, greedy=True, steps=3)
    plain, _ = run_pool(model, False, "across_steps", table=3, greedy=True, steps=3)
    assert_same_rollouts(shared, plain)
    assert any(None in ids for _, ids in rounds)  # a new group's row waited for a table slot
    assert all(len({g for g in ids if g is not None}) <= 3 for _, ids in rounds)


def test_the_table_frees_gone_groups_and_ranks_each_groups_rows():
    table = PromptTable(2)
    assert table.assign(["a", "b", "a", None]) == [("a", 0), ("b", 1)]
    assert table.assign(["c", "b", None, "c"]) == [("c", 0)]  # a left: its slot goes to c
    group, member = table.rows(["c", "b", None, "c"])
    assert group.tolist() == [0, 1, 2, 0] and member.tolist() == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="3 groups, more than the prompt table's 2"):
        table.assign(["a", "b", "c"])


LAYOUTS = {"gathered": True, "sharded": False, "model_parallel": "model_parallel"}
WIDE = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)


@pytest.fixture(scope="module")
def unsharded_rollouts():
    """The 8 slots' rollouts on one device and one cache row per slot, to compare the layouts with."""
    return run_pool(init_from_config(WIDE, seed=3), False, "across_steps", table_size(SLOTS, N), steps=3)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_prompt_table_in_every_decode_layout(mesh, unsharded_rollouts, layout):
    """8 slots over 8 devices: the table (any group's rows on any device) is replicated beside them."""
    sharded = shard_model(init_from_config(WIDE, seed=3), mesh, DEFAULT_RULES)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp", "tp")))
    shared, _ = run_pool(sharded, True, "across_steps", table_size(SLOTS, N), steps=3, batch_sharding=batch_sharding,
                         gather_weights=LAYOUTS[layout])
    assert_same_rollouts(shared, unsharded_rollouts)
