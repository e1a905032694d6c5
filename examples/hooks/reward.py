"""A `grpo_rewards` plugin: 1 for a short completion (`task.rewards: {short: 1.0}`); a
`grpo_core.contracts.RewardFn`."""

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
