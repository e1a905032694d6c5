"""`rollout.partial.slots: auto`: how many rows partial rollouts keep in flight.

A decode step reads every weight once for all its rows, so where the decode is bound by the
weights' bytes (an 8-bit rollout leaves room for more rows), more slots than a step's rows
give fewer, wider rounds per step. `auto` compiles the rollout's rounds at 1, 2 and 4 times a
step's rows (no more than a row's rounds: more slots would finish more rows a round than a
step trains), keeps the counts whose phases fit the device memory, and takes the one whose
rounds project fastest on the chip (costs.roofline; plan.projection.PartialRounds), the
fewest slots on a tie (rows carried longer are older). Decided by `grpo-run --plan --target`
and, with the same rule, by a run on TPU chips of a known generation before it is built;
elsewhere, with no chip to project on, it is a step's rows.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax

from grpo_core.config import RolloutConfig, RunConfig
from grpo_core.registry import Registry
from grpo_meshes import setup_processes

from grpo_runner_gsm8k.assembly.build import rows_per_step
from grpo_runner_gsm8k.costs.capacity import Capacity, device_capacity
from grpo_runner_gsm8k.costs.memory import PhaseMemory, peak
from grpo_runner_gsm8k.costs.tpu_target import Generation, generation_of
from grpo_runner_gsm8k.plan.abstract import PlanInputs, build_plan_inputs
from grpo_runner_gsm8k.plan.phases import decide_lora_rollout, kept_cache_bytes, rollout_phases, train_phase
from grpo_runner_gsm8k.plan.projection import project, seconds_text

SLOT_MULTIPLES = (1, 2, 4)


def with_slots(cfg: RunConfig, slots: int) -> RunConfig:
    partial = dataclasses.replace(cfg.rollout.partial, slots=slots)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, partial=partial))


def inputs_with_slots(inputs: PlanInputs, slots: int) -> PlanInputs:
    return dataclasses.replace(inputs, run=dataclasses.replace(inputs.run, cfg=with_slots(inputs.run.cfg, slots)))


def slot_candidates(rollout: RolloutConfig) -> list[int]:
    rounds = -(-rollout.max_new_tokens // rollout.partial.budget)
    return [rows_per_step(rollout) * m for m in SLOT_MULTIPLES if m == 1 or m <= rounds]


def wants_decision(rollout: RolloutConfig) -> bool:
    return rollout.partial.enabled and rollout.partial.slots == "auto"


def decide_slots(inputs: PlanInputs, capacity: Capacity, chip: Optional[Generation], tokens: int) -> PlanInputs:
    """`inputs` with rollout.partial.slots decided (unchanged unless it is `auto`); prints why."""
    if not wants_decision(inputs.run.cfg.rollout):
        return inputs
    if chip is None:
        return inputs_with_slots(inputs, rows_without_chip(inputs.run.cfg.rollout))
    return inputs_with_slots(inputs, fastest_slots(inputs, capacity, chip, tokens))


def rows_without_chip(rollout: RolloutConfig) -> int:
    rows = rows_per_step(rollout)
    print(f"rollout.partial.slots=auto: {rows} slots (a step's rows): no TPU chip of a known generation to "
          "project more on (grpo-run --plan --target SLICE shows what more would give)", flush=True)
    return rows


def fastest_slots(inputs: PlanInputs, capacity: Capacity, chip: Generation, tokens: int) -> int:
    """The candidate whose rollout projects fastest among those that fit (a step's rows if none does)."""
    projected = slot_seconds(inputs, capacity, chip, tokens)
    fitting = {slots: seconds for slots, seconds in projected.items() if seconds is not None}
    rows = rows_per_step(inputs.run.cfg.rollout)
    if not fitting:
        print(f"rollout.partial.slots=auto: {rows} slots (a step's rows): no count fits the device memory; "
              "grpo-run --plan shows by how much", flush=True)
        return rows
    best = min(fitting, key=lambda s: (fitting[s], s))
    listed = ", ".join(f"{s} slots {seconds_text(t)}" for s, t in fitting.items())
    left = [str(s) for s, t in projected.items() if t is None]
    skipped = f"; {', '.join(left)} slots over the memory" if left else ""
    print(f"rollout.partial.slots=auto: {best} slots, the fastest projected rollout of a step at {tokens} tokens "
          f"per row ({listed}{skipped})", flush=True)
    return best


def slot_seconds(inputs: PlanInputs, capacity: Capacity, chip: Generation, tokens: int) -> dict[int, Optional[float]]:
    """{candidate slots: a step's projected rollout seconds, None where a phase does not fit}."""
    fits = update_fit(inputs, capacity)
    return {slots: rounds_seconds(inputs_with_slots(inputs, slots), capacity, chip, tokens, fits)
            for slots in slot_candidates(inputs.run.cfg.rollout)}


def rounds_seconds(inputs: PlanInputs, capacity: Capacity, chip: Generation, tokens: int,
                   update_fits: Callable[[PlanInputs], bool]) -> Optional[float]:
    """A step's projected rollout seconds with the slots of `inputs`; None when a phase does not fit."""
    phases = rollout_phases(inputs, capacity)
    if any(p.refused for p in phases) or peak(phases).total > capacity.bytes or not update_fits(inputs):
        return None
    projection = project(inputs, chip, phases)
    if projection is None:
        return None
    return projection.rollout_rounds_seconds(tokens) + projection.decode_seconds(tokens)


def update_fit(inputs: PlanInputs, capacity: Capacity) -> Callable[[PlanInputs], bool]:
    """Whether the update still fits beside a candidate's KV cache kept across steps (which grows
    with the slots); always true when no cache is kept through the update."""
    if inputs.run.cfg.rollout.partial.kv_cache != "across_steps":
        return lambda candidate: True
    base = inputs_with_slots(inputs, rows_per_step(inputs.run.cfg.rollout))
    update: PhaseMemory = train_phase(base, inputs.run.cfg.train.micro_batch_size_per_device)
    rest = update.total - kept_cache_bytes(base)
    return lambda candidate: not update.refused and rest + kept_cache_bytes(candidate) <= capacity.bytes


def decided_slots(cfg: RunConfig, registry: Registry) -> RunConfig:
    """A run's config with `auto` slots decided before it is built: on TPU chips of a known
    generation by the plan's rule on these devices, else a step's rows."""
    if not wants_decision(cfg.rollout):
        return cfg
    setup_processes(cfg.mesh)  # a multi-host run joins before any device is read
    chip = generation_of(jax.devices()[0])
    if chip is None:
        return with_slots(cfg, rows_without_chip(cfg.rollout))
    capacity = dataclasses.replace(device_capacity(None), chip=chip)  # the devices' limit, as `--plan` reads it
    inputs = decide_lora_rollout(build_plan_inputs(cfg, registry), capacity)
    return with_slots(cfg, fastest_slots(inputs, capacity, chip, cfg.rollout.max_new_tokens))
