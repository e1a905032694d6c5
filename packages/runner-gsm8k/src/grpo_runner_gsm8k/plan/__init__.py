"""`grpo-run --plan`: per-device memory of a run, before any weight is loaded.

The rollout (prefill + decode) and the train step are compiled ahead of time at the
configured shapes, with abstract inputs only (shapes, dtypes and shardings; no weights,
no data), and the compiler's buffer assignment is read back. Without --target they
compile for this host's devices (on a CPU host: XLA:CPU's figures); with --target
they compile for a TPU slice with the TPU compiler (see tpu_target):

    grpo-run --config X.yaml --plan [--capacity-gib 31.25]
    grpo-run --config X.yaml --plan --target v6e-8 [--sweep micro_batch_size_per_device]

Exit codes: 0 fits, 2 bad input, 3 does not fit.
"""

from __future__ import annotations

import sys
from typing import Optional

from grpo_core.config import RunConfig
from grpo_core.registry import Registry

from grpo_runner_gsm8k.plan.abstract import (PlanInputs, abstract_run_model, abstract_update_batch, build_plan_inputs,
                                             per_device_bytes, plan_architecture, prompt_bucket, train_widths)
from grpo_runner_gsm8k.plan.capacity import GIB, Capacity, device_capacity
from grpo_runner_gsm8k.plan.phases import (compile_rollout, compile_update, decide_lora_rollout, fixed_phases,
                                           rollout_phases, train_phase, update_lowering)
from grpo_runner_gsm8k.plan.report import (EXIT_DOES_NOT_FIT, does_not_fit_message, footer_lines, header_lines, peak,
                                           peak_line, table_lines)
from grpo_runner_gsm8k.plan.scheduler import memory_minimizing_cpu_scheduler
from grpo_runner_gsm8k.plan.sweep import check_sweep_field, largest_fitting, micro_batch_candidates, sweep_micro_batch
from grpo_runner_gsm8k.tpu_target import parse_target

__all__ = ["EXIT_DOES_NOT_FIT", "GIB", "Capacity", "PlanInputs", "abstract_run_model", "abstract_update_batch",
           "build_plan_inputs", "compile_rollout", "compile_update", "largest_fitting", "micro_batch_candidates",
           "parse_target", "per_device_bytes", "plan_architecture", "plan_command", "plan_once", "prompt_bucket",
           "rollout_phases", "train_phase", "train_widths", "update_lowering"]

def plan_once(inputs: PlanInputs, capacity: Capacity) -> int:
    phases = fixed_phases(inputs, capacity) + [train_phase(inputs, inputs.run.cfg.train.micro_batch_size_per_device)]
    print("\n".join(header_lines(inputs) + table_lines(phases) + footer_lines(inputs)))
    print(peak_line(phases, capacity))
    top = peak(phases)
    if top.total <= capacity.bytes:
        return 0
    print(f"grpo-run: does not fit: {does_not_fit_message(top, capacity, inputs.run.cfg)}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def plan_command(cfg: RunConfig, registry: Registry, sweep: Optional[str] = None,
                 capacity_gib: Optional[float] = None, target: Optional[str] = None) -> int:
    """Prints the memory plan; 0 when the run fits, EXIT_DOES_NOT_FIT otherwise."""
    check_sweep_field(sweep)
    parsed = parse_target(target) if target is not None else None
    with memory_minimizing_cpu_scheduler():
        capacity = device_capacity(capacity_gib, parsed)
        inputs = decide_lora_rollout(build_plan_inputs(cfg, registry, parsed), capacity)
        if sweep:
            return sweep_micro_batch(inputs, capacity)
        return plan_once(inputs, capacity)
