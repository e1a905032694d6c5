"""Environment resets and steps of a multi-turn rollout, run once with the same outcomes on
every process.

With several processes every process decodes the same global rows. If each process reset and
stepped environments of its own, an environment whose answers are random, read a clock or
depend on the process would answer differently on each, and the processes would render
different prompts, append different turns and feed different data into one global batch. So,
as for tool calls (grpo_runner_gsm8k.samplers.shared_tools), process 0 alone builds, resets
and steps the environments and sends the outcomes to the others with `broadcast_object`: the
opening messages when the rows start, each environment's `done` and `reward_info()` when the
rollout starts, and, for the rows that ended a turn in one round (stepped together), each
answer and the environment's `done` and `reward_info()` after it. Every process keeps those
last two in the row's `SharedEnvironment`, which the rollout, the rewards and the estimators
read. With one process nothing is sent.
"""

from __future__ import annotations

from typing import Any, Sequence

from grpo_core.multi_turn import EnvironmentStep

from grpo_runner_gsm8k.multihost import broadcast_object
from grpo_runner_gsm8k.samplers.shared_tools import runs_tools


class SharedEnvironment:
    """One row's environment as every process sees it: `done` and `reward_info()` as process 0's
    copy last reported them."""

    def __init__(self, environment: Any, done: bool, info: dict[str, float]):
        self.environment = environment  # None on processes other than 0
        self.done, self.info = done, info

    def reward_info(self) -> dict[str, float]:
        return dict(self.info)


def reset_all(spec: Any, options: Any, examples: Sequence[Any]) -> tuple[list[list[dict]], list[Any]]:
    """(each row's opening messages, each row's environment reset on its example): built and
    reset on process 0, the openings the same on every process (the environments are None on
    the others)."""
    environments = [spec.factory(options) if runs_tools() else None for _ in examples]
    openings = broadcast_object([environment.reset(example) for environment, example in zip(environments, examples)]
                                if runs_tools() else None)
    return openings, environments


def share(environments: Sequence[Any]) -> list[SharedEnvironment]:
    """The rows' environments (reset; None except on process 0) with process 0's `done` and
    reward information."""
    if not environments:
        return []
    reported = broadcast_object([(bool(environment.done), dict(environment.reward_info()))
                                 for environment in environments] if runs_tools() else None)
    return [SharedEnvironment(environment, done, info) for environment, (done, info) in zip(environments, reported)]


def step_all(environments: Sequence[SharedEnvironment], texts: Sequence[str]) -> list[EnvironmentStep]:
    """Each environment's answer to its assistant turn's text, stepped on process 0 and the same
    on every process; updates each one's `done` and reward information."""
    if not environments:
        return []
    outcomes = None
    if runs_tools():
        outcomes = []
        for shared, text in zip(environments, texts):
            answer = shared.environment.step(text)
            outcomes.append((answer, bool(shared.environment.done), dict(shared.environment.reward_info())))
    outcomes = broadcast_object(outcomes)
    for shared, (_, done, info) in zip(environments, outcomes):
        shared.done, shared.info = done, info
    return [answer for answer, _, _ in outcomes]
