"""A model with sliding-window layers (Gemma 3) is refused, in one line at config load, every decode
layout that would run without its window (grpo_runner_gsm8k.assembly.decode_layouts: kept caches
decoded by the model's forward); the layouts that honour it are accepted (partial rollouts on the
prompt table and multi-turn kept caches on the rollout's decode step among them)."""

import pytest

from grpo_core.errors import UserError
from grpo_runner_gsm8k.cli import main

GEMMA = ["model.architecture.model_type=gemma3_text", "model.architecture.sliding_window=4",
         "model.architecture.hidden_act=gelu_pytorch_tanh"]
MODEL_DECODE = "rollout.options={decode_attention: model}"
PARTIAL = ["rollout.partial.enabled=true", "loss.mismatch_correction=truncate"]
MULTI_TURN = ["model.tokenizer=char-tools", "task.options={digits: 1, operations: '+', use_chat_template: true}",
              "rollout.max_prompt_length=40", "model.architecture.max_position_embeddings=192",
              "rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"]
REFUSED = [
    ([MODEL_DECODE, *PARTIAL], "rollout.partial.kv_cache='auto' with decode_attention=model",
     "set rollout.options.decode_attention: rollout or rollout.partial.kv_cache: reprefill"),
    ([MODEL_DECODE, *MULTI_TURN], "rollout.multi_turn.kv_cache='auto' with decode_attention=model",
     "set rollout.options.decode_attention: rollout or rollout.multi_turn.kv_cache: reprefill"),
]
ACCEPTED = {"default": [], "shared_prompt": ["rollout.options={decode_attention: rollout, shared_prompt: true}"],
            "model_parallel": ["rollout.options={gather_weights: model_parallel}"],
            "head_parallel": ["rollout.options={gather_weights: head_parallel}"], "model_decode": [MODEL_DECODE],
            "partial": ["rollout.options={shared_prompt: false}", *PARTIAL],
            "partial_shared": ["rollout.options={shared_prompt: true}", *PARTIAL],
            "partial_reprefill": [MODEL_DECODE, *PARTIAL, "rollout.partial.kv_cache=reprefill"],
            "multi_turn_kept": [*MULTI_TURN, "rollout.multi_turn.kv_cache=kept"],
            "multi_turn_reprefill": [MODEL_DECODE, *MULTI_TURN, "rollout.multi_turn.kv_cache=reprefill"],
            "multi_turn_partial": [MODEL_DECODE, *MULTI_TURN, *PARTIAL]}


@pytest.mark.parametrize("overrides, what, fix", REFUSED, ids=["partial_model_decode", "multi_turn_model_decode"])
def test_windowed_model_refuses_layout_in_one_line(tiny_config_path, overrides, what, fix, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *GEMMA, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert what in err[0] and fix in err[0] and "'gemma3_text' has sliding-window layers" in err[0], err[0]
    assert "counts the window in slots" in err[0], err[0]


@pytest.mark.parametrize("layout", sorted(ACCEPTED))
def test_windowed_model_in_a_layout_with_the_window_is_accepted(tiny_config_path, layout, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *GEMMA, *ACCEPTED[layout]]) == 0
    assert "gemma3_text" in capsys.readouterr().out


def test_streamed_eval_of_a_windowed_model_on_the_models_decode_is_refused(tiny_config_path, tmp_path):
    """`eval --stream` slots continue on kept caches (rollout.partial.kv_cache, partial rollouts on or off)."""
    from grpo_runner_gsm8k.commands.evaluate import main as evaluate

    with pytest.raises(UserError, match=r"^--stream with rollout.partial.kv_cache='auto' with decode_attention=model: "
                                        r".*'gemma3_text' has sliding-window layers.*rollout.partial.kv_cache: reprefill$"):
        evaluate(["--config", tiny_config_path, f"logging.dir={tmp_path}", *GEMMA, MODEL_DECODE, "--stream"])
