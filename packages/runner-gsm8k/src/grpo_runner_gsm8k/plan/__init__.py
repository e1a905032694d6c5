"""`grpo-run --plan`: per-device memory of a run, before any weight is loaded.

The rollout (prefill + decode) and the train step are compiled ahead of time at the
configured shapes, with abstract inputs only (shapes, dtypes and shardings; no weights,
no data), and the compiler's buffer assignment is read back. Without --target they
compile for this host's devices (on a CPU host: XLA:CPU's figures); with --target
they compile for a TPU slice with the TPU compiler (see tpu_target):

    grpo-run --config X.yaml --plan [--capacity-gib 31.25]
    grpo-run --config X.yaml --plan --target v6e-8 [--sweep micro_batch_size_per_device]
    grpo-run --config X.yaml --plan --target v6e-8 [--expect-completion-tokens 300] [--chip hbm_gbps=1500]
    grpo-run --config X.yaml --plan --target v6e-8 --chip collective_latency_us=10
    grpo-run --config X.yaml --plan --target v6e-8 --sweep model.remat

With --target the plan also projects the time of a step per phase (plan.projection): a lower
bound from the compiled programs and the chip's published figures, not a measurement.

Exit codes: 0 fits, 2 bad input, 3 does not fit.
"""

from __future__ import annotations

import sys
from typing import Optional

from grpo_core.config import RunConfig
from grpo_core.errors import UserError
from grpo_core.registry import Registry

from grpo_runner_gsm8k.plan.abstract import (PlanInputs, abstract_run_model, abstract_update_batch, build_plan_inputs,
                                             per_device_bytes, plan_architecture, prompt_bucket, train_widths)
from grpo_runner_gsm8k.costs.capacity import GIB, Capacity, device_capacity
from grpo_runner_gsm8k.costs.memory import EXIT_DOES_NOT_FIT, does_not_fit_message, peak, peak_line
from grpo_runner_gsm8k.plan.phases import (compile_rollout, compile_update, decide_lora_rollout, fixed_phases,
                                           rollout_phases, train_phase, update_lowering)
from grpo_runner_gsm8k.plan.report import footer_lines, header_lines, table_lines
from grpo_runner_gsm8k.plan.projection import project, projection_json, projection_lines
from grpo_runner_gsm8k.plan.remat import sweep_remat
from grpo_runner_gsm8k.plan.scheduler import memory_minimizing_cpu_scheduler
from grpo_runner_gsm8k.plan.slots import decide_slots, wants_decision
from grpo_runner_gsm8k.plan.sweep import check_sweep_field, largest_fitting, micro_batch_candidates, sweep_micro_batch
from grpo_runner_gsm8k.costs.tpu_target import Generation, parse_target, with_chip

__all__ = ["EXIT_DOES_NOT_FIT", "GIB", "Capacity", "PlanInputs", "abstract_run_model", "abstract_update_batch",
           "build_plan_inputs", "compile_rollout", "compile_update", "largest_fitting", "micro_batch_candidates",
           "parse_target", "per_device_bytes", "plan_architecture", "plan_command", "plan_once", "prompt_bucket",
           "rollout_phases", "train_phase", "train_widths", "update_lowering"]

def plan_once(inputs: PlanInputs, capacity: Capacity, chip: Optional[Generation] = None,
              lengths: tuple[int, ...] = ()) -> int:
    """Prints the memory plan (and, for a TPU `chip`, the projected step at each completion length)."""
    phases = fixed_phases(inputs, capacity) + [train_phase(inputs, inputs.run.cfg.train.micro_batch_size_per_device)]
    print("\n".join(header_lines(inputs) + table_lines(phases) + footer_lines(inputs)))
    print(peak_line(phases, capacity))
    projection = project(inputs, chip, phases) if chip else None
    if projection:
        print("\n".join(projection_lines(projection, list(lengths))))
        print(projection_json(projection, list(lengths)))
    top = peak(phases)
    if top.total <= capacity.bytes:
        return 0
    print(f"grpo-run: does not fit: {does_not_fit_message(top, capacity, inputs.run.cfg.model.remat)}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def plan_command(cfg: RunConfig, registry: Registry, sweep: Optional[str] = None,
                 capacity_gib: Optional[float] = None, target: Optional[str] = None, chip: Optional[str] = None,
                 expect_tokens: Optional[int] = None) -> int:
    """Prints the memory plan; 0 when the run fits, EXIT_DOES_NOT_FIT otherwise."""
    check_sweep_field(sweep)
    parsed = parse_target(target) if target is not None else None
    parsed = with_chip(parsed, chip) if parsed and chip else parsed
    lengths = completion_lengths(cfg.rollout.max_new_tokens, expect_tokens)
    with memory_minimizing_cpu_scheduler():
        capacity = device_capacity(capacity_gib, parsed)
        if sweep == "model.remat":
            if wants_decision(cfg.rollout):
                raise UserError("--sweep model.remat with rollout.partial.slots=auto: the slots are decided per "
                                "plan; plan without --sweep to decide them, then set rollout.partial.slots")
            return sweep_remat(cfg, registry, parsed, capacity)
        inputs = decide_lora_rollout(build_plan_inputs(cfg, registry, parsed), capacity)
        inputs = decide_slots(inputs, capacity, parsed.generation if parsed else None, lengths[-1])
        if sweep:
            return sweep_micro_batch(inputs, capacity)
        return plan_once(inputs, capacity, parsed.generation if parsed else None, lengths)


def completion_lengths(most: int, expect_tokens: Optional[int]) -> tuple[int, ...]:
    """The completion lengths a projection is given for: the maximum (rollout.max_new_tokens), and
    the expected one if asked."""
    if expect_tokens is not None and not 1 <= expect_tokens <= most:
        raise UserError(f"--expect-completion-tokens {expect_tokens} must be between 1 and rollout.max_new_tokens "
                        f"({most}); give the mean completion length you expect")
    return (most,) if expect_tokens in (None, most) else (most, expect_tokens)
