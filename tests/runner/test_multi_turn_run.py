"""One training step of the tiny config with rollout.multi_turn on and the calculator offered
(the character tokenizer with Qwen's tool tokens, `model.tokenizer=char-tools`). A random tiny
model hardly ever writes a call, so the first turn of the first row is replaced by a scripted
call; everything after it (the calculator, the appended tool turn, the second turn decoded
by the real backend, the update) runs as in a run."""

import math

import numpy as np
import pytest

from grpo_core.registry import default_registry
from grpo_core.tokenizer import CHATML_TEMPLATE, TOOL_CALL_TOKENS, build_char_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
MULTI_TURN = ["model.tokenizer=char-tools", "task.options={digits: 1, operations: '+', use_chat_template: true}",
              "rollout.max_prompt_length=40", "rollout.max_new_tokens=8", "rollout.multi_turn.enabled=true",
              "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_total_tokens=112",
              "rollout.multi_turn.max_turns=3", "model.architecture.max_position_embeddings=192",
              "loss.entropy_coef=0.01",
              # the scripted call replaces sampled tokens, which a kept cache would not hold: re-prefill
              "rollout.multi_turn.kv_cache=reprefill"]


class FirstRowCalls:
    """The run's backend, except that row 0 of the first turn samples `CALL` (log-prob -1 each)."""

    def __init__(self, backend, tokenizer):
        self.backend, self.call = backend, tokenizer.encode(CALL, add_special_tokens=False)
        self.turns = 0

    def generate(self, prompts, key, sampling, **kwargs):
        result = self.backend.generate(prompts, key, sampling, **kwargs)
        self.turns += 1
        if self.turns > 1:
            return result
        width = max(result.completion_ids.shape[1], len(self.call))
        ids = np.zeros((len(prompts), width), np.int32)
        ids[:, :result.completion_ids.shape[1]] = np.asarray(result.completion_ids)
        logps = np.zeros((len(prompts), width), np.float32)
        logps[:, :result.completion_ids.shape[1]] = np.asarray(result.sampler_logps)
        lengths, finished = np.asarray(result.lengths).copy(), np.asarray(result.finished).copy()
        ids[0, :len(self.call)], logps[0, :len(self.call)] = self.call, -1.0
        lengths[0], finished[0] = len(self.call), True
        return result.replace(completion_ids=ids, sampler_logps=logps, lengths=lengths, finished=finished)


# LoRA: the rollout decodes with adapters and the reference (beta > 0) is the base.
VARIANTS = {"full": [], "lora": ["model.lora.rank=4", "model.lora.alpha=8", "loss.beta=0.05"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_step_with_the_calculator(variant, tiny_config, small_run):
    from grpo_runner_gsm8k.loop import Trainer, build_run

    registry = default_registry()
    cfg = tiny_config(*small_run(1), *MULTI_TURN, *VARIANTS[variant], registry=registry)
    trainer = Trainer(build_run(cfg, registry))
    turns = trainer.sampler.turns
    turns.backend = FirstRowCalls(turns.backend, trainer.built.inputs.tokenizer)
    metrics = trainer.run()
    assert trainer.state.step == 1
    assert metrics["train-tools/calls"] >= 1 and metrics["train-tools/errors"] == 0
    assert metrics["train-tools/turns_max"] >= 2 and metrics["train-tools/masked_tokens"] > 0
    assert metrics["train-tools/seconds"] > 0
    assert math.isfinite(metrics["train-other/loss"]) and metrics["train-other/update_ratio"] > 0


# ChatML that lists the offered tools in a system turn, as Qwen's template does (longer).
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') | "
                  "map(attribute='name') | join(', ')) + '<|im_end|>\\n' }}{%- endif %}" + CHATML_TEMPLATE)


def test_prompts_offer_the_tools_and_are_checked_with_them_at_start(tiny_config, small_run, tmp_path):
    from grpo_core.errors import UserError
    from grpo_runner_gsm8k.loop import Trainer, build_run

    tokenizer = build_char_tokenizer(extra_special_tokens=TOOL_CALL_TOKENS)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    registry = default_registry()
    overrides = [*small_run(1), *MULTI_TURN, f"model.tokenizer={tmp_path / 'tokenizer'}"]
    trainer = Trainer(build_run(tiny_config(*overrides, "rollout.max_prompt_length=64", registry=registry), registry))
    examples = trainer.built.inputs.task.train_batch(2)
    prompts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in trainer.sampler.prompt_ids(examples)]
    assert all(p.startswith("<|im_start|>system\nTools: calculator<|im_end|>") for p in prompts)
    trainer.ops.lock.release()  # the same run directory is built again below
    with pytest.raises(UserError, match=r"tokens with the tools offered, more than rollout.max_prompt_length=40"):
        Trainer(build_run(tiny_config(*overrides, registry=registry), registry))


def test_refill_rolls_further_groups_out_turn_by_turn(tiny_config, small_run):
    """loss.dynamic_sampling_mode: refill draws further prompts through the same multi-turn
    rollout; the picked rows keep their loss masks (0 on tool-turn tokens) and per-turn
    information, and the tool metrics count every rollout of the step."""
    from grpo_runner_gsm8k.loop import Trainer, build_run
    from grpo_runner_gsm8k.samplers.refill import RefillSampler

    registry = default_registry()
    refill = ["loss.dynamic_sampling=true", "loss.dynamic_sampling_mode=refill", "loss.max_extra_rollouts=1"]
    trainer = Trainer(build_run(tiny_config(*small_run(1), *MULTI_TURN, *refill, registry=registry), registry))
    assert isinstance(trainer.sampler, RefillSampler)
    turns = trainer.sampler.rollouts.turns
    turns.backend = FirstRowCalls(turns.backend, trainer.built.inputs.tokenizer)
    sampled = []
    sample = trainer.sampler.sample
    trainer.sampler.sample = lambda *args: sampled.append(sample(*args)) or sampled[-1]
    metrics = trainer.run()
    # a random model's groups all score 0: the extra rollout is made, 4 + 4 prompts drawn
    assert metrics["train-other/refill_extra_rollouts"] == 1 and metrics["train-other/refill_prompts_consumed"] == 8
    assert metrics["train-tools/calls"] >= 1 and metrics["train-tools/turns_max"] >= 2
    (batch, _, _), = sampled
    result, token_turn = batch.result, batch.scores.episodes["token_turn"]
    assert result.loss_mask is not None and token_turn.shape == result.loss_mask.shape == (16, 112)
    assert np.array_equal(np.asarray(result.loss_mask) == 1, token_turn >= 0)  # sampled tokens only
    assert ((np.asarray(result.completion_mask) == 1) & (token_turn < 0)).any()  # the called row's tool turn
    assert math.isfinite(metrics["train-other/loss"])
