"""A model with sliding-window layers (Gemma 3) is refused, in one line at config load, every decode
layout that would run without its window (grpo_runner_gsm8k.assembly.decode_layouts)."""

import pytest

from grpo_runner_gsm8k.cli import main

GEMMA = ["model.architecture.model_type=gemma3_text", "model.architecture.sliding_window=4",
         "model.architecture.hidden_act=gelu_pytorch_tanh"]
MODEL_DECODE = "rollout.options={decode_attention: model}"
REFUSED = [
    ([], "rollout.options.decode_attention='rollout'", "set rollout.options.decode_attention: model"),
    (["rollout.options={decode_attention: rollout, shared_prompt: true}"], "decode_attention='rollout'",
     "shared-prompt, model-parallel and head-parallel layouts"),
    ([MODEL_DECODE, "rollout.partial.enabled=true", "loss.mismatch_correction=truncate"], "rollout.partial.enabled=true",
     "set rollout.partial.enabled: false"),
    ([MODEL_DECODE, "rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"],
     "rollout.multi_turn.kv_cache='auto'", "set rollout.multi_turn.kv_cache: reprefill"),
]


@pytest.mark.parametrize("overrides, what, fix", REFUSED, ids=["default", "shared_prompt", "partial", "multi_turn"])
def test_windowed_model_refuses_layout_in_one_line(tiny_config_path, overrides, what, fix, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *GEMMA, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert what in err[0] and fix in err[0] and "'gemma3_text' has sliding-window layers" in err[0], err[0]


def test_windowed_model_with_the_model_decode_is_accepted(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *GEMMA, MODEL_DECODE]) == 0
    assert "gemma3_text" in capsys.readouterr().out
