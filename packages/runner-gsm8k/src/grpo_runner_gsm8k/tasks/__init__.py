"""Tasks: where prompts and reference answers come from.

The loop builds a task with `spec.factory(options, seed=..., process_index=...,
process_count=...)` and then uses the `grpo_core.contracts.Task` protocol (`train_batch`,
`test_examples`, `state`, `restore`) and `render_prompt`.
"""

from grpo_core import TaskSpec
from grpo_core.contracts import Example, Task

from grpo_runner_gsm8k.tasks.arithmetic import ArithmeticOptions, ArithmeticTask
from grpo_runner_gsm8k.tasks.boxed_math import (BoxedMathOptions, BoxedMathTask, CompetitionOptions,
                                                Math500Options, preset)
from grpo_runner_gsm8k.tasks.code_tasks import (CodeFunctionsOptions, CodeFunctionsTask, HumanEvalOptions,
                                                HumanEvalTask)
from grpo_runner_gsm8k.tasks.countdown import CountdownOptions, CountdownTask
from grpo_runner_gsm8k.tasks.dataset import DatasetOptions, DatasetTask
from grpo_runner_gsm8k.tasks.base import EpochOrder, render_prompt
from grpo_runner_gsm8k.tasks.gsm8k import Gsm8kOptions, Gsm8kTask, final_answer
from grpo_runner_gsm8k.tasks.gsm8k_tools import Gsm8kToolsOptions, Gsm8kToolsTask

TASK_SPECS = [
    TaskSpec("gsm8k", Gsm8kTask, Gsm8kOptions,
             "GSM8K word problems from a local jsonl/parquet directory or the HF Hub"),
    TaskSpec("gsm8k_tools", Gsm8kToolsTask, Gsm8kToolsOptions,
             "GSM8K for multi-turn runs: the prompt invites calculator and python calls"),
    TaskSpec("arithmetic", ArithmeticTask, ArithmeticOptions,
             "Generated arithmetic problems ('3+5=' -> '8'), difficulty set by options"),
    TaskSpec("boxed_math", preset("boxed_math"), BoxedMathOptions,
             "Boxed-answer math from any JSONL/parquet/Hub data via a field mapping, graded by math-verify"),
    TaskSpec("math500", preset("math500"), Math500Options,
             "MATH-500 (Hub HuggingFaceH4/MATH-500 or its JSONL by path), by subject and level"),
    TaskSpec("aime", preset("aime", needs_path=True), CompetitionOptions,
             "AIME problems from a JSONL/parquet file (task.options.path), boxed answers"),
    TaskSpec("amc", preset("amc", needs_path=True), CompetitionOptions,
             "AMC problems from a JSONL/parquet file (task.options.path), boxed answers"),
    TaskSpec("countdown", CountdownTask, CountdownOptions,
             "Generated countdown puzzles: reach a target from a few numbers with + - * /"),
    TaskSpec("code_functions", CodeFunctionsTask, CodeFunctionsOptions,
             "Generated one-line functions ('add 3:' -> x+3), graded by running their tests in the sandbox"),
    TaskSpec("humaneval", HumanEvalTask, HumanEvalOptions,
             "OpenAI HumanEval's 164 problems (MIT, bundled), graded by running their tests in the sandbox"),
    TaskSpec("dataset", DatasetTask, DatasetOptions,
             "Any JSON/JSONL/parquet/Hub data: a prompt template over its fields and a grader by name"),
]

__all__ = ["ArithmeticOptions", "ArithmeticTask", "BoxedMathOptions", "BoxedMathTask", "CountdownOptions",
           "CountdownTask", "EpochOrder", "Example", "Gsm8kOptions", "Gsm8kTask",
           "Task", "TASK_SPECS", "final_answer", "render_prompt"]
