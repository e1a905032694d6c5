"""`gather_weights: auto`: gather FSDP-sharded weights once per rollout when the copy fits.

With weights sharded over the devices, XLA keeps them in place in the decode loop and
runs collectives for every decoded token (for a 3B model on 8 chips, ~0.7 GB of
all-gathers per token). Gathering them once before the loop removes that traffic but
needs a full compute-dtype copy per device. `auto` compiles the gathered decode for the
batch and takes it when what the call needs beyond its resident arguments (temporaries
plus non-donated outputs) fits in every device's memory with GATHER_HEADROOM of it left
free (the gather is an optimisation: it must not bring a run to the edge of an OOM);
`grpo-run --plan` applies the same rule against the device capacity.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from grpo_rollout.decode import decode
from grpo_rollout.head_parallel import LayoutUnsupported
from grpo_rollout.model_parallel import holds_experts
from grpo_rollout.segments import segmented_seconds

GIB = 1 << 30
GATHER_HEADROOM = 0.10  # fraction of a device's memory the gathered decode must leave free


def has_sharded_weights(weights: Any) -> bool:
    """Some leaf is split over devices (so the decode loop would gather or reduce it per token)."""
    return any(isinstance(leaf.sharding, NamedSharding) and not leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(weights) if hasattr(leaf, "sharding"))


def spare_bytes(limit: int, resident: int) -> int:
    """What a call may still take of a device with `limit` bytes, `resident` of them in use,
    keeping GATHER_HEADROOM of the limit free. The `auto` rule, for the run (limit and use
    as the devices report them) and for `grpo-run --plan` (the capacity, the phase's
    arguments and the state held beside it): gather when the gathered decode's
    `bytes_beyond_arguments` is at most this."""
    return int(limit * (1 - GATHER_HEADROOM)) - resident


def spare_device_bytes(devices: list[Any]) -> Optional[int]:
    """The least `spare_bytes` over `devices`; None when a device reports no limit (the CPU backend)."""
    spare = []
    for device in devices:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        spare.append(spare_bytes(stats["bytes_limit"], stats.get("bytes_in_use", 0)))
    return min(spare)


def bytes_beyond_arguments(compiled: Any) -> int:
    """Device memory a compiled call needs besides its arguments, which are already resident."""
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes


def every_process(flag: bool) -> bool:
    """`flag` and-ed over all processes: a multi-host run compiles one program everywhere."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.array(flag))))


def gather_refused_note(gathered: Any, spare: Optional[int]) -> str:
    """Why a plan's auto decode keeps the weights sharded (a prefix of the decode's note)."""
    if gathered is None:
        return "gather_weights=auto: sharded weights (the compiler refused a gathered decode for memory); "
    if spare is None:
        return "gather_weights=auto: sharded weights (no device capacity to check a gathered copy against); "
    needed = bytes_beyond_arguments(gathered)
    return (f"gather_weights=auto: sharded weights (a gathered decode needs {needed / GIB:.2f} "
            f"GiB beyond its arguments, {spare / GIB:.2f} GiB spare with {GATHER_HEADROOM:.0%} of device memory "
            "kept free); ")


# How the decode loop holds FSDP-sharded weights: the static arguments of `decode` for each.
# The split layouts (gather_weights values): their `model_parallel` static argument.
SPLIT_LAYOUTS = {"model_parallel": True, "head_parallel": "heads", "expert_parallel": "experts"}
LAYOUTS = {"gathered": {"gather_weights": True, "model_parallel": False},
           "sharded": {"gather_weights": False, "model_parallel": False},
           **{name: {"gather_weights": False, "model_parallel": split} for name, split in SPLIT_LAYOUTS.items()}}

# projector(compiled decode, decode steps) -> projected seconds on the devices, or None.
Projector = Callable[[Any, int], Optional[float]]


def layout_static(static: dict[str, Any], layout: str) -> dict[str, Any]:
    return {**static, **LAYOUTS[layout]}


def candidate_layouts(static: dict[str, Any], weights: Any) -> tuple[str, ...]:
    """The layouts `auto` compares: the split ones run the rollout's own decode step only, the
    expert-parallel one a mixture-of-experts model's only."""
    own_step = static.get("attention") == "rollout"
    return tuple(name for name in LAYOUTS if name not in SPLIT_LAYOUTS or
                 (own_step and (name != "expert_parallel" or holds_experts(weights))))


def compile_unless_unsupported(compile_layout: Callable[[], Any]) -> Any:
    """The compiled decode, or None where the layout cannot split this model or batch (the
    head-parallel decode needs whole prompts per row group and MLP columns split evenly)."""
    try:
        return compile_layout()
    except LayoutUnsupported:
        return None


