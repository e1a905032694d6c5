"""The `gsm8k_tools` task: GSM8K's data and answers with an instruction that invites tool
calls; a run of it without multi-turn rollouts is refused at load with one line."""

import json

from grpo_core.config_io import plugin_options
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.tasks.gsm8k_tools import TOOLS_INSTRUCTION


def _data(tmp_path):
    for split in ("train", "test"):
        rows = [json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"})
                for i in range(1, 5)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return tmp_path


def test_questions_invite_the_tools_and_answers_are_gsm8ks(tmp_path):
    spec = default_registry().get("task", "gsm8k_tools")
    task = spec.factory(plugin_options(spec.options, {"path": str(_data(tmp_path))}, "task.options"), seed=0)
    examples = task.train_batch(4)
    assert all(ex.question.endswith("\n\n" + TOOLS_INSTRUCTION) for ex in examples)
    assert sorted(ex.answer for ex in examples) == ["2", "4", "6", "8"] and task.use_chat_template


def test_without_multi_turn_rollouts_is_refused_in_one_line(tmp_path, one_step, capsys):
    argv = one_step(tmp_path / "run", "task.name=gsm8k_tools", f"task.options={{path: {_data(tmp_path)}}}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task.name = 'gsm8k_tools' invites tool calls" in err[0]
    assert "set rollout.multi_turn.enabled=true and rollout.multi_turn.tools=[calculator, python]" in err[0]
    assert not (tmp_path / "run").exists()
