"""`--plan --target SLICE --sweep model.remat`: the remat policy with the fastest projected update
among those whose step fits (the rollout does not depend on it, so it is compiled once)."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from grpo_core.config import RunConfig
from grpo_core.errors import UserError
from grpo_core.registry import Registry

from grpo_runner_gsm8k.plan.abstract import PlanInputs, build_plan_inputs
from grpo_runner_gsm8k.costs.capacity import GIB, Capacity
from grpo_runner_gsm8k.costs.memory import EXIT_DOES_NOT_FIT, PhaseMemory, peak
from grpo_runner_gsm8k.plan.phases import decide_lora_rollout, fixed_phases, train_phase
from grpo_runner_gsm8k.plan.projection import phase_time
from grpo_runner_gsm8k.costs.tpu_target import Generation, Target

REMAT_POLICIES = ("none", "dots", "full")


def with_remat(cfg: RunConfig, policy: str) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))


def remat_trial(inputs: PlanInputs, chip: Generation) -> tuple[PhaseMemory, Optional[float]]:
    """(train step memory, projected update seconds on `chip`, or None when the compiler refused it)
    of the plan `inputs` built with one remat policy."""
    phase = train_phase(inputs, inputs.run.cfg.train.micro_batch_size_per_device)
    return phase, None if phase.cost is None else phase_time(inputs, chip, phase).seconds


def sweep_remat(cfg: RunConfig, registry: Registry, target: Optional[Target], capacity: Capacity) -> int:
    if target is None:
        raise UserError("--sweep model.remat ranks policies by projected time, which needs --target SLICE "
                        "(e.g. --target v6e-8)")
    rollout = peak(fixed_phases(decide_lora_rollout(build_plan_inputs(cfg, registry, target), capacity), capacity))
    print(f"sweep model.remat over {', '.join(REMAT_POLICIES)} against {capacity.gib:.2f} GiB ({capacity.source}); "
          f"rollout peak {rollout.total / GIB:.3f} GiB; update time projected (lower bound, not a measurement)")
    tried = {}
    for policy in REMAT_POLICIES:
        phase, seconds = remat_trial(build_plan_inputs(with_remat(cfg, policy), registry, target), target.generation)
        fits = seconds is not None and max(phase.total, rollout.total) <= capacity.bytes
        tried[policy] = {"train_step_gib": round(phase.total / GIB, 4), "update_seconds": seconds, "fits": fits}
        print(f"  model.remat={policy}: train step {phase.total / GIB:.3f} GiB, update "
              f"{'refused' if seconds is None else f'{seconds:.3f} s'}: {'fits' if fits else 'does not fit'}", flush=True)
    fitting = {p: t["update_seconds"] for p, t in tried.items() if t["fits"]}
    best = min(fitting, key=fitting.get) if fitting else None
    print(f"fastest model.remat that fits: {best}" if best else "no model.remat policy fits")
    print(json.dumps({"sweep": "model.remat", "fastest_fitting": best, "capacity_gib": round(capacity.gib, 4),
                      "tried": tried}))
    return 0 if best else EXIT_DOES_NOT_FIT
