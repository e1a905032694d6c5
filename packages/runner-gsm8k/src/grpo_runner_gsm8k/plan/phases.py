"""The phases of a step compiled on abstract inputs, with the compiler's memory figures."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from grpo_core.errors import UserError
from grpo_core.contracts import Policy, RolloutShapes
from grpo_meshes import train_batch_sharding
from grpo_rollout.gather import spare_bytes

from grpo_runner_gsm8k.assembly.adapters import decode_needs
from grpo_runner_gsm8k.costs.capacity import Capacity
from grpo_runner_gsm8k.costs.memory import PhaseMemory
from grpo_runner_gsm8k.costs.roofline import decode_seconds
from grpo_runner_gsm8k.plan.abstract import (PlanInputs, abstract_array, abstract_key, abstract_update_batch,
                                             per_device_bytes, plannable)
from grpo_runner_gsm8k.samplers.multi_turn_inputs import row_budget
from grpo_runner_gsm8k.samplers.multi_turn_step import keeps_caches
from grpo_runner_gsm8k.samplers.partial import kv_cache_mode, shared_prompt_table, slot_count
from grpo_runner_gsm8k.assembly.run import with_rollout_decided
from grpo_runner_gsm8k.assembly.reward_model import REWARD_MODEL_PHASE
from grpo_runner_gsm8k.assembly.teacher import TEACHER_PHASE


# The TPU compiler refuses a program whose buffers exceed the chip's HBM, giving the size.
_HBM_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED:.*?required for HLO temporaries \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def refused_temp(name: str, exc: jax.errors.JaxRuntimeError) -> int:
    """The temporaries the compiler reported needing when it refused a program for HBM;
    a rejected Pallas kernel is a UserError, anything else is raised again."""
    if "Mosaic" in str(exc):
        first = " ".join(str(exc).strip().splitlines()[0].split())[:300]
        raise UserError(f"{name}: the TPU compiler rejected a Pallas kernel ({first}); with loss.impl: pallas "
                        "change loss.options.block_size / time_block") from None
    match = _HBM_EXHAUSTED.search(str(exc))
    if not match:
        raise exc
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def compile_phase(name: str, lower: Callable[..., Any], args: tuple, other: int = 0) -> tuple[PhaseMemory, Any]:
    """(memory, compiled) of `lower(*args).compile()`; when the compiler refuses it for
    HBM, the memory it reported needing (temporaries) beside the arguments, and None."""
    try:
        compiled = lower(*args).compile()
    except jax.errors.JaxRuntimeError as exc:
        temp = refused_temp(name, exc)
        return PhaseMemory(name, per_device_bytes(args), 0, 0, temp, other, refused=True), None
    return PhaseMemory.from_compiled(name, compiled, other), compiled


class PhaseRecorder:
    """The plan's `grpo_core.contracts.PhaseCompiler`: compiles a backend's phases and keeps
    their memory (and the compiled programs, by phase name) in order."""

    def __init__(self, capacity: Optional[Capacity], other: int):
        self.capacity, self.other = capacity, other  # other: state held beside every phase
        self.phases: list[PhaseMemory] = []
        self.compiled: dict[str, Any] = {}

    def compile(self, name: str, build: Callable[[], Any], arguments: Any, *, record: bool = True,
                note: str | Callable[[Any], str] = "") -> Any:
        try:
            compiled = build()
        except jax.errors.JaxRuntimeError as exc:
            temp = refused_temp(name, exc)
            if record:
                self.phases.append(PhaseMemory(name, per_device_bytes(arguments), 0, 0, temp, self.other, refused=True))
            return None
        if record:
            text = note(compiled) if callable(note) else note
            self.record(dataclasses.replace(PhaseMemory.from_compiled(name, compiled, self.other), note=text))
            self.compiled[name] = compiled
        return compiled

    def record(self, phase: PhaseMemory) -> None:
        """Appends `phase`; a phase of the same name recorded before is replaced in place (its note
        kept when the new one has none): the program the run executes after all."""
        for i, old in enumerate(self.phases):
            if old.name == phase.name:
                self.phases[i] = phase if phase.note else dataclasses.replace(phase, note=old.note)
                return
        self.phases.append(phase)

    def decode_seconds(self, compiled: Any, steps: int) -> Optional[float]:
        """Projected seconds of `steps` tokens of a compiled decode on the target chip; None without one."""
        chip = self.capacity and self.capacity.chip
        return None if chip is None else decode_seconds(chip, compiled, steps)

    def spare_bytes(self, compiled: Any) -> Optional[int]:
        """grpo_rollout.gather's rule against the planned capacity, with this phase's
        arguments and the state held beside it resident."""
        if self.capacity is None:
            return None
        return spare_bytes(self.capacity.bytes, compiled.memory_analysis().argument_size_in_bytes + self.other)


def rollout_shapes(inputs: PlanInputs) -> RolloutShapes:
    """One rollout batch of the run, abstract: what the backend compiles its phases for."""
    run, rollout = inputs.run, inputs.run.cfg.rollout
    prompts, prompt_length, sampling = rollout.prompts_per_step, rollout.max_prompt_length, run.sampling
    kept_prefix, table = 0, ()
    if rollout.partial.enabled:
        # The widest round: every slot carries a prompt plus max_new_tokens - 1 tokens (a multi-turn
        # row: its budget over all turns, tool turns included, but one), kept in its cache (new
        # prompts admitted beside) or re-prefilled (multi-turn rows always are).
        prompts = slot_count(rollout)
        sampling = dataclasses.replace(sampling, n=1, max_new_tokens=rollout.partial.budget)
        carried = prompt_length + (row_budget(rollout) if rollout.multi_turn.enabled else rollout.max_new_tokens) - 1
        groups = shared_prompt_table(rollout, plannable(run))
        if kv_cache_mode(run.cfg.rollout, plannable(run)) == "reprefill" and not groups:
            prompt_length = carried
        else:  # kept, or re-prefilled on the prompt table: the same rounds, every slot admitted
            kept_prefix, table = carried, (groups, rollout.n) if groups else ()
    elif rollout.multi_turn.enabled:
        prompts, sampling = prompts * rollout.n, dataclasses.replace(sampling, n=1)
        prompt_length, kept_prefix = multi_turn_round(inputs)
    return RolloutShapes(policy=Policy(run.policy_graphdef, inputs.forward_params, run.qcfg), prompts=prompts,
                         max_prompt_length=prompt_length, sampling=sampling, batch_sharding=run.rollout_sharding,
                         key=abstract_key(run.mesh), kept_prefix=kept_prefix, prompt_table=table)


def multi_turn_round(inputs: PlanInputs) -> tuple[int, int]:
    """(prompt length, kept prefix) of a multi-turn rollout's widest turn (rollout.multi_turn):
    a row's last turn starts from at most its prompt plus the row's budget (max_total_tokens)
    but one token. By re-prefill that whole prefix is prefilled; on kept caches it is kept,
    and beside it the widest admission is a prompt (the first round) or a tool turn, at
    most the budget but one token (at least one sampled token precedes it)."""
    run, rollout = inputs.run, inputs.run.cfg.rollout
    longest = rollout.max_prompt_length + row_budget(rollout) - 1
    if not keeps_caches(rollout.multi_turn.kv_cache, plannable(run), rollout.backend):
        return longest, 0
    return max(rollout.max_prompt_length, row_budget(rollout) - 1), longest


def kept_cache_bytes(inputs: PlanInputs) -> int:
    """Per device: the KV cache partial rollouts keep across updates (rollout.partial.kv_cache:
    across_steps), held through scoring and the update; 0 without one."""
    shapes = rollout_shapes(inputs)
    if inputs.run.cfg.rollout.partial.kv_cache != "across_steps" or not shapes.kept_prefix:
        return 0
    return per_device_bytes(plannable(inputs.run).kept_cache(shapes))


def rollout_recorder(inputs: PlanInputs, capacity: Optional[Capacity]) -> PhaseRecorder:
    """The rollout's phases compiled by its backend (through the RolloutBackend contract)."""
    recorder = PhaseRecorder(capacity, inputs.held_beside_rollout)
    plannable(inputs.run).compile_phases(rollout_shapes(inputs), recorder)
    return recorder


