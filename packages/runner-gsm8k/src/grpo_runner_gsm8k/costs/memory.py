"""What a compiled phase holds on a device, and the message when it does not fit.

Shared by the planner (`grpo-run --plan`) and the run's memory check before each phase
dispatches, so both say the same thing about the same program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from grpo_runner_gsm8k.costs.capacity import GIB, Capacity
from grpo_runner_gsm8k.costs.roofline import PhaseCost, phase_cost

EXIT_DOES_NOT_FIT = 3  # grpo-run's exit code when a phase needs more memory than the devices have


@dataclass(frozen=True)
class PhaseMemory:
    """Per-device bytes of one compiled phase.

    `aliased` outputs reuse donated argument buffers; `other` is state alive on the
    device during the phase that is not one of its arguments (the optimizer state and
    the float32 masters during the rollout, which runs on their compute-dtype copy;
    the reference params when loss.beta > 0; the teacher's params with a teacher).
    """

    name: str
    arguments: int
    outputs: int
    aliased: int
    temp: int
    other: int = 0
    refused: bool = False  # the compiler refused it for HBM; temp is the size it reported
    note: str = ""  # printed under the table
    cost: Optional[PhaseCost] = None  # what one call costs a device (None when refused)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temp + self.other

    @classmethod
    def from_compiled(cls, name: str, compiled: Any, other: int = 0) -> "PhaseMemory":
        stats = compiled.memory_analysis()
        return cls(name, stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                   stats.temp_size_in_bytes, other, cost=phase_cost(compiled))


def peak(phases: list[PhaseMemory]) -> PhaseMemory:
    return max(phases, key=lambda p: p.total)


def peak_line(phases: list[PhaseMemory], capacity: Capacity) -> str:
    top = peak(phases)
    verdict = "fits" if top.total <= capacity.bytes else "DOES NOT FIT"
    return (f"peak: {top.total / GIB:.3f} GiB per device ({top.name}) of {capacity.gib:.2f} GiB "
            f"({capacity.source}): {verdict}, {100 * top.total / capacity.bytes:.0f}% used")


def does_not_fit_message(phase: PhaseMemory, capacity: Capacity, remat: str) -> str:
    memory = "HBM" if "HBM" in capacity.source else "capacity"
    needs = (f"{phase.name} needs {phase.total / GIB:.2f} GiB per device, exceeds {memory} by "
             f"{(phase.total - capacity.bytes) / GIB:.2f} GiB (capacity {capacity.gib:.2f} GiB)")
    if phase.name.startswith("rollout"):
        return (f"{needs}: lower rollout.prompts_per_step, rollout.n or rollout.max_new_tokens, set "
                "rollout.options.cache_dtype=bfloat16, or use more devices")
    remedy = {"none": " or enable model.remat (dots or full)", "dots": " or set model.remat=full"}
    return (f"{needs}: lower train.micro_batch_size_per_device (largest that fits: run --sweep "
            f"micro_batch_size_per_device){remedy.get(remat, '')}")
