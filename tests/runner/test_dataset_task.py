"""The `dataset` task (any file, template, reference field and grader from the config) and the
graders it picks by name."""

import json
import sys

import pytest
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.assembly.build import from_plugin
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.tasks.code_grading import code_reference
from grpo_runner_gsm8k.tasks.graders import choice_of, grade_exact, grade_number, make_grader

ROWS = [{"q": "2+2?", "opts": "A) 3 B) 4", "gold": "B", "n": 1},
        {"q": "3*3?", "opts": "A) 9 B) 6", "gold": "A", "n": 2}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task(**options):
    return from_plugin(default_registry(), "task", "dataset", options, "task.options")


def test_a_jsonl_file_becomes_prompts_and_choice_grades(tmp_path):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    task = _task(path=path, prompt="{q}\n{opts}\nAnswer with a letter.", answer_field="gold", id_field="n",
                 grader="choice", system_prompt="Be brief.")
    first = task.test_examples()[0]
    assert (first.question, first.answer, first.id) == ("2+2?\nA) 3 B) 4\nAnswer with a letter.", "B", "dataset/test/1")
    assert first.messages()[0] == {"role": "system", "content": "Be brief."}
    assert first.messages("From the config.")[0]["content"] == "From the config."
    grades = [task.grade(c, "B") for c in ("The answer is (B).", "\\boxed{A}", "no idea")]
    assert [(g.answer, g.correct) for g in grades] == [("B", True), ("A", False), (None, False)]
    assert len(task.train_batch(3)) == 3 and task.state()["size"] == 2


def test_a_missing_field_is_one_line_listing_the_columns(tmp_path):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    with pytest.raises(UserError) as refused:
        _task(path=path, prompt="{question}", answer_field="gold")
    message = str(refused.value)
    assert "no field 'question'" in message and "columns: gold, n, opts, q" in message and "\n" not in message
    with pytest.raises(UserError, match="no field 'answer'"):
        _task(path=path, prompt="{q}")


def test_grpo_run_refuses_a_missing_field_before_the_model_loads(tmp_path, tiny_config_path, capsys):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    assert main(["--config", tiny_config_path, f"logging.dir={tmp_path / 'run'}", "task.name=dataset",
                 f"task.options={{path: {path}, prompt: \"{{q}}\", answer_field: answer, use_chat_template: false}}",
                 "task.rewards={exact: 1.0}", "eval.reward=exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no field 'answer' (columns: gold, n, opts, q)" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_json_file_with_chat_messages(tmp_path):
    rows = [{"chat": [{"role": "system", "content": "S"}, {"role": "user", "content": "Name 1."}], "ref": 1}]
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    task = _task(path=str(tmp_path / "chat.json"), messages_field="chat", answer_field="ref", grader="number",
                 system_prompt="unused: the messages have one")
    example = task.test_examples()[0]
    assert example.messages() == rows[0]["chat"] and example.question == "Name 1." and example.answer == "1"
    assert hash(example) == hash(task.test_examples()[0])
    assert task.grade("So it is 1.", example.answer).correct and not task.grade("2", example.answer).correct


def test_text_graders():
    assert grade_exact("work\nParis.", "Paris").correct and not grade_exact("paris", "Paris").correct
    assert grade_exact("so \\boxed{x  y}", "x y").correct
    assert choice_of("(A) is wrong, I pick C") == "C" and choice_of("Answer: none") is None
    assert grade_number("#### 1,000", "1000").correct and not grade_number("999", "1000").correct
    with pytest.raises(UserError, match="unknown grader 'regex'; available: choice, code, exact, math, number"):
        make_grader("regex")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_the_code_grader_from_a_dataset_row(tmp_path):
    reference = json.loads(code_reference(["assert double(4) == 8"], "double"))
    path = _write_jsonl(tmp_path / "code.jsonl", [{"spec": "Write double(x).", "tests": reference}])
    task = _task(path=path, prompt="{spec}", answer_field="tests", grader="code")
    example = task.test_examples()[0]
    grades = task.grade_many(["```python\ndef double(x):\n    return 2 * x\n```", "def double(x): return x"],
                             [example.answer] * 2)
    assert [g.correct for g in grades] == [True, False]


def test_references_the_grader_cannot_use_are_refused_when_the_task_is_built(tmp_path):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    with pytest.raises(UserError, match=r"row 1: reference 'B' is not a number"):
        _task(path=path, prompt="{q}", answer_field="gold", grader="number")
    with pytest.raises(UserError, match=r"row 1: reference 'B' is not a code reference"):
        _task(path=path, prompt="{q}", answer_field="gold", grader="code")