def rollout_phases(inputs: PlanInputs, capacity: Capacity) -> list[PhaseMemory]:
    """The rollout's phases in order; a phase after one the compiler refused is not compiled."""
    return rollout_recorder(inputs, capacity).phases


def compile_rollout(inputs: PlanInputs) -> dict[str, Any]:
    """{phase name: compiled} of one rollout batch, with no capacity to check a gathered decode against."""
    return rollout_recorder(inputs, None).compiled


def decide_lora_rollout(inputs: PlanInputs, capacity: Capacity) -> PlanInputs:
    """A LoRA run's rollout as the run decides it (run.with_rollout_decided), against the planned
    capacity: the merged copy's decode compiled with its weights as sharded, as the run compiles it."""
    if inputs.frozen is None:
        return inputs
    decode = compile_rollout(inputs).get("rollout decode")
    base = per_device_bytes(inputs.frozen)
    needs = None if decode is None else decode_needs(decode, base)
    spare = spare_bytes(capacity.bytes, base + inputs.params_bytes + per_device_bytes(inputs.opt_state))
    return dataclasses.replace(inputs, run=with_rollout_decided(inputs.run, needs, spare))


def logps_phase(inputs: PlanInputs) -> Optional[PhaseMemory]:
    """The full-batch scoring forward the loop runs for old (ppo_epochs > 1) or reference
    (loss.beta > 0) log-probs; None when the run never calls it."""
    run = inputs.run
    if not run.logps.scores:
        return None
    batch = abstract_update_batch(inputs)
    lower = functools.partial(run.score.lower, prompt_width=batch.prompt_width)
    args = (inputs.forward_params, batch.input_ids, batch.attention_mask, batch.targets)
    return compile_phase("log-probs", lower, args, inputs.held_beside_rollout + kept_cache_bytes(inputs))[0]


