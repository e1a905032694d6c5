"""Waste of a rollout: decode steps, tokens kept, slot utilisation, kept length distribution."""

import numpy as np

from grpo_core.rollout_records import DecodeTally, waste_metrics


def test_a_synchronous_rollout_pays_for_its_longest_row_on_every_row():
    lengths = np.array([1, 2, 3, 10])
    tally = DecodeTally()
    tally.add_synchronous(lengths)
    metrics = waste_metrics(tally, lengths)
    assert metrics["train-rollout/decode_steps"] == 10
    assert metrics["train-rollout/tokens_kept"] == 16
    assert metrics["train-rollout/slot_utilisation"] == 16 / 40
    assert metrics["train-rollout/length_max"] == 10
    assert metrics["train-rollout/length_p50"] == 2.5
    assert np.isclose(metrics["train-rollout/length_p90"], 7.9)


def test_rollouts_of_one_step_add_up_and_kept_tokens_are_only_the_kept_rows():
    tally = DecodeTally()
    tally.add_synchronous(np.array([4, 4]))
    tally.add(rows=2, steps=6, tokens=7)
    metrics = waste_metrics(tally, np.array([4, 3]), prefix="")
    assert metrics["decode_steps"] == 10
    assert metrics["slot_utilisation"] == (8 + 7) / (2 * 4 + 2 * 6)
    assert metrics["tokens_kept"] == 7


def test_nothing_decoded_is_zero_not_a_division_error():
    metrics = waste_metrics(DecodeTally(), np.array([], np.int32))
    assert metrics["train-rollout/slot_utilisation"] == 0.0 and metrics["train-rollout/length_max"] == 0
