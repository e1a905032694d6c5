"""The phases of a step compiled on abstract inputs, with the compiler's memory figures."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from grpo_core.errors import UserError
from grpo_meshes import rollout_batch_sharding
from grpo_rollout.collectives import decode_collective_bytes_per_token
from grpo_rollout.decode import decode, prefill
from grpo_rollout.gather import GATHER_HEADROOM, bytes_beyond_arguments, has_sharded_weights, spare_bytes

from grpo_runner_gsm8k.build import rows_per_step
from grpo_runner_gsm8k.plan.capacity import GIB, Capacity
from grpo_runner_gsm8k.plan.abstract import (PlanInputs, per_device_bytes, abstract_array, abstract_outputs,
                                             abstract_key, prompt_bucket, abstract_update_batch)


@dataclass(frozen=True)
class PhaseMemory:
    """Per-device bytes of one compiled phase.

    `aliased` outputs reuse donated argument buffers; `other` is state alive on the
    device during the phase that is not one of its arguments (the optimizer state and
    the float32 masters during the rollout, which runs on their compute-dtype copy;
    the reference params when loss.beta > 0).
    """

    name: str
    arguments: int
    outputs: int
    aliased: int
    temp: int
    other: int = 0
    refused: bool = False  # the compiler refused it for HBM; temp is the size it reported
    note: str = ""  # printed under the table

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temp + self.other

    @classmethod
    def from_compiled(cls, name: str, compiled: Any, other: int = 0) -> "PhaseMemory":
        stats = compiled.memory_analysis()
        return cls(name, stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes,
                   stats.temp_size_in_bytes, other)


# The TPU compiler refuses a program whose buffers exceed the chip's HBM, giving the size.
_HBM_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED:.*?required for HLO temporaries \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def compile_phase(name: str, lower: Callable[..., Any], args: tuple, other: int = 0) -> tuple[PhaseMemory, Any]:
    """(memory, compiled) of `lower(*args).compile()`; when the compiler refuses it for
    HBM, the memory it reported needing (temporaries) beside the arguments, and None."""
    try:
        compiled = lower(*args).compile()
    except jax.errors.JaxRuntimeError as exc:
        if "Mosaic" in str(exc):
            first = " ".join(str(exc).strip().splitlines()[0].split())[:300]
            raise UserError(f"{name}: the TPU compiler rejected a Pallas kernel ({first}); with loss.impl: pallas "
                            "change loss.options.block_size / time_block") from None
        match = _HBM_EXHAUSTED.search(str(exc))
        if not match:
            raise
        temp = int(float(match.group(1)) * _UNITS[match.group(2)])
        return PhaseMemory(name, per_device_bytes(args), 0, 0, temp, other, refused=True), None
    return PhaseMemory.from_compiled(name, compiled, other), compiled


def rollout_inputs(inputs: PlanInputs) -> tuple[dict, Any, Any]:
    """(static args, abstract prompts, abstract key) of one rollout batch (rows = prompts_per_step * n)."""
    cfg, mesh = inputs.cfg, inputs.mesh
    batch_sharding = rollout_batch_sharding(mesh, cfg.rollout.sharding)
    prompts = abstract_array((rows_per_step(cfg), prompt_bucket(inputs)), jnp.int32, batch_sharding)
    static = inputs.rollout.static_args(inputs.graphdef, inputs.forward_params, inputs.program.sampling, 0,
                                        batch_sharding)
    return static, prompts, abstract_key(mesh)


def compile_rollout(inputs: PlanInputs) -> tuple[Any, Any]:
    """(prefill, decode) compiled for one rollout batch."""
    static, prompts, key = rollout_inputs(inputs)
    prefill_compiled = prefill.lower(inputs.forward_params, prompts, prompts, key, **static).compile()
    cache, state = abstract_outputs(prefill_compiled)
    return prefill_compiled, decode.lower(inputs.forward_params, cache, state, key, **static).compile()


def rollout_phases(inputs: PlanInputs, capacity: Capacity) -> list[PhaseMemory]:
    """Prefill and decode of one rollout batch; decode is skipped when prefill does not fit."""
    static, prompts, key = rollout_inputs(inputs)
    first, compiled = compile_phase("rollout prefill", functools.partial(prefill.lower, **static),
                                    (inputs.forward_params, prompts, prompts, key), inputs.held_beside_rollout)
    if compiled is None:
        return [first]  # decode's inputs are prefill's outputs
    cache, state = abstract_outputs(compiled)
    return [first, decode_phase(inputs, static, (inputs.forward_params, cache, state, key), capacity)]


def decode_phase(inputs: PlanInputs, static: dict[str, Any], args: tuple, capacity: Capacity) -> PhaseMemory:
    """The decode loop as the run executes it: with gather_weights=auto, gathered when the
    gathered decode leaves GATHER_HEADROOM of the capacity free (grpo_rollout.gather applies
    the same rule on devices)."""
    def compile_decode(gather: bool) -> tuple[PhaseMemory, Any]:
        lower = functools.partial(decode.lower, **{**static, "gather_weights": gather})
        return compile_phase("rollout decode", lower, args, inputs.held_beside_rollout)

    auto_note = ""
    if inputs.rollout.options.gather_weights == "auto" and has_sharded_weights(inputs.forward_params):
        gathered, decoder = compile_decode(True)
        limit = capacity.bytes * (1 - GATHER_HEADROOM)
        resident = gathered.arguments + gathered.other
        if decoder is not None and bytes_beyond_arguments(decoder) <= spare_bytes(capacity.bytes, resident):
            return dataclasses.replace(gathered, note="gather_weights=auto: weights gathered once per rollout (the "
                                       f"copy fits); {decode_traffic_note(decoder, True)}")
        auto_note = (f"gather_weights=auto: sharded weights (a gathered decode needs {gathered.total / GIB:.2f} GiB, "
                     f"over {limit / GIB:.2f}: {GATHER_HEADROOM:.0%} of {capacity.gib:.2f} kept free); ")
    second, decoder = compile_decode(static["gather_weights"])
    if decoder is None:
        return second
    return dataclasses.replace(second, note=auto_note + decode_traffic_note(decoder, static["gather_weights"]))


def decode_traffic_note(decoder: Any, gathered: bool) -> str:
    """The collectives the compiled decode loop runs for every token, per device."""
    traffic = decode_collective_bytes_per_token(decoder)
    if not traffic:
        return "collectives per decoded token: none"
    listed = ", ".join(f"{kind} {size / (1 << 20):.1f} MiB" for kind, size in sorted(traffic.items()))
    hint = ("" if gathered else "; rollout.options.gather_weights=true gathers FSDP-sharded weights once per "
            "rollout instead (a full compute-dtype copy per device)")
    return f"collectives per decoded token: {listed}{hint}"


def logps_phase(inputs: PlanInputs) -> Optional[PhaseMemory]:
    """The full-batch scoring forward the loop runs for old (ppo_epochs > 1) or reference
    (loss.beta > 0) log-probs; None when the run never calls it."""
    program = inputs.program
    if not (program.scores_ref_logps or program.scores_old_logps):
        return None
    batch = abstract_update_batch(inputs)
    lower = functools.partial(program.score.lower, prompt_width=batch.prompt_width)
    args = (inputs.forward_params, batch.input_ids, batch.attention_mask, batch.targets)
    return compile_phase("log-probs", lower, args, inputs.held_beside_rollout)[0]


def update_lowering(inputs: PlanInputs, size: int) -> tuple[Callable[..., Any], tuple]:
    """(lower, abstract args) of one optimizer update over the widest batch, in micro-batches of
    `size` rows per device (train.micro_batch_size_per_device)."""
    program = inputs.program.with_micro_batch_size(size)
    return program.update.lower, (inputs.params, inputs.opt_state, abstract_update_batch(inputs))


def compile_update(inputs: PlanInputs) -> Any:
    lower, args = update_lowering(inputs, inputs.cfg.train.micro_batch_size_per_device)
    return lower(*args).compile()


def train_phase(inputs: PlanInputs, size: int) -> PhaseMemory:
    lower, args = update_lowering(inputs, size)
    return compile_phase("train step", lower, args, inputs.reference_bytes)[0]


def fixed_phases(inputs: PlanInputs, capacity: Capacity) -> list[PhaseMemory]:
    """The phases that do not depend on the micro-batch size."""
    return rollout_phases(inputs, capacity) + [p for p in [logps_phase(inputs)] if p is not None]
