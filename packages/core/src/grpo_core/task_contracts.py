"""What the runner asks of a task (built by `TaskSpec.factory`): its examples and data position,
and the completion texts reward functions receive. Importable from `grpo_core.contracts` like
every other contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    question: the user message (problem text plus the task's answer-format instruction).
    answer:   the reference final answer the rewards compare with, e.g. "72".
    id:       where it came from, e.g. "gsm8k/test/17" (for logs and eval dumps).
    """

    question: str
    answer: str
    id: str = ""

    def messages(self, system_prompt: str | None = None) -> list[dict[str, str]]:
        """Chat messages in the `apply_chat_template` format."""
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return system + [{"role": "user", "content": self.question}]


@runtime_checkable
class Task(Protocol):
    """What the runner needs from a task (built by `TaskSpec.factory`).

    Factories are called as `factory(options, *, seed=0, process_index=0,
    process_count=1)`; each process then sees only its own shard of the data.
    Non-empty example ids must be unique: the runner keys tokenized prompts by them.
    """

    use_chat_template: bool

    def train_batch(self, n: int) -> list[Example]:
        """The next `n` training examples of this process's shard."""

    def test_examples(self, limit: int | None = None) -> list[Example]:
        """This process's share of the first `limit` test examples (all when None)."""

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position in the training order, for checkpoints."""

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from a position returned by `state()`."""


@runtime_checkable
class ListableTask(Protocol):
    """Optional member of a task with a finite training set: the runner then checks every
    training prompt's format and length before the run starts (else the first batch only)."""

    def train_examples(self) -> Sequence[Example]:
        """Every training example of this process's shard, in no particular order."""


class CompletionText(str):
    """A decoded completion as reward functions receive it: a `str`, plus what only the
    rollout knows. num_tokens: sampled tokens (the stop token included); max_tokens: the
    rollout's token budget (`rollout.max_new_tokens`); finished: ended on a stop token;
    question: the example's question; prompt: the chat messages the policy answered (system,
    user); both set by the runner before scoring ('' and () where unknown). Reward functions
    that need none of it use it as a plain string."""

    num_tokens: int
    max_tokens: int
    finished: bool
    question: str = ""  # for rewards that read the question (a judge)
    prompt: tuple = ()  # for rewards that score the prompt too (a reward model)

    def __new__(cls, text: str, num_tokens: int, max_tokens: int, finished: bool) -> "CompletionText":
        value = super().__new__(cls, text)
        value.num_tokens, value.max_tokens, value.finished = num_tokens, max_tokens, finished
        return value


class ConversationText(CompletionText):
    """A multi-turn completion for the rewards: the `str` is the final answer (after the last tool turn);
    conversation: the whole trajectory decoded (tool turns, template tokens); turns: assistant turns;
    tool_calls: calls made; environment: the row's environment's reward_info() ({} without one)."""

    conversation: str
    turns: int
    tool_calls: int
    environment: dict

    def __new__(cls, final_answer: str, num_tokens: int, max_tokens: int, finished: bool, *, conversation: str = "",
                turns: int = 1, tool_calls: int = 0, environment: dict | None = None) -> "ConversationText":
        value = super().__new__(cls, final_answer, num_tokens, max_tokens, finished)
        value.conversation, value.turns, value.tool_calls, value.environment = conversation, turns, tool_calls, environment or {}
        return value
