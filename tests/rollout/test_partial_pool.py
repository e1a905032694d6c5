"""The pool of partial rollouts: slots stay full, groups leave complete, every prompt is
trained exactly once, stale rows restart, and the pool survives a JSON round trip."""

import json

import jax
import numpy as np
import pytest

from grpo_core.rollout_records import DecodeTally, RolloutResult
from grpo_rollout.partial import DONE, RUNNING, PartialPool, groups_result

N, SLOTS, BUDGET, MAX_NEW, STOP = 4, 8, 3, 10, 99


def fake_generate(stop_p=0.15):
    """Row i draws up to the pool's `budget` tokens (i, step) with a stop token of probability
    stop_p per step, seeded by the key; log-probs encode the token's position."""
    calls = []

    def generate(prefixes, key, budget, cached):
        assert not any(cached)  # a pool that re-prefills never marks a slot cached
        calls.append([list(p) for p in prefixes])
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
        rows = len(prefixes)
        ids = np.zeros((rows, budget), np.int32)
        lengths = np.full(rows, budget, np.int32)
        finished = np.zeros(rows, bool)
        for i in range(rows):
            for t in range(budget):
                ids[i, t] = STOP if rng.random() < stop_p else 1 + (len(prefixes[i]) + t) % 50
                if ids[i, t] == STOP:
                    lengths[i], finished[i] = t + 1, True
                    break
        logps = -np.arange(1, budget + 1, dtype=np.float32)[None].repeat(rows, 0) / 7
        mask = (np.arange(budget)[None] < lengths[:, None]).astype(np.int32)
        return RolloutResult(ids, mask, ids, mask, lengths, logps * mask, finished, rows, 1)

    return generate, calls


def drawer():
    drawn = []

    def draw():
        drawn.append(len(drawn))
        return [({"question": f"q{drawn[-1]}", "answer": "0", "id": str(drawn[-1])}, [200 + drawn[-1]] * (1 + drawn[-1] % 3))]

    return draw, drawn


def run_steps(pool, steps, generate, draw, first_version=0):
    taken = []
    for version in range(first_version, first_version + steps):
        groups, _ = pool.step(generate, draw, jax.random.key(version), version, max_groups=2)
        taken.append(groups)
    return taken


def test_slots_stay_full_and_only_complete_groups_leave():
    generate, calls = fake_generate()
    draw, drawn = drawer()
    pool = PartialPool(SLOTS, N, BUDGET, MAX_NEW)
    taken = run_steps(pool, 12, generate, draw)
    assert all(len(prefixes) == SLOTS for prefixes in calls)
    for groups in taken:
        assert len(groups) == 2  # as many groups as a synchronous step
        for group in groups:
            assert len(group.rows) == N and all(row.state == DONE for row in group.rows)
            for row in group.rows:
                assert 1 <= len(row.tokens) <= MAX_NEW and len(row.logps) == len(row.versions) == len(row.tokens)
                assert row.finished == (row.tokens[-1] == STOP)
                assert row.finished or len(row.tokens) == MAX_NEW


def test_every_drawn_prompt_is_trained_once_or_still_in_the_pool():
    generate, _ = fake_generate()
    draw, drawn = drawer()
    pool = PartialPool(SLOTS, N, BUDGET, MAX_NEW)
    trained = [g.example["id"] for groups in run_steps(pool, 15, generate, draw) for g in groups]
    waiting = [g.example["id"] for g in pool.groups.values()]
    assert len(set(trained)) == len(trained)
    assert sorted(trained + waiting, key=int) == [str(i) for i in drawn]


def test_carried_rows_continue_from_their_tokens_and_record_the_version_of_each():
    generate, calls = fake_generate(stop_p=0.0)  # nothing stops: rows run to MAX_NEW over 4 rounds
    draw, _ = drawer()
    pool = PartialPool(N, N, BUDGET, MAX_NEW)
    (group,), stats = pool.step(generate, draw, jax.random.key(0), 7, max_groups=1)
    assert stats.rounds == 4 and [len(c[0]) for c in calls] == [1, 4, 7, 10]  # prompt + tokens so far
    # 4 slots x 3 decode steps x 4 rounds paid for; 3 + 3 + 3 + 1 tokens kept per row
    assert stats.decode == DecodeTally(decode_steps=12, slot_steps=48, sampled_tokens=40)
    row = group.rows[0]
    assert len(row.tokens) == MAX_NEW and not row.finished and set(row.versions) == {7}
    assert calls[-1][0] == group.prompt + row.tokens[:9]


def test_rows_older_than_max_staleness_restart_from_their_prompt():
    generate, calls = fake_generate(stop_p=0.0)
    draw, _ = drawer()
    pool = PartialPool(N, N, 1, 3, max_staleness=1)
    pool.fill(draw, max_groups=1)
    for version in range(3):  # one token per version: the rows' first token is 2 versions old at version 2
        restarted = pool.restart_stale(version)
        pool.decode_round(generate, jax.random.key(version), version)
    assert restarted == N
    assert all(row.versions == [2] and row.restarts == 1 for row in pool.groups[0].rows)


def test_the_pool_continues_identically_after_a_json_round_trip():
    generate, _ = fake_generate()
    draw_a, drawn_a = drawer()
    original = PartialPool(SLOTS, N, BUDGET, MAX_NEW)
    run_steps(original, 5, generate, draw_a)
    copy = PartialPool(SLOTS, N, BUDGET, MAX_NEW)
    copy.restore(json.loads(json.dumps(original.state())))
    assert copy.state() == original.state()
    draw_b, drawn_b = drawer()
    for _ in range(len(drawn_a)):  # the copy's task is at the same data position
        draw_b()
    after_a = run_steps(original, 4, generate, draw_a, first_version=5)
    after_b = run_steps(copy, 4, generate, draw_b, first_version=5)
    as_records = lambda taken: [[(g.example, [r.tokens for r in g.rows], [r.logps for r in g.rows]) for g in gs]
                                for gs in taken]
    assert as_records(after_a) == as_records(after_b)


