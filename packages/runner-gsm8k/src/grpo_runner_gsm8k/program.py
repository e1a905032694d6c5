"""The compiled pieces of a run, assembled once from the config.

Training (`loop.Trainer`) calls them on real arrays; the memory plan (`plan.py`) lowers
the very same callables on abstract ones, so what the plan measures is what the run
executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import RunConfig
from grpo_core.contracts import MeshAwareLoss, RolloutBackend, SamplingParams
from grpo_core.models.qwen import resolve_dtype
from grpo_core.registry import Registry

from grpo_runner_gsm8k.build import from_plugin, micro_batches, with_micro_batch_size
from grpo_runner_gsm8k.optim import build_optimizer, learning_rate_schedule
from grpo_runner_gsm8k.step import make_score, make_update


@dataclass(frozen=True)
class RunProgram:
    """What one run executes besides its data.

    update(params, opt_state, UpdateBatch) -> (params, opt_state, metrics): jitted, donates
        params and optimizer state; micro-batched as `cfg.train` says.
    score(weights, input_ids, attention_mask, targets, prompt_width=...) -> [N, C] log-probs:
        jitted forward for old / reference log-probs (weights in the compute dtype).
    """

    cfg: RunConfig
    mesh: Mesh
    graphdef: nnx.GraphDef
    loss_impl: Any
    rollout: RolloutBackend
    sampling: SamplingParams
    lr_schedule: optax.Schedule  # the optimizer's, also read for the lr metric
    optimizer: optax.GradientTransformation
    update: Callable[..., Any]
    score: Callable[..., jax.Array]

    @property
    def compute_dtype(self) -> Any:
        return compute_dtype(self.cfg)

    @property
    def scores_old_logps(self) -> bool:
        """Old log-probs come from a forward pass: several epochs per rollout, sampler's not used."""
        return self.cfg.train.ppo_epochs > 1 and not self.cfg.rollout.use_sampler_logps

    @property
    def has_old_logps(self) -> bool:
        """The update batch carries old log-probs (else the ratio is exactly 1: one on-policy epoch)."""
        return self.cfg.rollout.use_sampler_logps or self.scores_old_logps

    @property
    def scores_ref_logps(self) -> bool:
        return self.cfg.loss.beta > 0

    def init_opt_state(self, params: Any) -> Any:
        """Optimizer state for `params`: moments sharded like their params, the rest (step
        counts) replicated on the mesh, as the update returns them (and the plan assumes)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
                            self.optimizer.init(params))

    def with_micro_batch_size(self, size: int) -> "RunProgram":
        """The same program with `train.micro_batch_size_per_device = size` (a new update)."""
        cfg = with_micro_batch_size(self.cfg, size)
        return dataclasses.replace(self, cfg=cfg, update=_update(cfg, self.mesh, self.graphdef, self.loss_impl,
                                                                 self.optimizer))


def _update(cfg: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, loss_impl: Any,
            optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    return make_update(graphdef, loss_impl, cfg.loss, optimizer, cfg.rollout.temperature,
                       micro_batches(cfg, mesh), compute_dtype(cfg))


def compute_dtype(cfg: RunConfig) -> Any:
    """The dtype every forward and backward pass runs in (model.dtype)."""
    return resolve_dtype(cfg.model.dtype)


def build_program(cfg: RunConfig, registry: Registry, mesh: Mesh, graphdef: nnx.GraphDef,
                  sampling: SamplingParams) -> RunProgram:
    """The run's plugins and jitted functions for a model of `graphdef` on `mesh`."""
    loss_impl = from_plugin(registry, "loss", cfg.loss.impl, cfg.loss.options, "loss.options")
    if isinstance(loss_impl, MeshAwareLoss):  # pallas: shard_map, Mosaic
        loss_impl = loss_impl.on_mesh(mesh)
    rollout = from_plugin(registry, "rollout", cfg.rollout.backend, cfg.rollout.options, "rollout.options")
    lr_schedule = learning_rate_schedule(cfg.train)
    optimizer = build_optimizer(cfg.train, lr_schedule, cfg.train.moment_dtype)
    return RunProgram(cfg=cfg, mesh=mesh, graphdef=graphdef, loss_impl=loss_impl, rollout=rollout,
                      sampling=sampling, lr_schedule=lr_schedule, optimizer=optimizer,
                      update=_update(cfg, mesh, graphdef, loss_impl, optimizer),
                      score=make_score(graphdef, loss_impl, cfg.rollout.temperature))
