"""Built-in tasks, rewards, graders and `grpo-run` subcommands, registered through the `grpo` entry point
like any plugin."""

from grpo_core import CommandSpec, GraderSpec, RewardSpec, TaskSpec, hookimpl

from grpo_runner_gsm8k.commands.builtin import COMMAND_SPECS
from grpo_runner_gsm8k.tasks.graders import GRADER_REWARD_SPECS, GRADER_SPECS
from grpo_runner_gsm8k.tasks.judge import JUDGE_REWARD_SPECS
from grpo_runner_gsm8k.tasks.math_rewards import MATH_REWARD_SPECS
from grpo_runner_gsm8k.tasks.reward_model import REWARD_MODEL_SPECS
from grpo_runner_gsm8k.tasks.rewards import REWARD_SPECS
from grpo_runner_gsm8k.tasks.tool_rewards import TOOL_REWARD_SPECS
from grpo_runner_gsm8k.tasks import TASK_SPECS


@hookimpl
def grpo_tasks() -> list[TaskSpec]:
    return list(TASK_SPECS)


@hookimpl
def grpo_rewards() -> list[RewardSpec]:
    return (list(REWARD_SPECS) + list(MATH_REWARD_SPECS) + list(TOOL_REWARD_SPECS) + list(GRADER_REWARD_SPECS)
            + list(JUDGE_REWARD_SPECS) + list(REWARD_MODEL_SPECS))


@hookimpl
def grpo_commands() -> list[CommandSpec]:
    return list(COMMAND_SPECS)


@hookimpl
def grpo_graders() -> list[GraderSpec]:
    return list(GRADER_SPECS)
