"""`step_sampler`: the run's step sampler, picked by its config; `restore_carried`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_core.errors import UserError
from grpo_core.step_samplers import CarryingSampler, StepSampler

from grpo_runner_gsm8k.samplers.multi_turn_partial import MultiTurnPartialSampler
from grpo_runner_gsm8k.samplers.multi_turn_step import MultiTurnSampler
from grpo_runner_gsm8k.samplers.partial import PartialSampler
from grpo_runner_gsm8k.samplers.plain import PlainSampler
from grpo_runner_gsm8k.samplers.refill import RefillSampler


def step_sampler(run: Any, registry: Any) -> StepSampler:
    """The step sampler of the built `run` (the registry supplies a multi-turn run's tools)."""
    rollout, loss = run.cfg.rollout, run.cfg.loss
    refill = loss.dynamic_sampling and loss.dynamic_sampling_mode == "refill"
    if rollout.multi_turn.enabled and rollout.partial.enabled:  # refill is refused with partial rollouts at load
        return MultiTurnPartialSampler(run, registry)
    if rollout.multi_turn.enabled:
        multi_turn = MultiTurnSampler(run, registry)
        return RefillSampler(run, multi_turn) if refill else multi_turn
    if rollout.partial.enabled:
        return PartialSampler(run)
    if refill:
        return RefillSampler(run)
    return PlainSampler(run)


def restore_carried(sampler: StepSampler, state: Any, checkpoints: Path) -> None:
    """The rows a restored checkpoint (`state.carried`) carried into its next step, back in the sampler."""
    if not isinstance(sampler, CarryingSampler) or state.carried is None:
        return
    try:
        sampler.restore(state.carried)
    except ValueError as exc:
        raise UserError(f"checkpoint {checkpoints / str(state.step)}: {exc}") from None


__all__ = ["MultiTurnPartialSampler", "MultiTurnSampler", "PartialSampler", "PlainSampler", "RefillSampler",
           "restore_carried", "step_sampler"]
