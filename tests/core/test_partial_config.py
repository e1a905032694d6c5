"""rollout.partial: off by default, budget filled in at load, inconsistent settings refused."""

import pytest

from grpo_core.config_io import config_to_yaml, load_config
from grpo_core.errors import ConfigError

ON = ["rollout.partial.enabled=true", "loss.mismatch_correction=truncate", "rollout.max_new_tokens=64"]


def test_off_by_default_and_the_budget_is_a_quarter_of_max_new_tokens():
    cfg = load_config(None, ["rollout.max_new_tokens=50"])
    assert cfg.rollout.partial.enabled is False and cfg.rollout.partial.max_staleness is None
    assert cfg.rollout.partial.budget == 13
    assert "partial:\n    enabled: false\n    budget: 13\n    max_staleness: null" in config_to_yaml(cfg)


def test_a_valid_partial_config_loads():
    cfg = load_config(None, [*ON, "rollout.partial.budget=16", "rollout.partial.max_staleness=3"])
    assert (cfg.rollout.partial.budget, cfg.rollout.partial.max_staleness) == (16, 3)
    assert load_config(None, [*ON, "rollout.partial.budget_quantile=0.75"]).rollout.partial.budget_quantile == 0.75
    assert [load_config(None, [*ON, f"rollout.partial.slots={s}"]).rollout.partial.slots
            for s in (128, "auto", "null")] == [128, "auto", None]


@pytest.mark.parametrize("overrides, message", [
    (["loss.mismatch_correction=none"], r"rollout.partial.enabled with loss.mismatch_correction = 'none'.*"
                                        r"set loss.mismatch_correction=truncate"),
    (["rollout.use_sampler_logps=true"], r"rollout.use_sampler_logps = true.*set rollout.use_sampler_logps=false"),
    (["loss.dynamic_sampling=true", "loss.dynamic_sampling_mode=refill"], r"set loss.dynamic_sampling_mode=mask"),
    (["rollout.partial.budget=65"], r"rollout.partial.budget = 65 is above rollout.max_new_tokens = 64"),
    (["rollout.partial.budget=16", "rollout.partial.max_staleness=2"],
     r"max_staleness = 2 is below 3: a row of 64 tokens spans 4 rounds of 16.*max_staleness >= 3"),
    (["rollout.partial.budget=0"], r"rollout.partial.budget"),
    (["rollout.partial.budget_quantile=0.5", "rollout.partial.max_staleness=5"],
     r"max_staleness with rollout.partial.budget_quantile.*set one of them to null"),
    (["rollout.partial.budget_quantile=1.5"], r"rollout.partial.budget_quantile"),
    (["rollout.partial.slots=100"], r"slots = 100 is not a multiple of the 64 rows of a step.*set it to 64 or 128"),
    (["rollout.partial.slots=32"], r"slots = 32 is not a multiple of the 64 rows.*set it to 64 \(or null\)"),
    (["rollout.partial.slots=auto", "rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"],
     r"slots = 'auto' with rollout.multi_turn.enabled.*set rollout.partial.slots=null"),
])
def test_inconsistent_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, [*ON, *overrides])
    assert "\n" not in str(error.value)
