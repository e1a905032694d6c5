"""The boxed-answer math tasks and countdown: loading, field mapping, errors, grading, registration."""

import json
from pathlib import Path

import pytest

from grpo_core.errors import UserError
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.tasks import BoxedMathOptions, CountdownOptions, CountdownTask
from grpo_runner_gsm8k.tasks.boxed_math import BOXED_INSTRUCTION, CompetitionOptions, Math500Options, preset
from grpo_runner_gsm8k.tasks.countdown import check_countdown, decode_answer, evaluate_expression
from grpo_runner_gsm8k.tasks.math_rewards import CountdownRewardOptions, countdown_reward

MATH500 = Path(__file__).resolve().parents[3] / "shared/data/math500/test.jsonl"


def test_new_tasks_and_rewards_are_registered_plugins():
    registry = default_registry()
    tasks = {entry.spec.name for entry in registry.entries("task")}
    rewards = {entry.spec.name for entry in registry.entries("reward")}
    assert {"boxed_math", "math500", "aime", "amc", "countdown"} <= tasks
    assert {"boxed_answer", "countdown"} <= rewards


@pytest.mark.skipif(not MATH500.is_file(), reason=f"MATH-500 not found at {MATH500}")
def test_math500_from_its_jsonl():
    task = preset("math500")(Math500Options(path=str(MATH500)), seed=0)
    examples = task.test_examples()
    assert len(examples) == 500 and len({ex.id for ex in examples}) == 500
    first = examples[0]
    assert first.id == "math500/test/test/precalculus/807.json"
    assert first.question.endswith("\n\n" + BOXED_INSTRUCTION)
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert task.example_fields(first.id) == {"subject": "Precalculus", "level": 2}
    assert task.grade("... \\boxed{(3, \\pi/2)}", first.answer).correct
    assert len(task.train_batch(3)) == 3  # MATH-500 trains on its only split


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_field_mapping_reads_other_names(tmp_path):
    data = _write(tmp_path / "aime.jsonl", [{"Problem": "What is 1+1?", "Answer": 2, "ID": "2024-I-1", "year": 2024}])
    options = CompetitionOptions(path=str(data), problem_field="Problem", answer_field="Answer", id_field="ID",
                                 breakdown_fields=["year"], instruction="")
    [example] = preset("aime", needs_path=True)(options).test_examples()
    assert (example.question, example.answer, example.id) == ("What is 1+1?", "2", "aime/test/2024-I-1")


def test_a_missing_mapped_field_names_the_line_and_field(tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"problem": "p", "answer": "1", "unique_id": "a"}, {"problem": "q", "id": 2}])
    task = preset("boxed_math")(BoxedMathOptions(path=str(data)))
    with pytest.raises(UserError, match=r"d.jsonl line 2 has no field 'answer' .*task.options.answer_field"):
        task.test_examples()


def test_aime_without_a_path_is_a_user_error():
    with pytest.raises(UserError, match="task aime reads its problems from a file: set task.options.path"):
        preset("aime", needs_path=True)(CompetitionOptions())


@pytest.mark.parametrize("completion,correct", [
    ("\\boxed{(3 + 5) * 2}", True), ("Try this.\n(3+5)*2 = 16", True), ("so (3+5)*2 = 16", False), ("\\boxed{2 \\times (5 + 3)}", True),
    ("\\boxed{16}", False),                 # no numbers used
    ("\\boxed{(3 + 5) * 2 * 1}", False),    # 1 is not given
    ("\\boxed{(5 + 5) + 6}", False),        # 5 used twice
    ("\\boxed{(3 + 5) * 2 - 7 + 7}", False),  # 7 given once
    ("\\boxed{3 / (5 - 5)}", False), ("\\boxed{__import__('os')}", False), ("", False),
    ("\\boxed{7 * 2 + 5 - 3}", True), ("\\boxed{(7 - 3) / 2 * (5 + 3)}", False),  # 3 used twice
])
def test_countdown_checks_numbers_and_target(completion, correct):
    assert check_countdown(completion, "16 from 3,5,2,7").correct is correct


def test_countdown_parser_is_exact_and_keeps_precedence():
    value, used = evaluate_expression("1 + 2 * 3 - 8 / (3 + 1)")
    assert value == 5 and used == [1, 2, 3, 8, 3, 1]
    assert evaluate_expression("1 / 3 * 3")[0] == 1


