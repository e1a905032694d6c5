"""The plugin kinds of multi-turn rollouts, `Tool` and `Environment` (re-exported by
`grpo_core.contracts`, kept here so that module stays one screen per kind).

A multi-turn row alternates assistant turns (sampled tokens) with turns the host writes:
tool responses, or an environment's next message. Both come back to the model through its
chat template; `grpo_core.tool_calls` parses the calls and renders those turns as tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

from grpo_core.task_contracts import Example


class ToolError(Exception):
    """Raised by a tool when the call itself was wrong (the model's mistake, e.g. division by
    zero): the model reads "Error: <message>" and the call counts as an error."""


@runtime_checkable
class Tool(Protocol):
    """A function the policy may call (built by `ToolSpec.factory(options)`, once per run).

    name:        what the model writes as a call's "name" (usually the spec's name).
    description: one line, shown to the model by the chat template.
    parameters:  JSON schema (an "object") of the call's "arguments"; its `required` keys and
                 the JSON types of `properties` are checked before the call.
    Calling it with the parsed arguments returns the text the model reads as the tool's
    response. It may raise (`ToolError` for a wrong call): the caller turns the exception (or
    a timeout) into that text, as the model's error, not the run's. Calls come from several threads at once.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, arguments: Mapping[str, Any]) -> str: ...


@dataclass(frozen=True)
class EnvironmentStep:
    """An environment's answer to one assistant turn.

    messages: chat messages appended after the turn (e.g. a `user` message with feedback);
              rendered by the chat template, they are not the model's tokens (loss mask 0).
    done:     the episode is over; the row stops here.
    reward:   reward information of this turn by name (e.g. {"solved": 1.0}), for the rewards
              and the advantage estimators.
    """

    messages: tuple[Mapping[str, str], ...] = ()
    done: bool = False
    reward: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """State across the turns of one rollout row (`EnvironmentSpec.factory(options)` is called
    once per row, so nothing is shared between rows)."""

    def reset(self, example: Example) -> list[dict[str, str]]:
        """Starts an episode on `example`; returns its opening chat messages (system/user)."""

    def step(self, assistant_text: str) -> EnvironmentStep:
        """Takes the decoded text of one assistant turn (tool calls included, which the
        rollout has already answered) and says what follows it."""

    @property
    def done(self) -> bool:
        """The episode is over (the last step said so, or the environment decided)."""

    def reward_info(self) -> dict[str, float]:
        """Reward information of the whole episode so far, by name."""


@runtime_checkable
class SavedEnvironment(Protocol):
    """An environment whose episode can be saved and resumed, which partial rollouts need: a row
    carried across steps is saved in the checkpoint mid-episode, its environment included.

    state():         the episode so far, as JSON (plain dicts, lists, strings, numbers).
    restore(state):  puts a freshly built environment (`factory(options)`, not reset) back to
                     that episode, so its next `step`, `done` and `reward_info` are the saved
                     one's.
    """

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...
