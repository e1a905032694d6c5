"""What one call of a compiled phase costs a device: matmul FLOPs, HBM bytes, collective bytes and
how many collectives it issues (each pays the chip's collective latency besides its bytes).

Read off the program the run executes (its HLO and buffer sizes), not XLA's `cost_analysis()`:
that counts a loop body once and, on TPU, counts VMEM traffic as memory traffic (a weight
prefetched into VMEM shows up ~3 times). HBM bytes here are a lower bound: what a call must
read and write once (its arguments and outputs; per iteration of a decode loop, the state the
loop carries: weights as the loop reads them, the KV cache, the sampler state). A carried array
the loop reads through slices of one layer (the KV cache: a segment of a segmented decode attends
over a static view of it, grpo_rollout.segments) counts the largest such slice's share of it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from grpo_core.hlo import HloModule, Instruction, shape_bytes

_ARRAY = re.compile(r"(\w+\[[\d,]*\])")

from grpo_runner_gsm8k.costs.tpu_target import Generation


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
    collectives: int = 0  # issued synchronously, loop bodies times their trip counts
    overlapped_collectives: int = 0
    setup_collectives: int = 0


@dataclass(frozen=True)
class Collectives:
    """Bytes and counts of the collectives one execution of a computation issues."""

    exposed_bytes: int
    overlapped_bytes: int
    exposed: int
    overlapped: int

    @property
    def total_bytes(self) -> int:
        return self.exposed_bytes + self.overlapped_bytes

    @property
    def total(self) -> int:
        return self.exposed + self.overlapped


def data_dependent_loop(module: HloModule) -> Optional[Instruction]:
    """The largest top-level while loop whose trip count the compiler does not know."""
    loops = [w for w in module.while_loops() if module.trip_count(w) is None and w.body()]
    return max(loops, key=lambda w: shape_bytes(w.shape), default=None)


def sliced_shares(module: HloModule) -> dict[str, float]:
    """{array type, e.g. 'bf16[2,8,256,2,128]': the largest share of it any slice of rank >= 4 reads},
    a slice of one layer (leading dimension 1) counted once per layer."""
    shares: dict[str, float] = {}
    for computation in module.computations.values():
        for inst in computation.instructions:
            if inst.op not in ("dynamic-slice", "slice") or not inst.operands:
                continue
            source, part = _ARRAY.findall(computation.shapes.get(inst.operands[0], "")), _ARRAY.findall(inst.shape)
            if len(source) != 1 or len(part) != 1 or source[0].count(",") < 3:
                continue
            full, read = (math.prod(int(d) for d in a[a.index("[") + 1:-1].split(",")) for a in (source[0], part[0]))
            one_layer = part[0].split("[")[1].startswith("1,")
            layers = int(source[0].split("[")[1].split(",")[0]) if one_layer else 1
            shares[source[0]] = max(shares.get(source[0], 0.0), min(1.0, read * layers / full))
    return shares


def carried_bytes_read(module: HloModule, loop: Instruction) -> int:
    """Bytes of a loop's carry one iteration reads: each array whole, but an array read through
    slices of rank >= 4 (a layer of the KV cache, through a segment's view) at their largest share."""
    shares = sliced_shares(module)
    return sum(round(shape_bytes(array) * shares.get(array, 1.0)) for array in _ARRAY.findall(loop.shape))


def collectives(module: HloModule, computation: str | None = None) -> Collectives:
    """The synchronous and asynchronous collectives of one execution of `computation`."""
    def total(figures: dict[str, int]) -> int:
        return sum(figures.values())

    return Collectives(*(total(module.collective_bytes(computation, overlapped=kind)) for kind in (False, True)),
                       *(total(module.collective_count(computation, overlapped=kind)) for kind in (False, True)))


def phase_cost(compiled: Any) -> PhaseCost:
    module = HloModule(compiled.as_text())
    kernels = sum(i.op == "custom-call" for c in module.computations.values() for i in c.instructions
                  if "tpu_custom_call" in i.attrs or "cudnn" in i.attrs)
    everything = collectives(module)
    loop = data_dependent_loop(module)
    if loop is None:
        stats = compiled.memory_analysis()
        return PhaseCost(module.matmul_flops(), stats.argument_size_in_bytes + stats.output_size_in_bytes,
                         everything.exposed_bytes, everything.overlapped_bytes, custom_calls=kernels,
                         collectives=everything.exposed, overlapped_collectives=everything.overlapped)
    body = collectives(module, loop.body())
    return PhaseCost(module.matmul_flops(loop.body()), carried_bytes_read(module, loop), body.exposed_bytes,
                     body.overlapped_bytes, per_iteration=True,
                     setup_collective_bytes=everything.total_bytes - body.total_bytes, custom_calls=kernels,
                     collectives=body.exposed, overlapped_collectives=body.overlapped,
                     setup_collectives=everything.total - body.total)


def roofline(chip: Generation, flops: float, hbm_bytes: float, exposed_bytes: float,
             overlapped_bytes: float = 0, exposed_count: int = 0, overlapped_count: int = 0) -> float:
    """Seconds on `chip`: the slowest of compute, HBM and overlapped collectives, plus the exposed ones;
    each collective takes the chip's latency plus its bytes over the ICI bandwidth."""
    ici, latency = chip.ici_gbps * 1e9, chip.collective_latency_us * 1e-6
    return max(flops / (chip.peak_tflops * 1e12), hbm_bytes / (chip.hbm_gbps * 1e9),
               overlapped_bytes / ici + overlapped_count * latency) + exposed_bytes / ici + exposed_count * latency


def call_seconds(chip: Generation, cost: PhaseCost, flops: float | None = None) -> float:
    """One call of a phase (one iteration of a decode loop) on `chip`; `flops` replaces the HLO's
    count (attention run in kernels added)."""
    return roofline(chip, cost.flops if flops is None else flops, cost.hbm_bytes, cost.collective_bytes,
                    cost.overlapped_collective_bytes, cost.collectives, cost.overlapped_collectives)


def setup_seconds(chip: Generation, cost: PhaseCost) -> float:
    """What runs once around a decode loop (a weight gather or reshard)."""
    return roofline(chip, 0, 0, cost.setup_collective_bytes, 0, cost.setup_collectives)


def decode_seconds(chip: Generation, compiled: Any, steps: int) -> float:
    """A compiled decode's projected seconds for `steps` tokens: what runs once around the loop
    plus `steps` iterations of its body."""
    cost = phase_cost(compiled)
    return setup_seconds(chip, cost) + steps * call_seconds(chip, cost)
