"""A model with sliding-window layers (Gemma 3) is refused, in one line at config load, every decode
layout that would run without its window (grpo_runner_gsm8k.assembly.decode_layouts); the layouts
that honour it are accepted."""

import pytest

from grpo_runner_gsm8k.cli import main

GEMMA = ["model.architecture.model_type=gemma3_text", "model.architecture.sliding_window=4",
         "model.architecture.hidden_act=gelu_pytorch_tanh"]
MODEL_DECODE = "rollout.options={decode_attention: model}"
PARTIAL = ["rollout.partial.enabled=true", "loss.mismatch_correction=truncate"]
REFUSED = [
    (PARTIAL, "rollout.options.shared_prompt=true", "set rollout.options.shared_prompt: false"),
    ([MODEL_DECODE, *PARTIAL], "rollout.partial.kv_cache='auto' with decode_attention=model",
     "or rollout.partial.kv_cache: reprefill"),
    (["rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"],
     "rollout.multi_turn.kv_cache='auto'", "set rollout.multi_turn.kv_cache: reprefill"),
]
ACCEPTED = {"default": [], "shared_prompt": ["rollout.options={decode_attention: rollout, shared_prompt: true}"],
            "model_parallel": ["rollout.options={gather_weights: model_parallel}"],
            "head_parallel": ["rollout.options={gather_weights: head_parallel}"], "model_decode": [MODEL_DECODE],
            "partial": ["rollout.options={shared_prompt: false}", *PARTIAL],
            "partial_reprefill": [MODEL_DECODE, *PARTIAL, "rollout.partial.kv_cache=reprefill"]}


@pytest.mark.parametrize("overrides, what, fix", REFUSED, ids=["partial_shared", "partial_model_decode", "multi_turn"])
def test_windowed_model_refuses_layout_in_one_line(tiny_config_path, overrides, what, fix, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *GEMMA, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert what in err[0] and fix in err[0] and "'gemma3_text' has sliding-window layers" in err[0], err[0]


@pytest.mark.parametrize("layout", sorted(ACCEPTED))
def test_windowed_model_in_a_layout_with_the_window_is_accepted(tiny_config_path, layout, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *GEMMA, *ACCEPTED[layout]]) == 0
    assert "gemma3_text" in capsys.readouterr().out
