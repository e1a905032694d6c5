"""What one call of a compiled phase costs a device: matmul FLOPs, HBM bytes, collective bytes.

Read off the program the run executes (its HLO and buffer sizes), not XLA's `cost_analysis()`:
that counts a loop body once and, on TPU, counts VMEM traffic as memory traffic (a weight
prefetched into VMEM shows up ~3 times). HBM bytes here are a lower bound: what a call must
read and write once (its arguments and outputs; per iteration of a decode loop, the state the
loop carries: weights as the loop reads them, the KV cache, the sampler state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from grpo_core.hlo import HloModule, Instruction, shape_bytes

from grpo_runner_gsm8k.tpu_target import Generation


@dataclass(frozen=True)
class PhaseCost:
    """Per device. For a program built around a loop that runs until its data says stop (the
    decode), `flops`, `hbm_bytes` and `collective_bytes` are one iteration's and `setup_collective_bytes`
    what runs once around it (the weights gathered once per rollout)."""

    flops: float  # matmul FLOPs, every loop body times its trip count
    hbm_bytes: int
    collective_bytes: int  # issued synchronously: compute waits for them
    overlapped_collective_bytes: int = 0  # issued asynchronously, overlapping compute
    per_iteration: bool = False
    setup_collective_bytes: int = 0
    custom_calls: int = 0  # kernels (Pallas, cuDNN) whose work the HLO does not show


def data_dependent_loop(module: HloModule) -> Optional[Instruction]:
    """The largest top-level while loop whose trip count the compiler does not know."""
    loops = [w for w in module.while_loops() if module.trip_count(w) is None and w.body()]
    return max(loops, key=lambda w: shape_bytes(w.shape), default=None)


def collective_split(module: HloModule, computation: str | None = None) -> tuple[int, int]:
    """(synchronous, asynchronous) collective bytes of one execution of `computation`."""
    return tuple(sum(module.collective_bytes(computation, overlapped=kind).values()) for kind in (False, True))


def phase_cost(compiled: Any) -> PhaseCost:
    module = HloModule(compiled.as_text())
    kernels = sum(i.op == "custom-call" for c in module.computations.values() for i in c.instructions
                  if "tpu_custom_call" in i.attrs or "cudnn" in i.attrs)
    everything = collective_split(module)
    loop = data_dependent_loop(module)
    if loop is None:
        stats = compiled.memory_analysis()
        return PhaseCost(module.matmul_flops(), stats.argument_size_in_bytes + stats.output_size_in_bytes,
                         *everything, custom_calls=kernels)
    per_iteration = collective_split(module, loop.body())
    return PhaseCost(module.matmul_flops(loop.body()), shape_bytes(loop.shape), *per_iteration, per_iteration=True,
                     setup_collective_bytes=sum(everything) - sum(per_iteration), custom_calls=kernels)


def roofline(chip: Generation, flops: float, hbm_bytes: float, exposed_bytes: float,
             overlapped_bytes: float = 0) -> float:
    """Seconds on `chip`: the slowest of compute, HBM and overlapped collectives, plus the exposed ones."""
    ici = chip.ici_gbps * 1e9
    return max(flops / (chip.peak_tflops * 1e12), hbm_bytes / (chip.hbm_gbps * 1e9), overlapped_bytes / ici) + (
        exposed_bytes / ici)


def decode_seconds(chip: Generation, compiled: Any, steps: int) -> float:
    """A compiled decode's projected seconds for `steps` tokens: what runs once around the loop
    (a weight gather or reshard) plus `steps` iterations of its body."""
    cost = phase_cost(compiled)
    step = roofline(chip, cost.flops, cost.hbm_bytes, cost.collective_bytes, cost.overlapped_collective_bytes)
    return roofline(chip, 0, 0, cost.setup_collective_bytes) + steps * step
