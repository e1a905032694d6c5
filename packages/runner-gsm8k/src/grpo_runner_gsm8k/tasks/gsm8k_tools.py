"""The `gsm8k_tools` task: GSM8K for multi-turn runs, where the policy may compute with the
calculator and python tools before it answers.

The data and the grading are gsm8k's; only the instruction differs: it tells the model it may
call the offered tools and asks for the final answer after the last tool turn (the text the
rewards grade). A run of this task must offer tools (`rollout.multi_turn`).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_core.config import setting

from grpo_runner_gsm8k.tasks.gsm8k import Gsm8kOptions, Gsm8kTask

TOOLS_INSTRUCTION = ("You may call the calculator or python tools for any arithmetic. When you have the result, "
                     "solve the problem and write only the final answer on the last line in the form: #### <number>")
SUGGESTED_TOOLS = ("calculator", "python")


@dataclass(frozen=True)
class Gsm8kToolsOptions(Gsm8kOptions):
    """Options of the `gsm8k_tools` task (those of `gsm8k`, another instruction)."""

    instruction: str = setting(
        TOOLS_INSTRUCTION, "Appended to each question (after a blank line): the tools may be used, and the answer "
        "format the rewards read; empty for none.")


class Gsm8kToolsTask(Gsm8kTask):
    """GSM8K whose prompts invite tool calls (see the module doc)."""
