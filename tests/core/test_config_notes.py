"""Config warnings and notes come once, when the config loads (grpo_core.config_notes)."""

import warnings

import pytest

from grpo_core.config_io import load_config
from grpo_core.config_notes import PrecisionWarning


def test_a_correction_with_nothing_to_correct_is_noted_once_at_load(capsys):
    load_config(None, ["loss.mismatch_correction=truncate", "rollout.use_sampler_logps=true"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "has nothing to correct" in line]
    assert len(notes) == 1 and "set rollout.use_sampler_logps=false" in notes[0]


def test_bfloat16_masters_warn_at_load():
    with pytest.warns(PrecisionWarning, match=r"model.param_dtype=bfloat16: .* train.lr=3e-06"):
        load_config(None, ["model.param_dtype=bfloat16", "model.dtype=bfloat16", "train.lr=3e-6"])


def test_the_defaults_load_without_notes(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        load_config(None)
    assert "note:" not in capsys.readouterr().err
