"""The eval of a multi-turn run rolls out turn by turn with the run's tools (the tiny config with
the calculator, `model.tokenizer=char-tools`). A random tiny model hardly ever writes a call, so
in the eval's first turn the first row writes a scripted calculator call and, after the tool
turn, a scripted final answer; every other row and turn is decoded by the real backend."""

import json

import jax
import numpy as np
import pytest

from grpo_core.config_io import load_config
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
ANSWER = "13<|im_end|>"  # the right answer to the first test question, 5+8=
MULTI_TURN = ["model.tokenizer=char-tools", "task.options={digits: 1, operations: '+', use_chat_template: true}",
              "rollout.max_prompt_length=40", "rollout.max_new_tokens=8", "rollout.multi_turn.enabled=true",
              "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_total_tokens=112",
              "rollout.multi_turn.max_turns=3", "model.architecture.max_position_embeddings=192",
              # the scripted turns replace sampled tokens, which a kept cache would not hold: re-prefill
              "rollout.multi_turn.kv_cache=reprefill"]
# Two test questions, greedy; a task without the chat template beside the training task.
EVAL = ["eval.every_steps=1", "eval.num_questions=2",
        "eval.tasks={arithmetic: {digits: 1, operations: '+', use_chat_template: false}}"]


class ScriptedFirstRow:
    """The backend, except that in its i-th `generate` row 0 samples `texts[i]` (log-prob -1 a
    token, ending on a stop token) while there are texts; `restart()` starts the script again."""

    def __init__(self, backend, tokenizer, texts):
        self.backend = backend
        self.scripts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        self.calls = 0

    def restart(self):
        self.calls = 0

    def generate(self, prompts, key, sampling, **kwargs):
        result = self.backend.generate(prompts, key, sampling, **kwargs)
        self.calls += 1
        if self.calls > len(self.scripts):
            return result
        script, sampled = self.scripts[self.calls - 1], np.asarray(result.completion_ids)
        width = max(sampled.shape[1], len(script))
        ids, logps = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), np.float32)
        ids[:, :sampled.shape[1]], logps[:, :sampled.shape[1]] = sampled, np.asarray(result.sampler_logps)
        lengths, finished = np.asarray(result.lengths).copy(), np.asarray(result.finished).copy()
        ids[0, :len(script)], logps[0, :len(script)] = script, -1.0
        lengths[0], finished[0] = len(script), True
        return result.replace(completion_ids=ids, sampler_logps=logps, lengths=lengths, finished=finished)


def training_stream(trainer) -> dict:
    """What training draws from: its key, its data position, its tool runner's and sampler's work."""
    return {"key": np.asarray(jax.random.key_data(trainer.state.key)).tolist(),
            "data": trainer.built.inputs.task.state(), "calls": trainer.sampler.runner.stats.calls,
            "rows": len(trainer.sampler.step_rows), "step": trainer.state.step}


@pytest.fixture(scope="module")
def evaluated(tiny_config_path, small_run, tmp_path_factory):
    """A built multi-turn run evaluated as training evaluates (`Trainer.evaluate`) and as
    `grpo-run eval` evaluates a task (`evaluate_task`), each with the scripted first row."""
    from grpo_runner_gsm8k.commands.evaluate import EvalJob, evaluate_task
    from grpo_runner_gsm8k.loop import Trainer, build_run

    root, registry = tmp_path_factory.mktemp("mteval"), default_registry()
    cfg = load_config(tiny_config_path, [f"logging.dir={root / 'run'}", *small_run(1), *MULTI_TURN, *EVAL],
                      registry=registry)
    trainer = Trainer(build_run(cfg, registry))
    turns = trainer.ops.eval_turns
    turns.turns.backend = script = ScriptedFirstRow(turns.turns.backend, trainer.built.inputs.tokenizer,
                                                    [CALL, ANSWER])
    before = training_stream(trainer)
    metrics = trainer.evaluate()
    after = training_stream(trainer)
    script.restart()
    job = EvalJob(trainer.built, trainer.forward_params(trainer.state.params), root / "eval", "model", turns=turns)
    summary = evaluate_task(job, 0, "arithmetic", trainer.built.inputs.task, 2)
    again = evaluate_task(job, 0, "arithmetic", trainer.built.inputs.task, 2)  # every sample read back
    records = [json.loads(line) for line in (root / "eval" / "arithmetic" / "samples.jsonl").read_text().splitlines()]
    trainer.ops.lock.release()
    return dict(trainer=trainer, metrics=metrics, before=before, after=after, summary=summary, again=again,
                records=records)


def test_a_row_that_calls_the_calculator_reads_its_answer_and_is_graded_on_its_final_answer(evaluated):
    metrics = evaluated["metrics"]
    # one call (row 0's), answered without error, then a second turn
    assert metrics["eval/tools/calls"] == 1 and metrics["eval/tools/errors"] == 0
    assert metrics["eval/tools/turns_max"] == 2 and metrics["eval/tools/masked_tokens"] > 0
    assert metrics["eval/accuracy"] >= 0.5  # question 0's greedy row answered 13 after the tool turn
    first = evaluated["records"][0]
    assert (first["id"], first["sample"]) == ("arithmetic/test/0", 0)
    assert "12*34" in first["conversation"] and "408" in first["conversation"]  # the call and the tool's answer
    assert first["completion"] == "13" and first["answer"] == "13" and first["correct"]  # the final answer alone
    assert first["tools"]["turns"] == 2 and first["tools"]["tool_calls"] == 1
    summary = evaluated["summary"]
    assert summary["tools"]["calls"] == 1 and summary["tools"]["turns_max"] == 2
    assert summary["greedy_accuracy"] >= 0.5
    assert evaluated["again"]["tools"] == summary["tools"]  # a re-run reads the tool work back


def test_a_task_without_the_chat_template_is_evaluated_in_one_turn(evaluated):
    metrics = evaluated["metrics"]
    assert "eval/arithmetic/greedy_accuracy" in metrics
    assert not [key for key in metrics if key.startswith("eval/arithmetic/tools/")]


def test_the_eval_leaves_training_keys_data_and_tools_untouched(evaluated):
    trainer = evaluated["trainer"]
    assert evaluated["after"] == evaluated["before"]
    assert trainer.ops.eval_turns.runner is not trainer.sampler.runner
    assert trainer.ops.eval_turns.runner.stats.calls >= 1  # the eval's own runner ran the calls


def test_streaming_is_refused_for_a_multi_turn_run(tiny_config_path, tmp_path):
    from grpo_runner_gsm8k.commands.evaluate import main

    with pytest.raises(UserError, match=r"^--stream with rollout.multi_turn.enabled: .*; drop --stream$"):
        main(["--config", tiny_config_path, f"logging.dir={tmp_path}", *MULTI_TURN, "--stream"])
