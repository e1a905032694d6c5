"""One built run: everything a run executes, assembled once from its config.

`build_run` builds it on this process's devices with real weights and data; the plan
(`plan.abstract.abstract_run`) builds the same object on abstract state (shapes and
shardings only, no tokenizer or data), so what the plan compiles is what the run executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import RunConfig
from grpo_core.contracts import (MeshAwareLoss, PlannableRollout, Policy, RolloutBackend, RolloutShapes,
                                 SamplingParams)
from grpo_core.models import QwenConfig
from grpo_core.models.qwen import resolve_dtype
from grpo_core.registry import Registry
from grpo_core.sharding import per_device_bytes
from grpo_rollout.gather import spare_device_bytes
from grpo_meshes import ProcessLayout, build_mesh_from_config, rollout_batch_sharding, setup_processes

from grpo_runner_gsm8k.adapters import LoRARun, decode_needs, lora_spec, setup_lora, storage_dtype
from grpo_runner_gsm8k.build import (Inputs, build_model, check_inputs, from_plugin, micro_batches, preflight,
                                     sampling_params, stop_token_ids, with_micro_batch_size)
from grpo_runner_gsm8k.checkpoint import TrainState
from grpo_runner_gsm8k.optim import build_optimizer, learning_rate_schedule
from grpo_runner_gsm8k.step import make_score, make_update
from grpo_runner_gsm8k.teacher import Teacher, load_teacher


@dataclass(frozen=True)
class Plugins:
    """The run's loss implementation (bound to its mesh) and rollout backend."""

    loss_impl: Any
    rollout: RolloutBackend


@dataclass(frozen=True)
class BuiltRun:
    """A run as built from its (resolved) config.

    state:  params, optimizer state, RNG key and counters; the loop updates it in place
            (the plan's holds abstract arrays). The params' structure is `graphdef`.
    update(params, opt_state, UpdateBatch) -> (params, opt_state, metrics): jitted, donates
            params and optimizer state; micro-batched as `cfg.train` says.
    score(weights, input_ids, attention_mask, targets, prompt_width=...) -> [N, C] log-probs:
            jitted forward for old / reference log-probs (weights in the compute dtype).
    inputs: tokenizer, task, rewards and checked prompt ids; None in the plan's abstract run.
    lora:   a LoRA run's frozen base and adapter models (its params are then the adapters and
            `update` takes the base as a 4th argument, `frozen`); None for full-parameter training.
    teacher: the distillation teacher (`teacher.path`; see grpo_runner_gsm8k.teacher), else None.
    """

    cfg: RunConfig
    layout: ProcessLayout
    mesh: Mesh
    qcfg: QwenConfig
    graphdef: nnx.GraphDef
    state: TrainState
    plugins: Plugins
    lr_schedule: optax.Schedule  # the optimizer's, also read for the lr metric
    optimizer: optax.GradientTransformation
    update: Callable[..., Any]
    score: Callable[..., jax.Array]
    sampling: SamplingParams
    eval_sampling: SamplingParams
    inputs: Optional[Inputs] = None
    lora: Optional[LoRARun] = None
    teacher: Optional[Teacher] = None

    @property
    def rollout(self) -> RolloutBackend:
        return self.plugins.rollout

    @property
    def compute_dtype(self) -> Any:
        return compute_dtype(self.cfg)

    @property
    def frozen(self) -> tuple:
        """The update's arguments after the batch: LoRA's base (no gradient), else none."""
        return () if self.lora is None else (self.lora.base,)

    @property
    def policy_graphdef(self) -> nnx.GraphDef:
        """The model of the weights rollout and scoring take (LoRA: merged base or base with adapters)."""
        return self.graphdef if self.lora is None else self.lora.policy_graphdef

    @property
    def rollout_sharding(self) -> NamedSharding:
        return rollout_batch_sharding(self.mesh, self.cfg.rollout.sharding)

    @property
    def scores_old_logps(self) -> bool:
        """Old log-probs come from a forward pass: several epochs per rollout, sampler's not used."""
        return self.cfg.train.ppo_epochs > 1 and not self.cfg.rollout.use_sampler_logps

    @property
    def has_old_logps(self) -> bool:
        """The update batch carries old log-probs (else the ratio is exactly 1: one on-policy epoch)."""
        return self.cfg.rollout.use_sampler_logps or self.scores_old_logps

    @property
    def carries_sampler_logps(self) -> bool:
        """The update batch carries the sampler's log-probs: the loss corrects rollout/training mismatch."""
        return self.cfg.loss.mismatch_correction != "none"

    @property
    def scores_ref_logps(self) -> bool:
        return self.cfg.loss.beta > 0

    def with_micro_batch_size(self, size: int) -> "BuiltRun":
        """The same run with `train.micro_batch_size_per_device = size` (a new update)."""
        cfg = with_micro_batch_size(self.cfg, size)
        return dataclasses.replace(self, cfg=cfg, update=make_run_update(cfg, self.mesh, update_graphdef(self),
                                                                        self.plugins.loss_impl, self.optimizer))


