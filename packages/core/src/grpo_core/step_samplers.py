"""What the training loop asks of the rollout of one step (re-exported by `grpo_core.contracts`,
kept here so that module stays one screen per kind).

A `StepSampler` gives the groups one step trains on: it draws prompts from the task, rolls
them out with the policy it is handed, scores the rows, and returns the scored groups with
the metrics and seconds of that work as values. How it gets there (one rollout, extra
rollouts until enough groups are informative, rows carried across steps, tool turns) is its
own business; the loop computes advantages and updates from what it returns, the same way
for every sampler. A sampler whose rows outlive a step (partial rollouts) is also a
`CarryingSampler`: the run saves its `state()` with each checkpoint and hands it back to
`restore` on resume.

`loaded` is the one way to sample from a rollout backend: the weights are loaded for the
block and released after it, also when it raises, because the update that follows needs
that memory.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

from grpo_core.rollout_contracts import Policy, RolloutBackend
from grpo_core.rollout_records import Sampled

if TYPE_CHECKING:
    import jax


@runtime_checkable
class StepSampler(Protocol):
    """The rollout of one training step (built once with the run)."""

    def sample(self, policy: "Policy", key: "jax.Array", step: int) -> tuple[Sampled, dict[str, Any],
                                                                              dict[str, float]]:
        """(sampled, metrics, timings) of step `step` (the number of updates so far), sampling
        from `policy` with `key`:
          sampled:  the step's groups, `Sampled(examples, result, scores)`; every group whole
                    (its n rows), as many groups as the update takes (rollout.prompts_per_step).
          metrics:  how they were sampled, logged as they are (e.g. train-rollout/decode_steps;
                    `grpo_core.rollout_records.waste_metrics` gives the decode-waste ones).
          timings:  seconds of the work, `rollout_s` (decoding) and `reward_s` (scoring); the
                    loop logs them as time/train/<name>."""


@runtime_checkable
class CarryingSampler(Protocol):
    """Optional member of a step sampler whose rows outlive a step (they are run state, saved
    and restored with the checkpoint, like the optimizer's)."""

    def state(self) -> dict[str, Any]:
        """A JSON-able copy of the carried rows."""

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from a `state()`; a state this sampler cannot take is a ValueError saying why."""


@contextlib.contextmanager
def loaded(rollout: "RolloutBackend", policy: "Policy") -> Iterator["RolloutBackend"]:
    """`with loaded(rollout, policy) as backend:` samples from `policy` inside the block; the
    weights are released when it ends, however it ends."""
    rollout.load_weights(policy)
    try:
        yield rollout
    finally:
        rollout.release_weights()
