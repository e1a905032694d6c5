"""What the runner asks of a rollout backend and a task, typed, so that a plugin package
providing one needs `grpo-core` alone.

The built-in implementations are `grpo_rollout.JaxRollout` and the tasks of
`grpo_runner_gsm8k.tasks`; the examples in `grpo_core.hookspecs` implement both
protocols from scratch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import jax
from jax.sharding import NamedSharding

from grpo_core.rollout_records import RolloutResult, TrainBatch

@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled (hashable: it is a static argument of the jitted loop).

    max_new_tokens:  sampled tokens per completion at most.
    n:               samples per prompt (K, the GRPO group size); rows p*n .. p*n+n-1
                     of the result belong to prompt p.
    temperature:     logits are divided by it; logps are at this temperature too.
    top_p, top_k:    nucleus mass (1.0 = off) and top-k count (0 = off); top-k is
                     applied first, top-p then acts on the top-k distribution (HF order).
    greedy:          argmax (first index on ties); temperature still sets the logps.
    stop_token_ids:  a row ends after sampling any of these (the stop token is kept and
                     counted in the completion mask).
    filtered_logps:  return log-probs of the filtered distribution instead of the
                     unfiltered log_softmax(logits / T).
    """

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    filtered_logps: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "use at least 1")
        _check(self.n >= 1, "n", self.n, "use at least 1 sample per prompt")
        _check(self.temperature > 0, "temperature", self.temperature, "use > 0 (greedy=True for argmax)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "use a value in (0, 1]; 1.0 disables")
        _check(self.top_k >= 0, "top_k", self.top_k, "use >= 0; 0 disables")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "token ids are non-negative")

    @classmethod
    def from_config(cls, rollout: Any, stop_token_ids=(), **changes: Any) -> "SamplingParams":
        """From a `grpo_core.config.RolloutConfig`; `changes` override fields (e.g. for eval)."""
        params = cls(
            max_new_tokens=rollout.max_new_tokens, n=rollout.n, temperature=rollout.temperature,
            top_p=rollout.top_p, top_k=rollout.top_k, greedy=rollout.greedy,
            stop_token_ids=tuple(stop_token_ids),
        )
        return dataclasses.replace(params, **changes)

    @property
    def mode(self) -> str:
        """Which sampler runs: greedy | top_k | top_p | full."""
        if self.greedy:
            return "greedy"
        if self.top_k:
            return "top_k"
        return "top_p" if self.top_p < 1.0 else "full"


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {fix}.")


@runtime_checkable
class RolloutBackend(Protocol):
    """A sampler the loop drives (built by `RolloutSpec.factory(options)`).

    For each rollout (the training rollout of every update, and eval) the loop calls
    `load_weights` with the current policy, `generate`, then `release_weights` before the
    update (which needs that memory); `trim` then turns the result into the training batch.
    """

    def load_weights(self, model: Any) -> None:
        """The policy to sample from until the next call: a `grpo_core.models` Qwen model
        (flax nnx) holding the weights in the compute dtype, sharded like the run's params.
        A backend outside JAX reads them by name through `grpo_core.models.hf_names`."""

    def release_weights(self) -> None:
        """Drop every reference to the loaded weights (a colocated engine may also free
        its own copy or KV memory); the next `load_weights` brings the updated policy."""

    def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array, sampling: SamplingParams, *,
                 pad_token_id: int = 0, batch_sharding: NamedSharding | None = None) -> RolloutResult:
        """`sampling.n` completions for each prompt (unpadded token-id lists; with several
        processes every process passes the same global list). Rows p*n .. p*n+n-1 of the
        result come from prompt p. `batch_sharding` is the NamedSharding of the [P * n, ...]
        batch (dimension 0 over the data axes of the mesh) or None."""

    def trim(self, result: RolloutResult) -> TrainBatch:
        """Prompt and completion joined into one left-padded training batch
        (`grpo_core.rollout_records.trim_batch` does it for any result)."""


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


class CompletionText(str):
    """A decoded completion as reward functions receive it: a `str`, plus what only the
    rollout knows. num_tokens: sampled tokens (the stop token included); max_tokens: the
    rollout's token budget (`rollout.max_new_tokens`); finished: ended on a stop token.
    Reward functions that need none of it use it as a plain string."""

    num_tokens: int
    max_tokens: int
    finished: bool

    def __new__(cls, text: str, num_tokens: int, max_tokens: int, finished: bool) -> "CompletionText":
        value = super().__new__(cls, text)
        value.num_tokens, value.max_tokens, value.finished = num_tokens, max_tokens, finished
        return value
