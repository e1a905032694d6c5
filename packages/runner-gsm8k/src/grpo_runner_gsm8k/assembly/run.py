"""One built run: everything a run executes, made in one pass from its config.

`build_run` builds it on this process's devices with real weights and data, and for
training its operations (run directory, lock, checkpointer, memory guard, metric sinks,
reference; see operations.py); the plan (`plan.abstract.abstract_run`) builds the same object
on abstract state (shapes and shardings only, no tokenizer or data, no operations), so what
the plan compiles is what the run executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import LossConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig
from grpo_core.contracts import MeshAwareLoss, Policy, RolloutBackend, RolloutShapes, SamplingParams, StepSampler
from grpo_core.models import QwenConfig
from grpo_core.models.qwen import resolve_dtype
from grpo_core.registry import Registry
from grpo_losses.full_kl import FullKLTerm
from grpo_meshes import ProcessLayout, build_mesh_from_config, rollout_batch_sharding, setup_processes

from grpo_runner_gsm8k.assembly.adapters import storage_dtype
from grpo_runner_gsm8k.assembly.experts import expert_parallel_strategy, train_tokens_per_device
from grpo_runner_gsm8k.assembly.build import (Inputs, build_model, check_inputs, from_plugin, micro_batches, preflight,
                                     sampling_params, stop_token_ids, with_micro_batch_size)
from grpo_runner_gsm8k.operations.checkpoint import Resume, TrainState
from grpo_runner_gsm8k.training.loss_inputs import LogpSources
from grpo_runner_gsm8k.assembly.operations import Operations, build_operations, start_point
from grpo_runner_gsm8k.assembly.optim import build_optimizer, learning_rate_schedule
from grpo_runner_gsm8k.multihost import check_same_run
from grpo_runner_gsm8k.assembly.policy import PolicyModel, policy_model
from grpo_runner_gsm8k.samplers.factory import restore_carried, step_sampler
from grpo_runner_gsm8k.training.router_term import router_coef
from grpo_runner_gsm8k.training.step import make_score, make_update
from grpo_runner_gsm8k.assembly.reward_model import RewardModel, place_reward_model
from grpo_runner_gsm8k.assembly.teacher import Teacher, full_kl_term, load_teacher
from grpo_runner_gsm8k.assembly.judge_model import attach_local_judges


@dataclass(frozen=True)
class Plugins:
    """The run's loss implementation (bound to its mesh) and rollout backend."""

    loss_impl: Any
    rollout: RolloutBackend


@dataclass(frozen=True)
class BuiltRun:
    """A run as built from its (resolved) config.

    policy: the policy model, full-parameter or LoRA (grpo_runner_gsm8k.assembly.policy): graphdefs,
            frozen params, forward and reference weights.
    state:  params, optimizer state, RNG key and counters; the loop updates it in place
            (the plan's holds abstract arrays). The params are the state of `policy.train_graphdef`.
    update(params, opt_state, UpdateBatch, *policy.frozen) -> (params, opt_state, metrics): jitted,
            donates params and optimizer state; micro-batched as `cfg.train` says.
    score(weights, input_ids, attention_mask, targets, prompt_width=...) -> [N, C] log-probs:
            jitted forward of `policy.policy_graphdef` for old / reference log-probs.
    logps:  which log-probs the loss receives (grpo_runner_gsm8k.training.loss_inputs).
    inputs: tokenizer, task, rewards and checked prompt ids; None in the plan's abstract run.
    teacher: the distillation teacher (`teacher.path`; see grpo_runner_gsm8k.assembly.teacher), else None.
    reward_model: the `reward_model` reward's model on the mesh (grpo_runner_gsm8k.assembly.reward_model), else None.
    ops:    a training run's operations (grpo_runner_gsm8k.assembly.operations); None for eval and the plan.
    sampler: a training run's step sampler (grpo_runner_gsm8k.samplers), its carried rows restored
            from the checkpoint; None for eval and the plan.
    """

    cfg: RunConfig
    registry: Registry
    layout: ProcessLayout
    mesh: Mesh
    qcfg: QwenConfig
    policy: PolicyModel
    state: TrainState
    plugins: Plugins
    lr_schedule: optax.Schedule  # the optimizer's, also read for the lr metric
    optimizer: optax.GradientTransformation
    update: Callable[..., Any]
    score: Callable[..., jax.Array]
    logps: LogpSources
    sampling: SamplingParams
    eval_sampling: SamplingParams
    inputs: Optional[Inputs] = None
    teacher: Optional[Teacher] = None
    ops: Optional[Operations] = None
    reward_model: Optional[RewardModel] = None
    sampler: Optional[StepSampler] = None

    @property
    def rollout(self) -> RolloutBackend:
        return self.plugins.rollout

    @property
    def compute_dtype(self) -> Any:
        return compute_dtype(self.cfg.model)

    @property
    def policy_graphdef(self) -> nnx.GraphDef:
        """The model of the weights rollout and scoring take (the policy model's)."""
        return self.policy.policy_graphdef

    @property
    def rollout_sharding(self) -> NamedSharding:
        return rollout_batch_sharding(self.mesh, self.cfg.rollout.sharding)

    def with_micro_batch_size(self, size: int) -> "BuiltRun":
        """The same run with `train.micro_batch_size_per_device = size` (a new update)."""
        cfg = with_micro_batch_size(self.cfg, size)
        update = make_run_update(cfg.loss, cfg.rollout, cfg.train, self.mesh, self.policy, self.plugins.loss_impl,
                                 self.optimizer, full_kl_term(cfg.teacher), router_coef(cfg.loss, self.qcfg))
        return dataclasses.replace(self, cfg=cfg, update=update)


