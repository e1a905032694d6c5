"""Which log-probs the loss receives for which config (loss_inputs.LogpSources), and the one
function that fills the record: checked with stand-in scoring, no model."""

import numpy as np
import pytest

from grpo_core.config_io import load_config
from grpo_runner_gsm8k.training.loss_inputs import LogpSources, loss_inputs

SAMPLER, WEIGHTS, REFERENCE = "sampler log-probs", "rollout weights", "reference weights"


def sources(*overrides: str) -> LogpSources:
    cfg = load_config(None, list(overrides))
    return LogpSources.from_config(cfg.train, cfg.rollout, cfg.loss)


@pytest.mark.parametrize("overrides, old, reference, sampler", [
    ([], "none", False, False),  # one on-policy epoch: ratio exactly 1, nothing scored
    (["train.ppo_epochs=2"], "scored", False, False),
    (["train.ppo_epochs=2", "rollout.use_sampler_logps=true"], "sampler", False, False),
    (["rollout.use_sampler_logps=true"], "sampler", False, False),
    (["loss.beta=0.04"], "none", True, False),
    (["loss.mismatch_correction=truncate"], "none", False, True),
    (["train.ppo_epochs=3", "loss.beta=0.1", "loss.mismatch_correction=mask"], "scored", True, True),
])
def test_sources_follow_the_config(overrides, old, reference, sampler):
    got = sources(*overrides)
    assert (got.old, got.reference, got.sampler) == (old, reference, sampler)
    assert got.has_old == (old != "none")
    assert got.scores == (old == "scored" or reference)  # the plan's log-probs phase exists exactly then


def fill(got: LogpSources, keep=(1.0, 0.0, 1.0), finished=(True, True, False)):
    scored = []

    def score(weights):
        scored.append(weights)
        return f"scored with {weights}"

    record = loss_inputs(got, np.asarray(keep), np.asarray(finished), lambda: SAMPLER, score, WEIGHTS, REFERENCE)
    return record, scored


def test_one_on_policy_epoch_scores_nothing():
    record, scored = fill(sources())
    assert (record.old_logp, record.ref_logp, record.sampler_logp, scored) == (None, None, None, [])


def test_each_log_prob_comes_from_its_source_and_is_scored_once():
    record, scored = fill(sources("train.ppo_epochs=2", "loss.beta=0.04", "loss.mismatch_correction=truncate"))
    assert record.old_logp == f"scored with {WEIGHTS}" and record.ref_logp == f"scored with {REFERENCE}"
    assert record.sampler_logp == SAMPLER and scored == [WEIGHTS, REFERENCE]
    record, scored = fill(sources("rollout.use_sampler_logps=true"))
    assert (record.old_logp, record.ref_logp, record.sampler_logp, scored) == (SAMPLER, None, None, [])


def test_trained_rows_drop_truncated_completions_only_when_asked():
    record, _ = fill(sources())
    assert record.keep.dtype == np.float32 and record.keep.tolist() == [1.0, 0.0, 1.0]
    record, _ = fill(sources("loss.mask_truncated_completions=true"))
    assert record.keep.tolist() == [1.0, 0.0, 0.0]
