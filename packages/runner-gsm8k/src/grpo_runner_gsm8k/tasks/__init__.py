"""Tasks: where prompts and reference answers come from.

The loop builds a task with `spec.factory(options, seed=..., process_index=...,
process_count=...)` and then uses the `grpo_core.contracts.Task` protocol (`train_batch`,
`test_examples`, `state`, `restore`) and `render_prompt`.
"""

from grpo_core import TaskSpec
from grpo_core.contracts import Example, Task

from grpo_runner_gsm8k.tasks.arithmetic import ArithmeticOptions, ArithmeticTask
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
]

__all__ = ["ArithmeticOptions", "ArithmeticTask", "EpochOrder", "Example", "Gsm8kOptions", "Gsm8kTask",
           "Task", "TASK_SPECS", "final_answer", "render_prompt"]
