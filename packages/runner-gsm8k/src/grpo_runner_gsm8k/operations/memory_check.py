"""Memory checked before dispatch, on every backend.

Before a phase (rollout prefill and decode, log-probs, train step) first runs at a batch
shape, its program is compiled and the compiler's memory analysis is compared with what the
devices can give: an accelerator's `memory_stats()` limit, or on CPU the host's available
memory (MemAvailable) beside what the run already holds. A phase that would not fit stops
the run with `DoesNotFit` (exit 3) and the message `--plan` gives. The jit call that follows
finds the program in JAX's compilation cache, so nothing is compiled twice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import jax

from grpo_core.errors import DoesNotFit
from grpo_rollout.gather import every_process

from grpo_runner_gsm8k.costs.capacity import GIB, Capacity, device_capacity
from grpo_runner_gsm8k.costs.memory import PhaseMemory, does_not_fit_message

MEMINFO = Path("/proc/meminfo")


def host_available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (what the host can still give without swapping), or None."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def held_bytes_per_device() -> int:
    """The most bytes the run's live arrays occupy on any one local device."""
    held: dict[Any, int] = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def reports_limit(devices: list[Any]) -> bool:
    return all((stats := d.memory_stats()) and "bytes_limit" in stats for d in devices)


def run_capacity(held: int) -> Capacity:
    """Per-device memory a phase may use in all: the accelerator's limit, or on CPU the held
    bytes plus an equal share of the host's available memory."""
    devices = jax.local_devices()
    if reports_limit(devices):
        return device_capacity(None)
    available = host_available_bytes()
    if available is None:  # no /proc/meminfo: the plan's physical-memory share
        return device_capacity(None)
    return Capacity(held + available // len(devices),
                    f"host available memory {available / GIB:.2f} GiB / {len(devices)} CPU devices "
                    f"+ {held / GIB:.2f} GiB held by the run")


def signature(args: tuple, kwargs: dict) -> Any:
    """What makes JAX compile anew: the tree, and each array's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                       for x in leaves)


class MemoryGuard:
    """Checks each phase of a run before its first dispatch at each batch shape."""

    def __init__(self, remat: str):
        self.remat = remat  # model.remat, named in the does-not-fit advice
        self.checked: set[Any] = set()

    def check_compiled(self, name: str, compiled: Any) -> None:
        """Raises DoesNotFit when `compiled` needs more memory than the devices have."""
        stats = compiled.memory_analysis()
        if stats is None:  # a backend without the analysis: the run goes on unchecked, as before
            return
        held = held_bytes_per_device()
        phase = PhaseMemory.from_compiled(name, compiled)
        phase = dataclasses.replace(phase, other=max(held - phase.arguments, 0))  # state beside the arguments
        capacity = run_capacity(held)
        if not every_process(phase.total <= capacity.bytes):
            raise DoesNotFit(does_not_fit_message(phase, capacity, self.remat))

    def check(self, name: str, jitted: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Compiles `jitted` for these arguments (once per signature) and checks it."""
        key = (name, signature(args, kwargs))
        if key in self.checked:
            return
        self.check_compiled(name, jitted.lower(*args, **kwargs).compile())
        self.checked.add(key)