def compute_dtype(cfg: RunConfig) -> Any:
    """The dtype every forward and backward pass runs in (model.dtype)."""
    return resolve_dtype(cfg.model.dtype)


def update_graphdef(shape: Any) -> nnx.GraphDef:
    """The model the update differentiates: LoRA's with adapters, else the run's."""
    return shape.graphdef if shape.lora is None else shape.lora.train_graphdef


def make_run_update(cfg: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, loss_impl: Any,
                    optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    return make_update(graphdef, loss_impl, cfg.loss, optimizer, cfg.rollout.temperature,
                       micro_batches(cfg.rollout, cfg.train, mesh), compute_dtype(cfg))


def build_plugins(cfg: RunConfig, registry: Registry, mesh: Mesh) -> Plugins:
    loss_impl = from_plugin(registry, "loss", cfg.loss.impl, cfg.loss.options, "loss.options")
    if isinstance(loss_impl, MeshAwareLoss):  # pallas: shard_map, Mosaic
        loss_impl = loss_impl.on_mesh(mesh)
    return Plugins(loss_impl, from_plugin(registry, "rollout", cfg.rollout.backend, cfg.rollout.options,
                                          "rollout.options"))


def init_opt_state(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """Optimizer state for `params`: moments sharded like their params, the rest (step
    counts) replicated on the mesh, as the update returns them (and the plan assumes)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
                        optimizer.init(params))


@dataclass(frozen=True)
class RunShape:
    """Where and what a run is, before its state: the pieces `assemble` needs."""

    cfg: RunConfig
    layout: ProcessLayout
    mesh: Mesh
    qcfg: QwenConfig
    graphdef: nnx.GraphDef
    lora: Optional[LoRARun] = None

    @property
    def policy_graphdef(self) -> nnx.GraphDef:
        return self.graphdef if self.lora is None else self.lora.policy_graphdef


def assemble(shape: RunShape, registry: Registry, make_state: Callable[[optax.GradientTransformation], TrainState],
             samplings: tuple[SamplingParams, SamplingParams], inputs: Optional[Inputs] = None) -> BuiltRun:
    """The run's plugins and jitted functions for `shape`, with the state `make_state(optimizer)`."""
    cfg, mesh = shape.cfg, shape.mesh
    plugins = build_plugins(cfg, registry, mesh)
    lr_schedule = learning_rate_schedule(cfg.train)
    optimizer = build_optimizer(cfg.train, lr_schedule, cfg.train.moment_dtype)
    return BuiltRun(
        cfg=cfg, layout=shape.layout, mesh=mesh, qcfg=shape.qcfg, graphdef=shape.graphdef,
        state=make_state(optimizer), plugins=plugins, lr_schedule=lr_schedule, optimizer=optimizer,
        update=make_run_update(cfg, mesh, update_graphdef(shape), plugins.loss_impl, optimizer),
        score=make_score(shape.policy_graphdef, plugins.loss_impl, cfg.rollout.temperature),
        sampling=samplings[0], eval_sampling=samplings[1], inputs=inputs, lora=shape.lora)


def build_run(cfg: RunConfig, registry: Registry) -> BuiltRun:
    """The run on this process's devices: inputs checked, model loaded and sharded, state initialised."""
    layout = setup_processes(cfg.mesh)
    resolved = build_mesh_from_config(cfg.mesh, registry.mesh)
    qcfg, inputs = check_inputs(cfg, registry, layout.process_index, layout.process_count)
    preflight(cfg.rollout, cfg.train, resolved.mesh, qcfg)
    model = build_model(cfg.model, qcfg, resolved.mesh, resolved.strategy, storage_dtype(cfg))
    graphdef, params = nnx.split(model)
    lora = None
    if lora_spec(cfg) is not None:  # params become the adapters; the base is held once, frozen
        lora, params = setup_lora(cfg, model, resolved.mesh, resolved.strategy.param_rules)
    shape = RunShape(cfg, layout, resolved.mesh, qcfg, graphdef, lora)

    def make_state(optimizer: optax.GradientTransformation) -> TrainState:
        return TrainState(params, init_opt_state(optimizer, params, resolved.mesh), jax.random.key(cfg.train.seed))

    stop = stop_token_ids(cfg.rollout, inputs.tokenizer)
    samplings = (sampling_params(cfg.rollout, stop), sampling_params(cfg.rollout, stop, cfg.eval))
    built = assemble(shape, registry, make_state, samplings, inputs)
    if cfg.teacher.path:
        built = dataclasses.replace(built, teacher=load_teacher(cfg.teacher, cfg.model, resolved.mesh,
                                                                resolved.strategy, built.plugins.loss_impl,
                                                                cfg.rollout.temperature))
    if lora is None:
        return built
    spare = spare_device_bytes(list(resolved.mesh.local_devices))  # the train state is resident now
    return with_lora_rollout(built, None if spare is None else merged_decode_needs(built), spare)


def with_lora_rollout(built: BuiltRun, decode_needs: Optional[int], spare: Optional[int]) -> BuiltRun:
    """`built` once its LoRA rollout is decided (LoRARun.decide_merge, for the run and the plan):
    a per-token decode also scores with the adapters' model."""
    built.lora.decide_merge(decode_needs, spare)
    if built.lora.merged_rollout:
        return built
    return dataclasses.replace(built, score=make_score(built.lora.policy_graphdef, built.plugins.loss_impl,
                                                      built.cfg.rollout.temperature))


class DecodeKeeper:
    """A grpo_core.contracts.PhaseCompiler that keeps the compiled rollout decode (no capacity
    given, so its weights stay as sharded); None where the compiler refused it for memory."""

    def __init__(self):
        self.decode = None

    def compile(self, name: str, build: Callable[[], Any], arguments: Any, *, record: bool = True,
                note: Any = "") -> Any:
        try:
            compiled = build()
        except jax.errors.JaxRuntimeError as exc:
            if "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            return None
        if record and name == "rollout decode":
            self.decode = compiled
        return compiled

    def spare_bytes(self, compiled: Any) -> None:
        return None

    def decode_seconds(self, compiled: Any, steps: int) -> None:
        return None


def merged_decode_needs(built: BuiltRun) -> Optional[int]:
    """What one rollout's decode on the merged copy needs beside its weights, compiled (not run)
    for this batch; 0 for a backend that cannot compile its phases ahead (the copy alone decides)."""
    if not isinstance(built.rollout, PlannableRollout):
        return 0
    weights, cfg = built.lora.base, built.cfg.rollout  # the merged copy has the base's shapes
    shapes = RolloutShapes(policy=Policy(built.lora.base_graphdef, weights, built.qcfg), prompts=cfg.prompts_per_step,
                           max_prompt_length=cfg.max_prompt_length, sampling=built.sampling,
                           batch_sharding=built.rollout_sharding, key=jax.random.key(0))
    keeper = DecodeKeeper()
    built.rollout.compile_phases(shapes, keeper)
    return None if keeper.decode is None else decode_needs(keeper.decode, per_device_bytes(weights))
