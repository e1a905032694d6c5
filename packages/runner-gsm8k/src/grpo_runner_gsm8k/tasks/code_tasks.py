"""Code tasks graded by running tests (`code_grading`): `code_functions`, generated one-line
functions to train on, and `humaneval`, OpenAI's 164 HumanEval problems for evaluation.

`code_functions` problems are `f(x) = x op k`. The prompt names the operation in words
("add 3:"), or shows two input/output pairs ("f(1)=4 f(2)=5:", style `examples`, which asks
for the rule itself). The task's prefix supplies `def f(x):\n    return `, so the completion
is the expression (`x+3`); the reward comes from executed tests only, so `x+3`, `3+x` and
`x+1+2` all pass and a typo fails. For a model trained from scratch, `write: constant` also
puts `x+` in the prefix and leaves one character to write: a random character is right about
once in a hundred, as often as in the tiny arithmetic run, which is what lets GRPO start.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from grpo_core.config import setting
from grpo_core.contracts import Example

from grpo_runner_gsm8k.tasks.base import GeneratedTask, check_process, shard_of
from grpo_runner_gsm8k.tasks.code_grading import CodeGrader, CodeOptions, CodeVerdict, code_reference
from grpo_runner_gsm8k.tasks.grading import Graded

WORDS = {"+": "add", "-": "subtract", "*": "times"}
FUNCTION_PREFIX = "def f(x):\n    return "
HUMANEVAL_DATA = Path(__file__).with_name("data") / "HumanEval.jsonl.gz"  # MIT, OpenAI; HumanEval.LICENSE
CHAT_INSTRUCTION = "Complete the following Python function. Answer with the whole function in a ```python block."


def _graded(verdict: CodeVerdict, score: str) -> Graded:
    """The eval verdict: right when the reward is 1; the program is the answer majority votes compare."""
    return Graded(verdict.program.strip() or None, verdict.reward(score) == 1.0)


@dataclass(frozen=True)
class CodeFunctionsOptions(CodeOptions):
    """Options of the `code_functions` task (and the code grader's, see `CodeOptions`)."""

    operations: str = setting("+-*", "Operators to draw from, any of '+', '-', '*'.")
    max_constant: int = setting(9, "The constant k of `x op k` is drawn from 0 .. max_constant.", ge=0, le=99)
    style: Literal["words", "examples"] = setting(
        "words", "words = the prompt names the operation ('add 3:'); examples = it shows f(1) and f(2) "
        "('f(1)=4 f(2)=5:').")
    write: Literal["expression", "constant"] = setting(
        "expression", "What the completion writes: expression = `x+3` after `def f(x):\\n    return `; "
        "constant = only `3`, after `return x+` (the smallest step, for a model trained from scratch).")
    tests: int = setting(4, "Executed tests per problem (inputs drawn from -20 .. 20, the same for the same "
                         "function, so identical programs share a cached verdict).", ge=1, le=20)
    test_size: int = setting(128, "Problems in the test split (a stream separate from training).", ge=1)
    use_chat_template: bool = setting(False, "Render prompts with the tokenizer's chat template.")


def _apply(x: int, operation: str, k: int) -> int:
    return x + k if operation == "+" else x - k if operation == "-" else x * k


def make_function_problem(options: CodeFunctionsOptions, seed: int, stream: int, index: int) -> Example:
    """Problem `index` of `stream`: `f(x) = x op k` with executed tests on drawn inputs."""
    rng = np.random.default_rng([seed, stream, index])
    operation = str(rng.choice(list(options.operations)))
    k = int(rng.integers(0, options.max_constant + 1))
    inputs = np.random.default_rng([seed, ord(operation), k]).integers(-20, 21, size=options.tests)
    tests = [f"assert f({x}) == {_apply(int(x), operation, k)}" for x in inputs]
    if options.style == "words":
        question = f"{WORDS[operation]} {k}:"
    else:
        question = f"f(1)={_apply(1, operation, k)} f(2)={_apply(2, operation, k)}:"
    prefix = FUNCTION_PREFIX + (f"x{operation}" if options.write == "constant" else "")
    answer = code_reference(tests, "f", prefix=prefix)
    return Example(question, answer, f"code_functions/{stream}/{index}")


class CodeFunctionsTask(GeneratedTask):
    """Generated `f(x) = x op k` problems, graded by running their tests."""

    name = "code_functions"
    make_problem = staticmethod(make_function_problem)

    def __init__(self, options: CodeFunctionsOptions, **placement: int):
        unknown = sorted(set(options.operations) - set(WORDS))
        if not options.operations or unknown:
            raise ValueError(f"code_functions operations {options.operations!r} must be a non-empty string of "
                             f"'+', '-', '*' (unknown: {unknown})")
        super().__init__(options, **placement)
        self.grader = CodeGrader(options)

    def grade(self, completion: str, reference: str) -> Graded:
        return _graded(self.grader.grade(completion, reference), self.grader.options.score)

    def grade_many(self, completions: list[str], references: list[str]) -> list[Graded]:
        verdicts = self.grader.grade_many(completions, references)
        return [_graded(v, self.grader.options.score) for v in verdicts]


def humaneval_rows() -> list[dict]:
    """The 164 problems (task_id, prompt, entry_point, canonical_solution, test)."""
    with gzip.open(HUMANEVAL_DATA, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def humaneval_example(row: dict, chat: bool) -> Example:
    """The prompt as the question (after an instruction for chat models); the test's `check`
    run on the entry point, with the prompt as setup (some tests call its helpers) and prefix."""
    question = f"{CHAT_INSTRUCTION}\n\n```python\n{row['prompt']}```" if chat else row["prompt"]
    reference = code_reference([f"check({row['entry_point']})"], row["entry_point"],
                               setup=row["prompt"] + "\n" + row["test"], prefix=row["prompt"])
    return Example(question, reference, row["task_id"])


@dataclass(frozen=True)
class HumanEvalOptions(CodeOptions):
    """Options of the `humaneval` task (evaluation; its 164 problems are also its train split) and of
    the code grader (see `CodeOptions`)."""

    use_chat_template: bool = setting(
        True, "Render prompts with the chat template, after an instruction to answer in a ```python block; "
        "false: the bare prompt, for a base model to continue (the completion may be the body alone).")


class HumanEvalTask:
    """HumanEval: a fixed list of problems (`test_examples`; training cycles through the same ones)."""

    name = "humaneval"

    def __init__(self, options: HumanEvalOptions, *, seed: int = 0, process_index: int = 0, process_count: int = 1):
        check_process(process_index, process_count)
        self.options, self.use_chat_template = options, options.use_chat_template
        self.process_index, self.process_count = process_index, process_count
        self.examples = [humaneval_example(row, options.use_chat_template) for row in humaneval_rows()]
        self.grader = CodeGrader(options)
        self.position = 0

    def test_examples(self, limit: int | None = None) -> list[Example]:
        count = len(self.examples) if limit is None else min(limit, len(self.examples))
        return [self.examples[i] for i in shard_of(count, self.process_index, self.process_count)]

    def train_batch(self, n: int) -> list[Example]:
        mine = self.test_examples()
        start, self.position = self.position, self.position + n
        return [mine[i % len(mine)] for i in range(start, start + n)]

    def state(self) -> dict:
        return {"position": self.position}

    def restore(self, state: dict) -> None:
        self.position = int(state["position"])

    def grade(self, completion: str, reference: str) -> Graded:
        return _graded(self.grader.grade(completion, reference), self.grader.options.score)

    def grade_many(self, completions: list[str], references: list[str]) -> list[Graded]:
        verdicts = self.grader.grade_many(completions, references)
        return [_graded(v, self.grader.options.score) for v in verdicts]
