"""The abstract twin of a built run: mesh, model and optimizer state as sharded shapes
(no weights, no data), and the widest batches a step can see."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import ModelConfig, RunConfig
from grpo_core.contracts import PlannableRollout, RolloutWidths
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig, lora
from grpo_core.models.hf_io import abstract_model
from grpo_core.models.config import HUB_ARCHITECTURES, hub_architecture
from grpo_core.models.precision import needs_cast
from grpo_core.registry import Registry
from grpo_core.sharding import param_shardings, per_device_bytes
from grpo_meshes import ProcessLayout, build_mesh_from_config, setup_processes, train_batch_sharding

from grpo_runner_gsm8k.adapters import LoRARun, abstract_lora_model, lora_spec, storage_dtype
from grpo_runner_gsm8k.build import (attention_impl, build_tokenizer, check_lengths, model_config, preflight,
                                     rows_per_step, sampling_params)
from grpo_runner_gsm8k.checkpoint import TrainState
from grpo_runner_gsm8k.multihost import local_prompt_count
from grpo_runner_gsm8k.run import BuiltRun, RunShape, assemble
from grpo_runner_gsm8k.step import UpdateBatch
from grpo_runner_gsm8k.teacher import abstract_teacher
from grpo_runner_gsm8k.tpu_target import Target, describe, target_devices


@dataclass(frozen=True)
class PlanInputs:
    """The abstract twin of a built run (`run`, whose state holds sharded ShapeDtypeStructs)
    and, when planning for a TPU slice, that slice described."""

    run: BuiltRun
    target: Optional[str] = None

    @property
    def params(self) -> Any:
        return self.run.state.params

    @property
    def opt_state(self) -> Any:
        return self.run.state.opt_state

    @property
    def params_bytes(self) -> int:
        return per_device_bytes(self.params)

    @property
    def frozen(self) -> Any:
        """A LoRA run's abstract base (the params are then its adapters), else None."""
        return None if self.run.lora is None else self.run.lora.base

    @property
    def forward_params(self) -> Any:
        """The params as rollout and scoring take them: in the compute dtype (see loop.Trainer.forward_params);
        a LoRA run's merged copy has its base's shapes; its per-token decode takes the base with
        the adapters cast (LoRARun.policy)."""
        if self.frozen is not None:
            if self.run.lora.merged_rollout:
                return self.frozen
            return nnx.merge_state(self.frozen, abstract_cast(self.params, self.run.compute_dtype))
        return abstract_cast(self.params, self.run.compute_dtype)

    @property
    def masters_beside_rollout(self) -> int:
        """The stored params stay alive beside their compute-dtype copy when the dtypes differ; a LoRA
        run's base and adapters beside the merged copy (counted whole: an upper bound, since only
        the targeted kernels are copied), or its float32 adapters beside the per-token decode's."""
        if self.frozen is not None:
            base = per_device_bytes(self.frozen) if self.run.lora.merged_rollout else 0
            return base + self.params_bytes
        return self.params_bytes if needs_cast(self.params, self.run.compute_dtype) else 0

    @property
    def held_beside_rollout(self) -> int:
        """Device state alive during rollout and scoring that is not their argument."""
        return per_device_bytes(self.opt_state) + self.masters_beside_rollout + self.reference_bytes + self.teacher_bytes

    @property
    def reference_bytes(self) -> int:
        """A frozen copy of the params (in the compute dtype) lives on the devices when the KL term is on;
        none for LoRA, whose reference is the base itself."""
        return per_device_bytes(self.forward_params) if self.run.scores_ref_logps and self.frozen is None else 0

    @property
    def teacher_bytes(self) -> int:
        """The distillation teacher's params (teacher.dtype, as placed), resident for the whole run."""
        return 0 if self.run.teacher is None else per_device_bytes(self.run.teacher.params)