def test_countdown_problems_are_seeded_and_rewarded():
    options = CountdownOptions()
    first, again = CountdownTask(options, seed=3), CountdownTask(options, seed=3)
    assert first.test_examples(5) == again.test_examples(5)
    assert first.train_batch(4) == again.train_batch(4) != CountdownTask(options, seed=4).train_batch(4)
    for example in first.test_examples(20):
        target, numbers = decode_answer(example.answer)
        assert len(numbers) == 4 and 1 <= target <= options.max_target
        assert str(target) in example.question
    reward = countdown_reward(CountdownRewardOptions())
    assert reward(["\\boxed{(3 + 5) * 2}", "\\boxed{3+5}"], ["16 from 3,5,2,7"] * 2) == [1.0, 0.0]


# ---------------------------------------------------------------- what maj@k votes on, per task

def test_countdown_votes_on_the_value_an_expression_reaches():
    """`2+3` and `3+2` are one answer; text votes would tie three ways and pick the wrong `2*4`."""
    from grpo_runner_gsm8k.evaluation.metrics import maj_at_k

    graded = [check_countdown(f"\\boxed{{{e}}}", "5 from 2,3,4") for e in ("2*4", "2+3", "3 + 2")]
    assert [g.answer for g in graded] == ["8", "5", "5"]
    assert maj_at_k([[g.answer for g in graded]], [[g.correct for g in graded]], 3) == 1.0
    assert check_countdown("\\boxed{4/(2+3)}", "5 from 2,3,4").answer == "4/5"  # exact, not 0.8
    assert check_countdown("\\boxed{2+3+3}", "8 from 2,3,4").answer is None  # 3 given once: no vote


def test_math_votes_on_the_normalised_answer():
    task = preset("math500")(Math500Options(path="unused.jsonl"))
    spans = ("\\dfrac{1}{2}", "\\frac{1}{2}", " \\frac{1}{2}. ", "$\\frac{1}{2}$")
    graded = [task.grade(f"so \\boxed{{{s}}}", "\\frac{1}{2}") for s in spans]
    assert {g.answer for g in graded} == {"\\frac{1}{2}"} and all(g.correct for g in graded)


def test_gsm8k_and_arithmetic_vote_on_the_number(tiny_config):
    from grpo_runner_gsm8k.assembly.build import from_plugin
    from grpo_runner_gsm8k.evaluation.evaluate import judge_grades

    correctness = from_plugin(default_registry(), "reward", "correctness", {}, "task.reward_options.correctness")
    graded = judge_grades(tiny_config(), {"correctness": (correctness, 1.0)},
                          ["So #### 1,000", "The answer is 1000.0", "#### 999", "no number"], ["1000"] * 4)
    assert [g.answer for g in graded] == ["1000", "1000", "999", None]
    assert [g.correct for g in graded] == [True, True, False, False]


def test_a_countdown_samples_file_regrades_to_its_summary(tiny_config, tmp_path):
    """The grader path of --regrade (a task with its own grader): rows written as the eval writes
    them, one verdict flipped in the file, regraded to the summary of the true grades."""
    from grpo_core.contracts import CompletionText
    from grpo_runner_gsm8k.evaluation.evaluate import Sample, samples_metrics
    from grpo_runner_gsm8k.commands.regrade import regrade_file
    from grpo_runner_gsm8k.evaluation.store import SampleStore

    task = CountdownTask(CountdownOptions(count=2, max_number=4, max_target=9), seed=0)
    examples = task.test_examples(3)
    guesses = [["\\boxed{1+2}", "\\boxed{2+1}"], ["\\boxed{4}", "\\boxed{3*4}"], ["", "\\boxed{1+1+1}"]]
    samples = [[Sample(CompletionText(text, 4, 8, True), *task.grade(text, ex.answer)) for text in texts]
               for ex, texts in zip(examples, guesses)]
    store = SampleStore(tmp_path / "countdown", {"task": "countdown", "model": "m", "n": 2, "greedy": False})
    store.append(examples, samples)
    expected = samples_metrics(samples, [{}] * 3, False, [1, 2])
    rows = store.samples_path.read_text().splitlines()
    flipped = json.loads(rows[0]) | {"correct": not json.loads(rows[0])["correct"]}
    store.samples_path.write_text("\n".join([json.dumps(flipped), *rows[1:]]) + "\n")
    cfg = tiny_config("eval.greedy=false", "eval.n=2")
    options = {"count": 2, "max_number": 4, "max_target": 9}
    summary, changed, count = regrade_file(cfg, store.samples_path, [1, 2], lambda name: options)
    assert summary == {**expected, "task": "countdown", "model": "m", "n": 2, "greedy": False}
    assert (changed, count) == (1, 6)
