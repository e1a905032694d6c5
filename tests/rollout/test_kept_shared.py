"""Partial-rollout rounds with each live group's prompt stored once in a prompt table
(grpo_rollout.kept_shared): the same pool, run on the shared table and on one unshared cache
row per slot (kept, or each slot's prefix re-prefilled), samples the same tokens with log-probs
within 1e-5 (f32; the two differ only in the order of the softmax sums), rows carried across
rounds and steps, admitted mid-way and re-admitted after a restore."""

import json
from dataclasses import dataclass

import jax
import jax.numpy as jnp
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
from grpo_rollout.prompts import left_pad

STOP_IDS = tuple(range(100, 108))  # about one token in sixteen stops a row
SLOTS, N = 8, 2
TEMPERATURE = 0.7


@dataclass(frozen=True)
class Rows:
    prompt: tuple[int, int]  # prompt lengths drawn from [low, high)
    new_tokens: int
    budget: int  # tokens per round
    buckets: tuple[int, ...] = (4, 8, 16, 32)  # prompt_buckets: the fewer, the fewer programs compile


ROWS = Rows(prompt=(1, 12), new_tokens=12, budget=3)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request):
    return init_from_config(QwenConfig.tiny(request.param, tie_word_embeddings=request.param == "qwen3"), seed=3)


def run_pool(model, shared: bool, kv_cache: str, table: int, greedy: bool = False, steps: int = 4, restore_at: int = 2,
             batch_sharding=None, gather_weights=False, rows=ROWS):
    """(groups trained, (cached, groups) of every round) of a pool whose rounds run on a prompt table
    (shared) or on one cache row per slot."""
    options = JaxRolloutOptions(prompt_buckets=rows.buckets, shared_prompt=shared, gather_weights=gather_weights)
    rollout = JaxRollout(options)
    rollout.load_weights(Policy.of(model))
    rounds = []

    def generate(prefixes, key, budget, cached, groups):
        rounds.append((list(cached), list(groups.ids)))
        sampling = SamplingParams(max_new_tokens=budget, n=1, temperature=TEMPERATURE, greedy=greedy,
                                  stop_token_ids=STOP_IDS)
        if kv_cache == "reprefill" and not shared:  # each slot's whole prefix prefilled (grpo_rollout.backend.generate)
            return rollout.generate(prefixes, key, sampling, batch_sharding=batch_sharding)
        if kv_cache == "reprefill":  # as the runner re-prefills on the table: every slot admitted, nothing kept
            result = rollout.generate_round(prefixes, [False] * len(prefixes), key, sampling, groups=groups,
                                            batch_sharding=batch_sharding)
            rollout.release_kept_cache()
            return result
        return rollout.generate_round(prefixes, cached, key, sampling, groups=groups, batch_sharding=batch_sharding)

    rng = np.random.default_rng(0)
    draw = lambda: [({"id": "p"}, rng.integers(1, 99, size=int(rng.integers(*rows.prompt))).tolist())]  # noqa: E731
    pool = PartialPool(slots=SLOTS, n=N, budget=rows.budget, max_new_tokens=rows.new_tokens, kv_cache=kv_cache,
                       prompt_table=table)
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


# Gemma 3 with an 8-token window on rows of 16-23 prompt tokens and up to 40 new ones, in rounds of 7:
# every query reads past the window, and rows resume at different depths on the table.
LONG = Rows(prompt=(16, 24), new_tokens=40, budget=7, buckets=(32, 64))


def gemma_config(window: int) -> QwenConfig:
    return QwenConfig.tiny("gemma3_text", family_options=(("layer_types", ("sliding_attention", "full_attention")),
                                                          ("sliding_window", window), ("rope_local_base_freq", 100.0)))


def full_forward_logps(model, groups, greedy: bool = False):
    """Per row, the cache-free forward's log-probs of its tokens (log_softmax(logits / T), or the argmax
    tokens where greedy) given everything before each."""
    rows = [(g.prompt, row.tokens) for g in groups for row in g.rows]
    ids, mask = left_pad([p + c for p, c in rows], 0, (64,))
    logits = model.logits(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))[:, :-1]
    if greedy:
        return [np.asarray(jnp.argmax(logits, -1))[i, ids.shape[1] - 1 - len(c):] for i, (_, c) in enumerate(rows)]
    logp = jax.nn.log_softmax(logits / TEMPERATURE, axis=-1)
    taken = np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], axis=-1)[..., 0])
    return [taken[i, taken.shape[1] - len(c):] for i, (_, c) in enumerate(rows)]


@pytest.fixture(scope="module")
def gemma_rollouts():
    """(model, rollouts on the table, on one kept cache row per slot) of the sliding-window model."""
    model = init_from_config(gemma_config(8), seed=3)
    shared, rounds = run_pool(model, True, "across_steps", table_size(SLOTS, N), steps=3, rows=LONG)
    assert any(any(c) and not all(c) for c, _ in rounds)  # slots kept beside slots admitted
    return model, shared, run_pool(model, False, "across_steps", table_size(SLOTS, N), steps=3, rows=LONG)[0]


def test_the_sliding_window_on_the_table_samples_what_one_cache_row_per_slot_samples(gemma_rollouts):
    _, shared, plain = gemma_rollouts
    assert_same_rollouts(shared, plain)
    assert max(len(row.tokens) for g in shared for row in g.rows) > 2 * LONG.budget  # resumed over rounds


def test_the_sliding_window_on_the_table_samples_from_the_full_forward(gemma_rollouts):
    """The cache-free forward's log-probs, which the window changes on these rows by far more than 1e-5."""
    model, shared, _ = gemma_rollouts
    logps = [row.logps for g in shared for row in g.rows]
    gaps = [np.max(np.abs(a - b)) for a, b in zip(logps, full_forward_logps(model, shared))]
    assert max(gaps) < 1e-5, max(gaps)
    wide = init_from_config(gemma_config(10_000), seed=3)  # the same weights, a window longer than any row
    unwindowed = [np.max(np.abs(a - b)) for a, b in zip(logps, full_forward_logps(wide, shared))]
    assert max(unwindowed) > 1e-2, max(unwindowed)


def test_greedy_rows_on_the_table_take_the_full_forwards_argmax():
    model = init_from_config(gemma_config(8), seed=5)
    shared = run_pool(model, True, "across_steps", table_size(SLOTS, N), greedy=True, steps=2, rows=LONG)[0]
    for tokens, expected in zip([row.tokens for g in shared for row in g.rows], full_forward_logps(model, shared, True)):
        assert list(tokens) == expected.tolist()