def teacher_phase(inputs: PlanInputs) -> Optional[PhaseMemory]:
    """The teacher's scoring forward over the whole batch after each rollout (teacher.path); None without."""
    teacher = inputs.run.teacher
    if teacher is None:
        return None
    batch = abstract_update_batch(inputs)
    if inputs.run.cfg.teacher.estimator == "full":  # its hidden states, for the exact KL in the update
        lower = functools.partial(teacher.hidden.lower, prompt_width=batch.prompt_width)
        args = (teacher.params, batch.input_ids, batch.attention_mask)
    else:
        lower = functools.partial(teacher.score.lower, prompt_width=batch.prompt_width)
        args = (teacher.params, batch.input_ids, batch.attention_mask, batch.targets)
    other = inputs.held_beside_rollout - inputs.teacher_bytes + kept_cache_bytes(inputs)  # its params are an argument
    return compile_phase(TEACHER_PHASE, lower, args, other)[0]


def reward_model_phase(inputs: PlanInputs) -> Optional[PhaseMemory]:
    """The reward model's forward over its widest batch after each rollout; None without one."""
    model = inputs.run.reward_model
    if model is None:
        return None
    tokens = train_batch_sharding(model.mesh)
    args = (model.params, model.head, abstract_array((model.rows, model.width), jnp.int32, tokens),
            abstract_array((model.rows, model.width), jnp.int32, tokens),
            abstract_array((model.rows,), jnp.int32, train_batch_sharding(model.mesh, ndim=1)))
    other = inputs.held_beside_rollout - inputs.reward_model_bytes + kept_cache_bytes(inputs)  # its params are an argument
    return compile_phase(REWARD_MODEL_PHASE, model.score.lower, args, other)[0]


def update_lowering(inputs: PlanInputs, size: int) -> tuple[Callable[..., Any], tuple]:
    """(lower, abstract args) of one optimizer update over the widest batch, in micro-batches of
    `size` rows per device (train.micro_batch_size_per_device)."""
    run = inputs.run.with_micro_batch_size(size)
    return run.update.lower, (inputs.params, inputs.opt_state, abstract_update_batch(inputs), *run.policy.frozen)


def compile_update(inputs: PlanInputs) -> Any:
    lower, args = update_lowering(inputs, inputs.run.cfg.train.micro_batch_size_per_device)
    return lower(*args).compile()


def train_phase(inputs: PlanInputs, size: int) -> PhaseMemory:
    lower, args = update_lowering(inputs, size)
    return compile_phase("train step", lower, args, inputs.reference_bytes + inputs.teacher_bytes
                         + inputs.reward_model_bytes + kept_cache_bytes(inputs))[0]


def fixed_phases(inputs: PlanInputs, capacity: Capacity) -> list[PhaseMemory]:
    """The phases that do not depend on the micro-batch size."""
    later = [logps_phase(inputs), teacher_phase(inputs), reward_model_phase(inputs)]
    return rollout_phases(inputs, capacity) + [p for p in later if p is not None]