def abstract_array(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def abstract_cast(tree: Any, dtype: Any) -> Any:
    """grpo_core.models.precision.compute_params of abstract params: floating leaves in `dtype`."""
    return jax.tree.map(lambda x: abstract_array(
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, x.sharding), tree)


def abstract_run_model(model: nnx.Module, attention: str, mesh: Mesh, strategy: Any) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, abstract params) of `model` (built by shape evaluation only, with or without
    LoRA adapters), sharded and attending (build.attention_impl) as build.build_model makes the real one."""
    model.set_activation_sharding(mesh, strategy.activation_rules)
    model.set_attention(attention)
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh, strategy.param_rules)
    return graphdef, jax.tree.map(lambda leaf, sharding: abstract_array(leaf.shape, leaf.dtype, sharding),
                                  state, shardings)


def abstract_trained(base: nnx.Module, adapted: Optional[nnx.Module], spec: Optional[lora.LoRASpec], attention: str,
                     mesh: Mesh, strategy: Any) -> tuple[nnx.GraphDef, Any, Optional[LoRARun]]:
    """(graphdef, abstract trained params, LoRA state or None) of the abstract `base` model: a LoRA
    run (`spec`) trains the adapters of `adapted` (the base with them), its base frozen (merged for
    the rollout, as the run decides when it fits)."""
    graphdef, params = abstract_run_model(base, attention, mesh, strategy)
    if spec is None:
        return graphdef, params, None
    train_graphdef, state = abstract_run_model(adapted, attention, mesh, strategy)
    run = LoRARun(spec, graphdef, train_graphdef, params, fingerprint={}, merge=None)
    return graphdef, lora.split_adapters(state)[0], run


def abstract_opt_state(optimizer: Any, params: Any, mesh: Mesh) -> Any:
    """The optimizer state as the run holds it: param-shaped leaves (moments) sharded like
    their params (eager `optimizer.init` keeps the params' shardings), the rest (step
    counts) replicated."""
    shapes = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer, lambda leaf, param: abstract_array(leaf.shape, leaf.dtype, param.sharding), shapes, params,
        transform_non_params=lambda leaf: abstract_array(leaf.shape, leaf.dtype, replicated(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def abstract_key(mesh: Mesh) -> jax.ShapeDtypeStruct:
    key = jax.eval_shape(lambda: jax.random.key(0))
    return abstract_array(key.shape, key.dtype, replicated(mesh))


def plan_architecture(model_cfg: ModelConfig) -> QwenConfig:
    """A local model dir or the built-in table for `model.path`, the config's
    `model.architecture` (sized to the tokenizer) otherwise."""
    path = model_cfg.path
    if path is None:
        return model_config(model_cfg, build_tokenizer(model_cfg))
    if os.path.isdir(path):
        return model_config(model_cfg, None)
    known = hub_architecture(path)
    if known is None:
        raise UserError(f"model.path {path!r} is not a local directory and its architecture is not built in "
                        f"(known: {', '.join(HUB_ARCHITECTURES)}); download the model's config.json into a "
                        "directory and point model.path at it")
    return known


def plannable(run: BuiltRun) -> PlannableRollout:
    """The run's rollout backend, which must implement the contract's planning members."""
    if not isinstance(run.rollout, PlannableRollout):
        raise UserError(f"rollout.backend {run.cfg.rollout.backend!r} cannot be planned: its backend implements no "
                        "widths/compile_phases (grpo_core.contracts.PlannableRollout); add them, or plan with "
                        "rollout.backend=jax")
    return run.rollout


def target_layout(devices: list) -> ProcessLayout:
    """The process layout of the hosts of a TPU target's devices, planned from this process."""
    processes = len({d.process_index for d in devices})
    return ProcessLayout(0, processes, len(devices) // processes, len(devices), distributed=False)


def abstract_run(cfg: RunConfig, registry: Registry, devices: Optional[list] = None,
                 qcfg: Optional[QwenConfig] = None) -> BuiltRun:
    """The run's abstract twin on `devices` (default: this host's) for model config `qcfg`
    (default: `plan_architecture(cfg.model)`): the same plugins and jitted functions, on a model and
    optimizer state of shapes only (no weights, tokenizer or data)."""
    layout = setup_processes(cfg.mesh) if devices is None else target_layout(devices)
    resolved = build_mesh_from_config(cfg.mesh, registry.mesh, devices)
    qcfg = plan_architecture(cfg.model) if qcfg is None else qcfg
    check_lengths(cfg.rollout, cfg.eval, qcfg)
    local_prompt_count(cfg.rollout.prompts_per_step, layout.process_count)  # the prompts split over the hosts
    preflight(cfg.rollout, cfg.train, resolved.mesh, qcfg, devices)
    spec = lora_spec(cfg)
    base = abstract_model(qcfg, storage_dtype(cfg), cfg.model.remat, cfg.model.scan_layers)
    graphdef, params, lora_run = abstract_trained(base, None if spec is None else abstract_lora_model(cfg, qcfg), spec,
                                                  attention_impl(cfg.model, resolved.mesh), resolved.mesh,
                                                  resolved.strategy)
    shape = RunShape(cfg, layout, resolved.mesh, qcfg, graphdef, lora_run)

    def make_state(optimizer: optax.GradientTransformation) -> TrainState:
        return TrainState(params, abstract_opt_state(optimizer, params, resolved.mesh), abstract_key(resolved.mesh))

    # stop ids change no buffer: the plan needs no tokenizer for them
    run = assemble(shape, registry, make_state, (sampling_params(cfg.rollout, ()),
                                                 sampling_params(cfg.rollout, (), cfg.eval)))
    if not cfg.teacher.path:
        return run
    return dataclasses.replace(run, teacher=abstract_teacher(cfg.teacher, cfg.model, resolved.mesh, resolved.strategy,
                                                             run.plugins.loss_impl, cfg.rollout.temperature))


def build_plan_inputs(cfg: RunConfig, registry: Registry, target: Optional[Target] = None) -> PlanInputs:
    """The plan's inputs on this host's devices, or on the compile-only devices of a TPU
    `target` (every host of the slice, planned from this one process)."""
    devices = target_devices(target) if target else None
    run = abstract_run(cfg, registry, devices)
    plannable(run)
    return PlanInputs(run, target=describe(target, devices) if target else None)


def rollout_widths(inputs: PlanInputs) -> RolloutWidths:
    r = inputs.run.cfg.rollout
    try:
        return plannable(inputs.run).widths(r.max_prompt_length, r.max_new_tokens)
    except ValueError as exc:
        raise UserError(f"rollout.max_prompt_length: {exc}") from None


def prompt_bucket(inputs: PlanInputs) -> int:
    """Widest prompt batch the backend samples from (max_prompt_length, padded as it pads)."""
    return rollout_widths(inputs).prompt


def train_widths(inputs: PlanInputs) -> tuple[int, int]:
    """(prompt, completion) columns of the widest trimmed training batch."""
    widths = rollout_widths(inputs)
    return widths.train_prompt, widths.train_completion


def abstract_update_batch(inputs: PlanInputs) -> UpdateBatch:
    """The widest UpdateBatch of a step, as the loop builds it (see loop.Trainer.update_batch)."""
    cfg, mesh = inputs.run.cfg, inputs.run.mesh
    rows, (prompt_w, completion_w) = rows_per_step(cfg.rollout), train_widths(inputs)
    tokens = lambda dtype, width: abstract_array((rows, width), dtype, train_batch_sharding(mesh))  # noqa: E731
    return UpdateBatch(
        input_ids=tokens(jnp.int32, prompt_w + completion_w), attention_mask=tokens(jnp.int32, prompt_w + completion_w),
        targets=tokens(jnp.int32, completion_w), loss_mask=tokens(jnp.float32, completion_w),
        advantages=(tokens(jnp.float32, completion_w) if inputs.run.teacher is not None  # per token: distillation
                    else abstract_array((rows,), jnp.float32, train_batch_sharding(mesh, ndim=1))),
        old_logp=tokens(jnp.float32, completion_w) if inputs.run.has_old_logps else None,
        ref_logp=tokens(jnp.float32, completion_w) if inputs.run.scores_ref_logps else None,
        sampler_logp=tokens(jnp.float32, completion_w) if inputs.run.carries_sampler_logps else None,
        prompt_width=prompt_w)
