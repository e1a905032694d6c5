"""The abstract twin of a built run: mesh, model and optimizer state as sharded shapes
(no weights, no data), and the widest batches a step can see."""

from __future__ import annotations

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
from grpo_core.models.presets import HUB_ARCHITECTURES, hub_architecture
from grpo_core.registry import Registry
from grpo_core.rollout_records import routing_record_dtype
from grpo_core.sharding import param_shardings, per_device_bytes
from grpo_meshes import ProcessLayout, build_mesh_from_config, setup_processes, train_batch_sharding

from grpo_runner_gsm8k.assembly.experts import expert_parallel_strategy, train_tokens_per_device
from grpo_runner_gsm8k.assembly.adapters import LoRAPolicy, abstract_lora_model, lora_spec, storage_dtype
from grpo_runner_gsm8k.assembly.build import (attention_impl, build_tokenizer, check_lengths, model_config, preflight,
                                     rows_per_step, sampling_params)
from grpo_runner_gsm8k.operations.checkpoint import TrainState
from grpo_runner_gsm8k.multihost import local_prompt_count
from grpo_runner_gsm8k.assembly.policy import FullPolicy, PolicyModel
from grpo_runner_gsm8k.assembly.run import BuiltRun, RunPlace, assemble, build_plugins, compute_dtype, run_optimizer
from grpo_runner_gsm8k.training.step import UpdateBatch
from grpo_runner_gsm8k.samplers.multi_turn_inputs import row_budget
from grpo_runner_gsm8k.assembly.reward_model import abstract_reward_model, reward_model_options
from grpo_runner_gsm8k.assembly.teacher import abstract_teacher
from grpo_runner_gsm8k.costs.tpu_target import Target, describe, target_devices


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
        return self.run.policy.base

    @property
    def forward_params(self) -> Any:
        """The params as rollout and scoring take them (the policy model's forward_params, on shapes)."""
        return self.run.policy.abstract_forward_params(self.params)

    @property
    def masters_beside_rollout(self) -> int:
        """What the stored params keep alive beside the rollout's weights (policy model's figure)."""
        return self.run.policy.masters_beside_rollout(self.params)

    @property
    def held_beside_rollout(self) -> int:
        """Device state alive during rollout and scoring that is not their argument."""
        return (per_device_bytes(self.opt_state) + self.masters_beside_rollout + self.reference_bytes
                + self.teacher_bytes + self.reward_model_bytes)

    @property
    def reference_bytes(self) -> int:
        """The frozen reference on the devices when the KL term is on (a compute-dtype copy; none
        for LoRA, whose reference is the base itself)."""
        return self.run.policy.reference_bytes(self.params) if self.run.logps.reference else 0

    @property
    def teacher_bytes(self) -> int:
        """The distillation teacher's params (teacher.dtype, as placed), resident for the whole run."""
        return 0 if self.run.teacher is None else per_device_bytes(self.run.teacher.params)

    @property
    def reward_model_bytes(self) -> int:
        """The `reward_model` reward's params and head (its dtype, sharded), resident for the whole run."""
        model = self.run.reward_model
        return 0 if model is None else per_device_bytes((model.params, model.head))