def compute_dtype(model_cfg: ModelConfig) -> Any:
    """The dtype every forward and backward pass runs in (model.dtype)."""
    return resolve_dtype(model_cfg.dtype)


def make_run_update(loss: LossConfig, rollout: RolloutConfig, train: TrainConfig, mesh: Mesh, policy: PolicyModel,
                    loss_impl: Any, optimizer: optax.GradientTransformation,
                    full_kl: Optional[FullKLTerm] = None, router: Optional[float] = None) -> Callable[..., Any]:
    """The jitted update of the policy's trained params, in the policy's compute dtype (model.dtype);
    `full_kl`: the exact KL to a teacher (teacher.estimator: full; None = none); `router`: a
    mixture-of-experts model's balance-loss coefficient (training.router_term.router_coef; None = dense)."""
    return make_update(policy.train_graphdef, loss_impl, loss, optimizer, rollout.temperature,
                       micro_batches(rollout, train, mesh), policy.compute_dtype, full_kl, router)


def make_run_score(policy: PolicyModel, loss_impl: Any, temperature: float) -> Callable[..., jax.Array]:
    """The scoring forward of the policy's weights as the rollout sees them (decided by then)."""
    return make_score(policy.policy_graphdef, loss_impl, temperature)


def build_plugins(loss: LossConfig, rollout: RolloutConfig, registry: Registry, mesh: Mesh) -> Plugins:
    loss_impl = from_plugin(registry, "loss", loss.impl, loss.options, "loss.options")
    if isinstance(loss_impl, MeshAwareLoss):  # pallas: shard_map, Mosaic
        loss_impl = loss_impl.on_mesh(mesh)
    backend = from_plugin(registry, "rollout", rollout.backend, rollout.options, "rollout.options")
    if rollout.quantize != "none":  # the backend's support was checked when the config loaded
        backend.quantize_with(rollout.quantize)
        print(f"rollout: quantize={rollout.quantize}: sampling from {rollout.quantize} projection weights made "
              "once per step; the trainer scores in full precision", flush=True)
    if rollout.kv_cache_dtype != "auto":  # checked when the config loaded, as quantize
        backend.kv_cache_with(rollout.kv_cache_dtype)
        print(f"rollout: kv_cache_dtype={rollout.kv_cache_dtype}: the decode's keys and values cached as "
              f"{rollout.kv_cache_dtype} with a scale per token and KV head", flush=True)
    return Plugins(loss_impl, backend)


