"""The per-device memory a plan is checked against."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import jax

from grpo_core.errors import UserError

from grpo_runner_gsm8k.costs.tpu_target import HBM_SOURCE, Generation, Target


GIB = float(1 << 30)


@dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str  # where the number comes from, printed next to it
    chip: Optional[Generation] = None  # the target's chip, whose figures project times

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def device_capacity(capacity_gib: Optional[float], target: Optional[Target] = None) -> Capacity:
    """Per-device memory budget: the flag, what a target chip's programs may use, the accelerator's limit,
    or host memory shared by the local CPU devices."""
    chip = target.generation if target is not None else None
    if capacity_gib is not None:
        if capacity_gib <= 0:
            raise UserError(f"--capacity-gib {capacity_gib} must be > 0; give the per-device memory in GiB "
                            "(31.25 for a TPU v6e chip)")
        return Capacity(int(capacity_gib * GIB), "--capacity-gib", chip)
    if chip is not None:
        return Capacity(int(chip.usable_hbm_gib * GIB), f"{chip.name} usable HBM of {chip.hbm_gib:g} GiB: "
                                                         f"{chip.usable_source}; {HBM_SOURCE}", chip)
    devices = jax.local_devices()
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        return Capacity(min(s["bytes_limit"] for s in stats), f"{devices[0].device_kind} bytes_limit")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Capacity(host // len(devices), f"host memory {host / GIB:.2f} GiB / {len(devices)} CPU devices")
