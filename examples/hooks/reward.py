"""Example `grpo_rewards` plugin: Reward functions selectable under `task.rewards: {<name>: <weight>}`.

A complete plugin module (register it in pyproject.toml as
`[project.entry-points.grpo] my_plugin = "my_plugin.plugin"`); tests/e2e/test_hookspec_examples.py
trains one step of the tiny config with it.
"""

from dataclasses import dataclass
from grpo_core import RewardSpec, hookimpl

@dataclass(frozen=True)
class Options:
    target: int = 100

def build(options: Options):
    def shortness(completions, answers):
        return [1.0 if len(c) <= options.target else 0.0 for c in completions]
    return shortness

@hookimpl
def grpo_rewards():
    return [RewardSpec("short", build, Options, "1 when the completion is short")]