def init_opt_state(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """Optimizer state for `params`: moments sharded like their params, the rest (step
    counts) replicated on the mesh, as the update returns them (and the plan assumes)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
                        optimizer.init(params))


@dataclass(frozen=True)
class RunPlace:
    """Where and what a run is, before its state."""

    registry: Registry
    layout: ProcessLayout
    mesh: Mesh
    qcfg: QwenConfig
    policy: PolicyModel


def assemble(cfg: RunConfig, place: RunPlace, state: TrainState, plugins: Plugins,
             optimizer: tuple[optax.Schedule, optax.GradientTransformation],
             samplings: tuple[SamplingParams, SamplingParams], inputs: Optional[Inputs] = None,
             teacher: Optional[Teacher] = None, reward_model: Optional[RewardModel] = None) -> BuiltRun:
    """The run at `place` with its jitted functions, made for the policy as decided."""
    policy, (lr_schedule, transform) = place.policy, optimizer
    return BuiltRun(
        cfg=cfg, registry=place.registry, layout=place.layout, mesh=place.mesh, qcfg=place.qcfg, policy=policy,
        state=state, plugins=plugins, lr_schedule=lr_schedule, optimizer=transform,
        update=make_run_update(cfg.loss, cfg.rollout, cfg.train, place.mesh, policy, plugins.loss_impl, transform,
                               full_kl_term(cfg.teacher), router_coef(cfg.loss, place.qcfg)),
        score=make_run_score(policy, plugins.loss_impl, cfg.rollout.temperature),
        logps=LogpSources.from_config(cfg.train, cfg.rollout, cfg.loss),
        sampling=samplings[0], eval_sampling=samplings[1], inputs=inputs, teacher=teacher, reward_model=reward_model)


def run_optimizer(train: TrainConfig) -> tuple[optax.Schedule, optax.GradientTransformation]:
    lr_schedule = learning_rate_schedule(train)
    return lr_schedule, build_optimizer(train, lr_schedule, train.moment_dtype)


def build_run(cfg: RunConfig, registry: Registry, resume: bool = False, *, training: bool = True) -> BuiltRun:
    """The run on this process's devices, every object it needs made once: inputs checked, model
    loaded and sharded, policy model decided, plugins, optimizer and state, teacher, the rollout
    settled and, for `training`, the operations (lock, checkpointer, metric sinks, reference; the
    state restored from the newest checkpoint when there is one, which `resume` requires)."""
    resume_from = start_point(cfg, resume) if training else None
    layout = setup_processes(cfg.mesh)
    check_same_run(cfg)  # every process, the same config and code, before any model is loaded
    resolved = build_mesh_from_config(cfg.mesh, registry.mesh)
    mesh, strategy = resolved.mesh, resolved.strategy
    qcfg, inputs = check_inputs(cfg, registry, layout.process_index, layout.process_count)
    preflight(cfg.rollout, cfg.train, mesh, qcfg)
    strategy = expert_parallel_strategy(cfg.mesh.expert_parallel, strategy, mesh, qcfg,
                                        train_tokens_per_device(cfg.rollout, cfg.train, mesh), compute_dtype(cfg.model))
    model = build_model(cfg.model, qcfg, mesh, strategy, storage_dtype(cfg.model))
    policy, params = policy_model(cfg.model, model, mesh, strategy.param_rules, compute_dtype(cfg.model))
    plugins, optimizer = build_plugins(cfg.loss, cfg.rollout, registry, mesh), run_optimizer(cfg.train)
    state = TrainState(params, init_opt_state(optimizer[1], params, mesh), jax.random.key(cfg.train.seed))
    teacher = (load_teacher(cfg.teacher, cfg.model, mesh, strategy, plugins.loss_impl, cfg.rollout.temperature)
               if cfg.teacher.path else None)
    attach_local_judges(inputs.rewards, cfg.model, cfg.rollout, mesh, strategy, plugins.rollout)
    reward_model = place_reward_model(cfg.model, inputs.rewards, mesh, strategy)
    place = RunPlace(registry, layout, mesh, qcfg, policy)
    stop = stop_token_ids(cfg.rollout, inputs.tokenizer)
    samplings = (sampling_params(cfg.rollout, stop, record_routing=cfg.loss.routing_replay),
                 sampling_params(cfg.rollout, stop, cfg.eval))
    # the train state, teacher and reward model are resident now: the policy settles how the rollout sees it
    shapes_for = rollout_shapes_for(cfg.rollout, place, samplings[0])
    policy.choose_rollout(plugins.rollout, shapes_for, list(mesh.local_devices))
    built = assemble(cfg, place, state, plugins, optimizer, samplings, inputs, teacher, reward_model)
    return with_training_parts(built, resume_from) if training else built


def with_training_parts(built: BuiltRun, resume_from: Optional[Resume]) -> BuiltRun:
    """`built` with its step sampler (made first: its checks fail before the run directory is
    touched) and its operations (the lock taken, the state and the carried rows restored; the
    lock is released if the rows cannot be restored)."""
    sampler = step_sampler(built, built.registry)
    built = dataclasses.replace(built, ops=build_operations(built, resume_from), sampler=sampler)
    try:
        restore_carried(sampler, built.state, built.ops.checkpoints.directory)
    except BaseException:
        built.ops.lock.release()
        raise
    return built


def rollout_shapes_for(rollout: RolloutConfig, place: RunPlace,
                       sampling: SamplingParams) -> Callable[..., RolloutShapes]:
    """(graphdef, weights) -> one rollout batch of the run for those weights (compiled, never run)."""
    def shapes(graphdef: nnx.GraphDef, weights: nnx.State) -> RolloutShapes:
        return RolloutShapes(policy=Policy(graphdef, weights, place.qcfg), prompts=rollout.prompts_per_step,
                             max_prompt_length=rollout.max_prompt_length, sampling=sampling,
                             batch_sharding=rollout_batch_sharding(place.mesh, rollout.sharding),
                             key=jax.random.key(0))

    return shapes


def with_rollout_decided(built: BuiltRun, decode_needs: Optional[int], spare: Optional[int]) -> BuiltRun:
    """The plan's twin once its policy has decided the rollout against the planned capacity
    (policy.decide_rollout, the run's rule), scoring the weights as the rollout then sees them."""
    built.policy.decide_rollout(decode_needs, spare)
    score = make_run_score(built.policy, built.plugins.loss_impl, built.cfg.rollout.temperature)
    return dataclasses.replace(built, score=score)