def abstract_array(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


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
                     mesh: Mesh, strategy: Any, dtype: Any) -> tuple[PolicyModel, Any]:
    """(policy model, abstract trained params), as `policy.policy_model` decides for the run: a LoRA
    run (`spec`) trains the adapters of `adapted` (the base with them), its base frozen (merged for
    the rollout, as the run decides when it fits)."""
    graphdef, params = abstract_run_model(base, attention, mesh, strategy)
    if spec is None:
        return FullPolicy(graphdef, params, dtype), params
    train_graphdef, state = abstract_run_model(adapted, attention, mesh, strategy)
    policy = LoRAPolicy(spec, graphdef, train_graphdef, params, fingerprint={}, merge=None, compute_dtype=dtype)
    return policy, lora.split_adapters(state)[0]


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
    mesh = resolved.mesh
    qcfg = plan_architecture(cfg.model) if qcfg is None else qcfg
    check_lengths(cfg.rollout, cfg.eval, qcfg)
    local_prompt_count(cfg.rollout.prompts_per_step, layout.process_count)  # the prompts split over the hosts
    preflight(cfg.rollout, cfg.train, mesh, qcfg, devices)
    strategy = expert_parallel_strategy(cfg.mesh.expert_parallel, resolved.strategy, mesh, qcfg,
                                        train_tokens_per_device(cfg.rollout, cfg.train, mesh), compute_dtype(cfg.model))
    spec = lora_spec(cfg.model.lora)
    base = abstract_model(qcfg, storage_dtype(cfg.model), cfg.model.remat, cfg.model.scan_layers)
    policy, params = abstract_trained(base, None if spec is None else abstract_lora_model(cfg.model, qcfg), spec,
                                      attention_impl(cfg.model, mesh), mesh, strategy,
                                      compute_dtype(cfg.model))
    plugins, optimizer = build_plugins(cfg.loss, cfg.rollout, registry, mesh), run_optimizer(cfg.train)
    state = TrainState(params, abstract_opt_state(optimizer[1], params, mesh), abstract_key(mesh))
    teacher = (abstract_teacher(cfg.teacher, cfg.model, mesh, strategy, plugins.loss_impl,
                                cfg.rollout.temperature) if cfg.teacher.path else None)
    options = reward_model_options(cfg.task)
    reward_model = None if options is None else abstract_reward_model(options, cfg.model, mesh, strategy)
    # stop ids change no buffer: the plan needs no tokenizer for them; the rollout is decided
    # later, against the planned capacity (phases.decide_lora_rollout)
    return assemble(cfg, RunPlace(registry, layout, mesh, qcfg, policy), state, plugins, optimizer,
                    (sampling_params(cfg.rollout, ()), sampling_params(cfg.rollout, (), cfg.eval)), teacher=teacher,
                    reward_model=reward_model)


def build_plan_inputs(cfg: RunConfig, registry: Registry, target: Optional[Target] = None) -> PlanInputs:
    """The plan's inputs on this host's devices, or on the compile-only devices of a TPU
    `target` (every host of the slice, planned from this one process)."""
    devices = target_devices(target) if target else None
    run = abstract_run(cfg, registry, devices)
    plannable(run)
    return PlanInputs(run, target=describe(target, devices) if target else None)


def rollout_widths(inputs: PlanInputs) -> RolloutWidths:
    """A multi-turn row's completion holds all its turns: it is the row's budget wide."""
    r = inputs.run.cfg.rollout
    completion = row_budget(r) if r.multi_turn.enabled else r.max_new_tokens
    try:
        return plannable(inputs.run).widths(r.max_prompt_length, completion)
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
    teacher, full = inputs.run.teacher, cfg.teacher.estimator == "full"
    return UpdateBatch(
        input_ids=tokens(jnp.int32, prompt_w + completion_w), attention_mask=tokens(jnp.int32, prompt_w + completion_w),
        targets=tokens(jnp.int32, completion_w), loss_mask=tokens(jnp.float32, completion_w),
        advantages=(tokens(jnp.float32, completion_w) if teacher is not None and not full  # per token: distillation
                    else abstract_array((rows,), jnp.float32, train_batch_sharding(mesh, ndim=1))),
        old_logp=tokens(jnp.float32, completion_w) if inputs.run.logps.has_old else None,
        ref_logp=tokens(jnp.float32, completion_w) if inputs.run.logps.reference else None,
        sampler_logp=tokens(jnp.float32, completion_w) if inputs.run.logps.sampler else None,
        **(teacher_fields(teacher, rows, completion_w, mesh) if teacher is not None and full else {}),
        routing=abstract_routing(inputs.run.qcfg, rows, prompt_w + completion_w, mesh) if cfg.loss.routing_replay
        else None, prompt_width=prompt_w)


def abstract_routing(qcfg: Any, rows: int, width: int, mesh: Any) -> Any:
    """The UpdateBatch's `routing` with `loss.routing_replay`: [rows, width, L, k] in the record's int type."""
    shape = (rows, width, qcfg.num_hidden_layers, qcfg.num_experts_per_tok)
    return abstract_array(shape, routing_record_dtype(qcfg.num_experts), train_batch_sharding(mesh, ndim=4))


def teacher_fields(teacher: Any, rows: int, completion_w: int, mesh: Any) -> dict:
    """The UpdateBatch fields of `teacher.estimator: full`: its states at the completion positions and its head."""
    hidden = abstract_array((rows, completion_w, teacher.qcfg.hidden_size), teacher.head.dtype,
                            train_batch_sharding(mesh, ndim=3))
    return {"teacher_hidden": hidden, "teacher_head": teacher.head}