def fastest_layout(compile_layout: Callable[[str], Any], fits: Callable[[Any], bool], seconds: Callable[[Any], float],
                   layouts: tuple[str, ...], steps: int) -> tuple[str, Any, str]:
    """(layout, compiled, note): the fastest projected decode among those the compiler took
    and that fit (the sharded one always fits: it is how the weights are stored)."""
    projected, compiled = {}, {}
    for layout in layouts:
        program = compile_layout(layout)
        if program is not None and (layout == "sharded" or fits(program)):
            compiled[layout], projected[layout] = program, seconds(program)
    if not projected:
        return "sharded", None, "gather_weights=auto: every decode layout was refused for memory"
    best = min(projected, key=projected.get)
    listed = ", ".join(f"{name} {projected[name]:.2f} s" for name in projected)
    left = [name for name in layouts if name not in projected]
    skipped = f"; {', '.join(left)} refused or over the spare memory" if left else ""
    return best, compiled[best], (f"gather_weights=auto: {best} weights, the fastest projected decode of {steps} "
                                  f"steps ({listed}{skipped})")


class AutoDecoders:
    """The compiled decode `auto` picks per batch signature, or None for the jitted sharded one
    (the decode of the whole cache: a segmented decode runs its earlier segments in its `layout`).

    Without a projector (CPU, GPU): the gathered decode when it fits. With one (set by the
    run for TPU chips of a known generation): the fastest projected of the gathered,
    sharded and model-parallel decodes that fit, the rule `grpo-run --plan --target` uses."""

    def __init__(self) -> None:
        self._by_signature: dict[Any, tuple[Optional[str], Optional[Callable[..., Any]]]] = {}
        self.projector: Optional[Projector] = None

    def get(self, weights, cache, state, key, static: dict[str, Any], segments: int = 1) -> Optional[Callable[..., Any]]:
        """segments: the decode runs as that many calls (grpo_rollout.segments), each paying the setup."""
        signature = self._signature(cache, state, static)
        if signature not in self._by_signature:  # decided once: no tree walk per rollout
            sharding = static.get("batch_sharding")
            chosen = (None, None)
            if sharding is not None and has_sharded_weights(weights):  # else nothing to gather
                chosen = (self._fastest(weights, cache, state, key, static, sharding, segments) if self.projector
                          else self._compile_if_fits(weights, cache, state, key, static, sharding))
            self._by_signature[signature] = chosen
        return self._by_signature[signature][1]

    def layout(self, cache, state, static: dict[str, Any]) -> Optional[str]:
        """The layout `get` chose for these arguments (a key of LAYOUTS); None: the static arguments' own."""
        return self._by_signature.get(self._signature(cache, state, static), (None, None))[0]

    @staticmethod
    def _signature(cache, state, static: dict[str, Any]) -> Any:
        return (tuple(leaf.shape for leaf in jax.tree.leaves(cache)), state.tokens.shape,
                tuple(sorted(static.items(), key=lambda kv: kv[0])))

    def _fastest(self, weights, cache, state, key, static, sharding: NamedSharding, segments: int) -> tuple[str, Any]:
        spare = spare_device_bytes(list(sharding.mesh.local_devices))
        steps = static["params"].max_new_tokens - 1
        layout, compiled, note = fastest_layout(
            lambda name: compile_unless_unsupported(
                lambda: decode.lower(weights, cache, state, key, **layout_static(static, name)).compile()),
            lambda program: every_process(spare is not None and bytes_beyond_arguments(program) <= spare),
            lambda program: segmented_seconds(self.projector, program, steps, segments),
            candidate_layouts(static, weights), steps)
        print(f"rollout: {note}", flush=True)
        return layout, compiled

    @staticmethod
    def _compile_if_fits(weights, cache, state, key, static, sharding: NamedSharding) -> tuple[Optional[str], Any]:
        shape = f"{state.tokens.shape[0]} rows x {cache.max_len} cache slots"
        spare = spare_device_bytes(list(sharding.mesh.local_devices))
        if not every_process(spare is not None):
            print(f"rollout: gather_weights=auto: sharded weights for the decode of {shape} "
                  "(the devices report no memory limit to check a gathered copy against)", flush=True)
            return None, None
        compiled = decode.lower(weights, cache, state, key, **{**static, "gather_weights": True}).compile()
        needed = bytes_beyond_arguments(compiled)
        fits = every_process(needed <= spare)
        print(f"rollout: gather_weights=auto: {'gathered' if fits else 'sharded'} weights for the decode of {shape} "
              f"(gathered needs {needed / GIB:.2f} GiB beyond its arguments, {spare / GIB:.2f} GiB spare with "
              f"{GATHER_HEADROOM:.0%} of device memory kept free)", flush=True)
        return ("gathered", compiled) if fits else (None, None)

