"""`--sweep micro_batch_size_per_device`: the largest micro-batch size that fits."""

from __future__ import annotations

import json
import sys
from typing import Callable, Optional


from grpo_core.errors import UserError
from grpo_meshes import TRAIN_BATCH_AXES, batch_shard_count

from grpo_runner_gsm8k.assembly.build import rows_per_step
from grpo_runner_gsm8k.costs.capacity import GIB, Capacity
from grpo_runner_gsm8k.costs.memory import EXIT_DOES_NOT_FIT, PhaseMemory, does_not_fit_message, peak
from grpo_runner_gsm8k.plan.abstract import PlanInputs
from grpo_runner_gsm8k.plan.phases import train_phase, fixed_phases
from grpo_runner_gsm8k.plan.report import table_lines, header_lines, footer_lines


SWEEP_FIELDS = ("micro_batch_size_per_device", "model.remat")


def micro_batch_candidates(inputs: PlanInputs) -> list[int]:
    """Valid micro_batch_size_per_device values: divisors of the rows each data device holds."""
    mesh = inputs.run.mesh
    per_device = rows_per_step(inputs.run.cfg.rollout) // batch_shard_count(mesh, TRAIN_BATCH_AXES)
    return [size for size in range(1, per_device + 1) if per_device % size == 0]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> Optional[int]:
    """Binary search for the largest candidate that fits; memory grows with the micro-batch
    size, so everything below a fitting size fits too."""
    low, high, best = 0, len(candidates) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            best, low = candidates[middle], middle + 1
        else:
            high = middle - 1
    return best


def sweep_micro_batch(inputs: PlanInputs, capacity: Capacity) -> int:
    fixed = fixed_phases(inputs, capacity)
    print("\n".join(header_lines(inputs)))
    print(f"sweep micro_batch_size_per_device over {micro_batch_candidates(inputs)} against "
          f"{capacity.gib:.2f} GiB ({capacity.source}); rollout peak {peak(fixed).total / GIB:.3f} GiB")
    tried: dict[int, list[PhaseMemory]] = {}

    def fits(size: int) -> bool:
        tried[size] = fixed + [train_phase(inputs, size)]
        top = peak(tried[size])
        ok = top.total <= capacity.bytes
        print(f"  micro_batch_size_per_device={size}: train step {tried[size][-1].total / GIB:.3f} GiB, "
              f"peak {top.total / GIB:.3f} GiB ({top.name}): {'fits' if ok else 'does not fit'}", flush=True)
        return ok

    best = largest_fitting(micro_batch_candidates(inputs), fits)
    return report_sweep(inputs, capacity, best, tried, fixed)


def report_sweep(inputs: PlanInputs, capacity: Capacity, best: Optional[int],
                 tried: dict[int, list[PhaseMemory]], fixed: list[PhaseMemory]) -> int:
    if best is not None:
        print("\n".join(table_lines(tried[best]) + footer_lines(inputs)))
        print(f"largest micro_batch_size_per_device that fits: {best} (peak {peak(tried[best]).total / GIB:.3f} "
              f"GiB per device of {capacity.gib:.2f} GiB)")
    else:
        print(f"no micro_batch_size_per_device fits in {capacity.gib:.2f} GiB per device", file=sys.stderr)
    print(json.dumps({"sweep": "micro_batch_size_per_device", "largest_fitting": best,
                      "peak_gib": round(peak(tried[best]).total / GIB, 4) if best else None,
                      "capacity_gib": round(capacity.gib, 4),
                      "tried": {str(k): round(peak(v).total / GIB, 4) for k, v in sorted(tried.items())}}))
    if best is None:
        smallest = tried[min(tried)][-1]
        reason = (does_not_fit_message(peak(fixed), capacity, inputs.run.cfg.model.remat) if peak(fixed).total > capacity.bytes
                  else f"even micro_batch_size_per_device={min(tried)} needs {smallest.total / GIB:.2f} GiB per "
                       f"device: enable model.remat (dots or full), use more devices, or shorten the sequences")
        print(f"grpo-run: does not fit: {reason}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def check_sweep_field(sweep: Optional[str]) -> None:
    if sweep is not None and sweep not in SWEEP_FIELDS:
        raise UserError(f"--sweep {sweep!r} is not supported; supported: {', '.join(SWEEP_FIELDS)}")
