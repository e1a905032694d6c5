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
from typing import Any, Callable, Optional

import jax
from grpo_core.hlo import HloModule, Instruction, shape_bytes
from grpo_core.replica_groups import crosses_groups

_ARRAY = re.compile(r"(\w+\[[\d,]*\])")

from grpo_runner_gsm8k.costs.tpu_target import Generation


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


NO_COLLECTIVES = Collectives(0, 0, 0, 0)


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
    # Collectives whose device groups span slices: their traffic crosses the data-center network
    # (DCN). The figures above are then the others, within a slice (ICI).
    dcn: Collectives = NO_COLLECTIVES  # per call (per iteration of a decode loop)
    setup_dcn: Collectives = NO_COLLECTIVES


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


def collectives(module: HloModule, computation: str | None = None,
                where: Callable[[Instruction], bool] | None = None) -> Collectives:
    """The synchronous and asynchronous collectives of one execution of `computation` (those
    `where` accepts)."""
    def total(figures: dict[str, int]) -> int:
        return sum(figures.values())

    return Collectives(*(total(module.collective_bytes(computation, overlapped=kind, where=where))
                         for kind in (False, True)),
                       *(total(module.collective_count(computation, overlapped=kind, where=where))
                         for kind in (False, True)))


def minus(whole: Collectives, part: Collectives) -> Collectives:
    return Collectives(whole.exposed_bytes - part.exposed_bytes, whole.overlapped_bytes - part.overlapped_bytes,
                       whole.exposed - part.exposed, whole.overlapped - part.overlapped)


def program_slices(compiled: Any) -> Optional[list[int]]:
    """The slice of each device of a compiled program, in partition order (the order of its
    device assignment, which the HLO's replica groups number); None on one slice."""
    leaves = jax.tree.leaves(getattr(compiled, "input_shardings", None))
    devices = next((leaf._device_assignment for leaf in leaves if hasattr(leaf, "_device_assignment")), ())
    slices = [getattr(device, "slice_index", None) for device in devices]
    return slices if len({s for s in slices if s is not None}) > 1 else None


def split_collectives(module: HloModule, computation: str | None,
                      slices: Optional[list[int]]) -> tuple[Collectives, Collectives]:
    """(within a slice, across slices) collectives of one execution of `computation`: those whose
    replica groups span `slices` (a program partitioned over every slice's devices), plus the TPU
    compiler's transfers between slices (its program is one slice's; they count as synchronous)."""
    everything = collectives(module, computation)
    across = collectives(module, computation, crosses_groups(slices)) if slices else NO_COLLECTIVES
    sent, transfers = module.dcn_transfers(computation)
    return minus(everything, across), Collectives(across.exposed_bytes + sent, across.overlapped_bytes,
                                                  across.exposed + transfers, across.overlapped)


def phase_cost(compiled: Any) -> PhaseCost:
    module, slices = HloModule(compiled.as_text()), program_slices(compiled)
    kernels = sum(i.op == "custom-call" for c in module.computations.values() for i in c.instructions
                  if "tpu_custom_call" in i.attrs or "cudnn" in i.attrs)
    ici, dcn = split_collectives(module, None, slices)
    loop = data_dependent_loop(module)
    if loop is None:
        stats = compiled.memory_analysis()
        return PhaseCost(module.matmul_flops(), stats.argument_size_in_bytes + stats.output_size_in_bytes,
                         ici.exposed_bytes, ici.overlapped_bytes, custom_calls=kernels,
                         collectives=ici.exposed, overlapped_collectives=ici.overlapped, dcn=dcn)
    body, body_dcn = split_collectives(module, loop.body(), slices)
    return PhaseCost(module.matmul_flops(loop.body()), carried_bytes_read(module, loop), body.exposed_bytes,
                     body.overlapped_bytes, per_iteration=True,
                     setup_collective_bytes=ici.total_bytes - body.total_bytes, custom_calls=kernels,
                     collectives=body.exposed, overlapped_collectives=body.overlapped,
                     setup_collectives=ici.total - body.total, dcn=body_dcn,
                     setup_dcn=Collectives(dcn.total_bytes - body_dcn.total_bytes, 0, dcn.total - body_dcn.total, 0))


def link_seconds(bytes_: float, count: int, gbps: float, latency_us: float) -> float:
    """Collectives over one kind of link: their bytes over its bandwidth plus a latency each."""
    return bytes_ / (gbps * 1e9) + count * latency_us * 1e-6


def dcn_chip_gbps(chip: Generation) -> float:
    """A chip's share of its host's data-center network bandwidth, GB/s."""
    return chip.dcn_host_gbps / chip.host_chips


def roofline(chip: Generation, flops: float, hbm_bytes: float, exposed_bytes: float,
             overlapped_bytes: float = 0, exposed_count: int = 0, overlapped_count: int = 0,
             dcn: Collectives = NO_COLLECTIVES) -> float:
    """Seconds on `chip`: the slowest of compute, HBM and overlapped collectives, plus the exposed ones;
    each collective takes the chip's latency plus its bytes over the ICI bandwidth, or, for `dcn`
    (across slices), the DCN latency plus its bytes over the chip's share of its host's DCN bandwidth."""
    ici = lambda size, count: link_seconds(size, count, chip.ici_gbps, chip.collective_latency_us)  # noqa: E731
    net = lambda size, count: link_seconds(size, count, dcn_chip_gbps(chip), chip.dcn_latency_us)  # noqa: E731
    return (max(flops / (chip.peak_tflops * 1e12), hbm_bytes / (chip.hbm_gbps * 1e9),
                ici(overlapped_bytes, overlapped_count), net(dcn.overlapped_bytes, dcn.overlapped))
            + ici(exposed_bytes, exposed_count) + net(dcn.exposed_bytes, dcn.exposed))


def call_seconds(chip: Generation, cost: PhaseCost, flops: float | None = None) -> float:
    """One call of a phase (one iteration of a decode loop) on `chip`; `flops` replaces the HLO's
    count (attention run in kernels added)."""
    return roofline(chip, cost.flops if flops is None else flops, cost.hbm_bytes, cost.collective_bytes,
                    cost.overlapped_collective_bytes, cost.collectives, cost.overlapped_collectives, cost.dcn)


def setup_seconds(chip: Generation, cost: PhaseCost) -> float:
    """What runs once around a decode loop (a weight gather or reshard)."""
    return roofline(chip, 0, 0, cost.setup_collective_bytes, 0, cost.setup_collectives, dcn=cost.setup_dcn)


def decode_seconds(chip: Generation, compiled: Any, steps: int) -> float:
    """A compiled decode's projected seconds for `steps` tokens: what runs once around the loop
    plus `steps` iterations of its body."""
    cost = phase_cost(compiled)
    return setup_seconds(chip, cost) + steps * call_seconds(chip, cost)
