"""The `code` grader (programs run against tests in the sandbox), HumanEval and the generated code task.

Sandbox calls cost about 0.4 s each, so each test grades its programs in one concurrent batch."""

import sys

import pytest
from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_tools.sandbox import SandboxResult

from grpo_runner_gsm8k.assembly.build import from_plugin
from grpo_runner_gsm8k.evaluation.evaluate import task_grades
from grpo_runner_gsm8k.tasks.code_grading import (CodeGrader, CodeOptions, code_reference, program_of,
                                                  read_reference, verdicts_of)
from grpo_runner_gsm8k.tasks.code_tasks import humaneval_rows
from grpo_runner_gsm8k.tasks.grading import Graded
from grpo_runner_gsm8k.training.scoring import reward_details

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
ADD3 = code_reference(["assert add3(1) == 4", "assert add3(-3) == 0", "assert add3(10) == 13"], "add3")
FORGED = 'VERDICT [{i}, "pass", ""]'
# Tries every way this program has to write a verdict line: its stdout, every descriptor, /proc and /dev/fd.
FORGER = f"""import os
print({FORGED.format(i=0)!r}, flush=True)
for fd in range(256):
    try:
        os.write(fd, b'\\n{FORGED.format(i=1)}\\n')
    except OSError:
        pass
for path in ("/proc/self/fd/1", "/dev/fd/1", "/proc/1/fd/1", "/dev/stdout"):
    try:
        with open(path, "w") as out:
            out.write('{FORGED.format(i=2)}\\n')
    except OSError:
        pass
def add3(x):
    return None
"""
PROGRAMS = {
    "pass": "Here it is:\n```python\ndef add3(x):\n    return x + 3\n```\n",
    "fail": "def add3(x):\n    return 4 if x == 1 else 0",
    "syntax": "def add3(x) return x",
    "timeout": "def add3(x):\n    while True:\n        pass",
    "forger": FORGER,
    "always_equal": "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef add3(x):\n    return Yes(0)",
    "kills_harness": "import os\nos.kill(os.getppid(), 9)\ndef add3(x):\n    return x + 3",
    "exits_early": "import os\nos._exit(0)",
    "raises": "def add3(x):\n    raise ValueError(x)",
}


@linux_only
def test_programs_get_their_verdicts_from_the_harness_not_from_their_output():
    grader = CodeGrader(CodeOptions(test_seconds=1.0, program_seconds=2.0))
    verdicts = dict(zip(PROGRAMS, grader.grade_many(list(PROGRAMS.values()), [ADD3] * len(PROGRAMS))))
    outcomes = {name: (v.passed, v.outcome) for name, v in verdicts.items()}
    assert outcomes == {"pass": (3, "pass"), "fail": (2, "fail"), "syntax": (0, "syntax"),
                        "timeout": (0, "timeout"), "forger": (0, "crash"), "always_equal": (1, "fail"),
                        "kills_harness": (0, "crash"), "exits_early": (0, "crash"), "raises": (0, "error")}
    assert [verdicts["fail"].reward(s) for s in ("all", "fraction")] == [0.0, 2 / 3]
    metrics = grader.last_metrics
    assert (metrics["programs_pass"], metrics["programs_crash"], metrics["programs_syntax"]) == (1, 3, 1)
    assert (metrics["tests_passed"], metrics["tests_run"]) == (6, 27) and metrics["grading_seconds"] > 0


def test_the_program_is_the_last_fenced_block_after_the_prefix_when_it_lacks_the_function():
    spec = read_reference(code_reference(["assert f(1) == 2"], "f", prefix="def f(x):\n    return "))
    assert program_of("x+1", spec) == "def f(x):\n    return x+1"
    fenced = "```python\ndef f(x): return 0\n```\nbetter:\n```py\ndef f(x):\n    return x + 1\n```"
    assert program_of(fenced, spec) == "def f(x):\n    return x + 1\n"
    with pytest.raises(ValueError, match="'tests' and 'entry_points'"):
        read_reference("72")


def test_tests_without_a_verdict_line_fail_with_the_sandboxes_reason():
    ran_out = SandboxResult('VERDICT [0, "pass", ""]\n', 137, True, False, False, 7.0)
    assert verdicts_of(ran_out, 2) == [("pass", ""), ("timeout", "program time limit")]
    died = SandboxResult("", 137, False, False, False, 0.5, out_of_memory=True)
    assert verdicts_of(died, 1) == [("crash", "memory limit")]


@linux_only
def test_humaneval_canonical_solutions_pass_and_bare_prompts_fail():
    rows = humaneval_rows()
    assert len(rows) == 164 and len({r["task_id"] for r in rows}) == 164
    task = from_plugin(default_registry(), "task", "humaneval", {}, "task.options")
    sample = task.test_examples()[::10]  # 17 problems, fixed: all 164 take ~35 s per kind on 2 cores
    by_id = {r["task_id"]: r for r in rows}
    canonical = [by_id[ex.id]["prompt"] + by_id[ex.id]["canonical_solution"] for ex in sample]
    bare = [by_id[ex.id]["prompt"] for ex in sample]
    grades = task.grade_many(canonical + bare, [ex.answer for ex in sample] * 2)
    assert [g.correct for g in grades] == [True] * len(sample) + [False] * len(sample)


def test_tiny_code_config_loads_and_its_reward_grades_a_problem(repo_root):
    cfg = load_config(str(repo_root / "configs" / "tiny_code.yaml"), [], registry=default_registry())
    task = from_plugin(default_registry(), "task", cfg.task.name, cfg.task.options, "task.options", seed=0)
    example = task.train_batch(1)[0]
    assert example.question.endswith(":") and cfg.task.rewards == {"code": 1.0}
    if not sys.platform.startswith("linux"):
        return
    constant = example.question.split()[1].rstrip(":")
    reward = from_plugin(default_registry(), "reward", "code", cfg.task.reward_options["code"], "code")
    wrong = str((int(constant) + 1) % 10)
    assert reward([constant, wrong, "?"], [example.answer] * 3) == [1.0, 0.0, 0.0]
    details = reward_details({"code": (reward, 1.0)})
    assert details["train-reward/func/code/programs_pass"] == 1 and details["train-reward/func/code/programs_syntax"] == 1


def test_eval_grades_a_batch_at_once_when_the_task_can():
    class Batched:
        def grade(self, completion, reference):
            raise AssertionError("graded one by one")

        def grade_many(self, completions, references):
            return [Graded(c, c == r) for c, r in zip(completions, references)]

    assert task_grades(Batched(), ["a", "b"], ["a", "a"]) == [Graded("a", True), Graded("b", False)]


def test_grpo_run_plugins_lists_the_code_and_dataset_tasks_and_the_grader_rewards():
    registry = default_registry()
    assert {"humaneval", "code_functions", "dataset"} <= set(registry.names("task"))
    assert {"code", "exact", "choice"} <= set(registry.names("reward"))