def test_a_pool_of_other_slots_refuses_the_saved_rows_naming_the_count_to_resume_with():
    generate, _ = fake_generate()
    draw, _ = drawer()
    saved = PartialPool(2 * SLOTS, N, BUDGET, MAX_NEW)
    run_steps(saved, 2, generate, draw)
    with pytest.raises(ValueError, match=f"has {2 * SLOTS} slots, this run {SLOTS}; resume with "
                                         f"rollout.partial.slots={2 * SLOTS}"):
        PartialPool(SLOTS, N, BUDGET, MAX_NEW).restore(saved.state())


def test_a_quantile_budget_follows_the_trained_lengths_in_powers_of_two():
    generate, calls = fake_generate(stop_p=0.3)
    draw, _ = drawer()
    pool = PartialPool(SLOTS, N, 8, 64, budget_quantile=0.5)
    assert pool.round_budget() == 8  # nothing trained yet: the cap
    widths = []
    for version in range(12):
        pool.step(generate, draw, jax.random.key(version), version, max_groups=2)
        lengths = np.asarray(pool.recent_lengths)
        assert len(lengths) == min(SLOTS, 2 * N * (version + 1))  # the last `slots` trained rows
        median = float(np.quantile(lengths, 0.5))
        assert pool.round_budget() == min(8, 1 << max(0, int(np.ceil(np.log2(max(median, 1))))))
        widths.append(pool.round_budget())
    assert min(widths) < 8 and set(widths) <= {1, 2, 4, 8}
    copy = PartialPool(SLOTS, N, 8, 64, budget_quantile=0.5)
    copy.restore(json.loads(json.dumps(pool.state())))
    assert list(copy.recent_lengths) == list(pool.recent_lengths) and copy.round_budget() == pool.round_budget()


def test_a_pool_of_another_size_is_refused():
    with pytest.raises(ValueError, match="8 slots, this run 4"):
        PartialPool(4, N, BUDGET, MAX_NEW).restore(PartialPool(8, N, BUDGET, MAX_NEW).state())


def test_groups_result_lays_out_groups_for_the_update():
    generate, _ = fake_generate()
    draw, _ = drawer()
    pool = PartialPool(SLOTS, N, BUDGET, MAX_NEW)
    groups = [g for gs in run_steps(pool, 4, generate, draw) for g in gs]
    result, versions = groups_result(groups, MAX_NEW, pad_id=0)
    assert result.num_prompts == len(groups) and result.completion_ids.shape == (len(groups) * N, MAX_NEW)
    row = groups[-1].rows[-1]
    np.testing.assert_array_equal(result.completion_ids[-1, :len(row.tokens)], row.tokens)
    np.testing.assert_array_equal(result.sampler_logps[-1, :len(row.tokens)], np.float32(row.logps))
    assert result.lengths[-1] == len(row.tokens) == result.completion_mask[-1].sum() == (versions[-1] >= 0).sum()
    assert result.prompt_mask[-1].sum() == len(groups[-1].prompt)


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_more_slots_run_fewer_rounds_per_step_as_the_projection_counts(multiple):
    """Rows of MAX_NEW tokens hold their slot ceil(10 / 3) = 4 rounds: a step that trains 2 groups of
    N rows runs 2 N x 4 / slots rounds on average (plan.projection.PartialRounds); a step whose groups
    are already complete with no row running decodes nothing, and the pool never piles them up."""
    generate, _ = fake_generate(stop_p=0.0)
    draw, drawn = drawer()
    pool = PartialPool(2 * N * multiple, N, BUDGET, MAX_NEW)
    rounds = []
    for version in range(12):
        running = pool.running
        groups, stats = pool.step(generate, draw, jax.random.key(version), version, max_groups=2)
        assert len(groups) == 2 and all(group.complete for group in groups)
        assert stats.rounds or (not running and not pool.running)
        assert pool.complete_groups <= 2 * multiple and len(pool.groups) <= 4 * multiple
        rounds.append(stats.rounds)
    assert sum(rounds) / len(rounds) == 4 / multiple
    assert (0 in rounds) == (multiple > 1)
    trained = 2 * len(rounds)
    assert len(drawn) - len(pool.groups) == trained  # every drawn prompt trained once or still waiting


def test_a_step_with_its_groups_complete_still_decodes_its_running_rows():
    """Short and long rows beside each other: whenever a row is running at a step's start the step
    runs a round, so a running row ages at most one version per round (max_staleness holds), and
    complete groups do not pile up (a free slot draws no prompt while a step's groups wait)."""
    generate, _ = fake_generate(stop_p=0.3)
    draw, _ = drawer()
    pool = PartialPool(4 * SLOTS, N, BUDGET, MAX_NEW)
    for version in range(20):
        running = pool.running
        _, stats = pool.step(generate, draw, jax.random.key(version), version, max_groups=2)
        assert stats.rounds >= running
        assert pool.complete_groups <= 2 * (4 * SLOTS // N)  # no new prompt drawn while a step's groups wait
        running_rows = [pool.row(o) for o in pool.slots if o is not None and pool.row(o).state == RUNNING]
        for row in running_rows:  # BUDGET tokens per round, a round or more per version
            assert version - row.versions[0] <= len(row.tokens) // BUDGET - 1
