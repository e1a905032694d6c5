"""The GRPO loop: rollout -> rewards -> advantages -> update -> eval -> log.

One step: the run's step sampler (grpo_runner_gsm8k.samplers) rolls out P prompts x K
samples with the current policy and scores them; the rewards are turned into
group-relative advantages and used for `train.ppo_epochs` updates, each accumulating
exact gradients over micro-batches (see step.py).
"""

from __future__ import annotations

import time
from collections import deque

import jax
import numpy as np

from grpo_core.config import RunConfig
from grpo_core.config_io import config_to_dict
from grpo_core.contracts import CarryingSampler, Policy
from grpo_core.registry import Registry
from grpo_meshes import train_batch_sharding
from grpo_core.rollout_records import RolloutResult

from grpo_runner_gsm8k.training.advantages import step_advantages
from grpo_runner_gsm8k.operations.checkpoint import TrainState
from grpo_runner_gsm8k.evaluation.evaluate import training_eval
from grpo_runner_gsm8k.training.loss_inputs import loss_inputs
from grpo_runner_gsm8k.training.scoring import reward_details
from grpo_runner_gsm8k.training.router_term import replayed_routing
from grpo_runner_gsm8k.operations.metrics import MetricsLogger
from grpo_runner_gsm8k.assembly.operations import Operations
from grpo_runner_gsm8k.training.train_metrics import memory_metrics, objective_metrics
from grpo_runner_gsm8k.multihost import host_array
from grpo_runner_gsm8k.operations.preemption import StopRequest
from grpo_runner_gsm8k.assembly.run import BuiltRun, build_run
from grpo_runner_gsm8k.training.step import UpdateBatch, update_advantages


EVAL_STREAM = 0x45564C  # folded into train.seed's key for eval sampling, apart from the training stream


class Trainer:
    """Runs the steps of a built run; `run()` is the whole job."""

    def __init__(self, built: BuiltRun):
        """`built` is a training run (`build_run(..., training=True)`): operations and step sampler made."""
        self.built = built
        self.sampler = built.sampler
        self.teacher_metrics: dict = {}
        self.step_times: deque = deque(maxlen=10)  # seconds of the last steps, for the average metric
        self.train_sharding = train_batch_sharding(built.mesh)
        self.row_sharding = train_batch_sharding(built.mesh, ndim=1)

    @property
    def cfg(self) -> RunConfig:
        return self.built.cfg

    @property
    def registry(self) -> Registry:
        return self.built.registry

    @property
    def ops(self) -> Operations:
        return self.built.ops

    @property
    def state(self) -> TrainState:
        return self.built.state

    @property
    def run_dir(self):
        return self.ops.run_dir

    @property
    def checkpoints(self):
        return self.ops.checkpoints

    @property
    def ref_params(self):
        return self.ops.reference

    def forward_params(self, params):
        """`params` as rollout, scoring and eval take them (see grpo_runner_gsm8k.assembly.policy)."""
        return self.built.policy.forward_params(params)

    # ---- one step -------------------------------------------------------------
    def step(self) -> dict:
        start = time.monotonic()
        self.state.key, key = jax.random.split(self.state.key)
        weights = self.forward_params(self.state.params)
        policy = Policy(self.built.policy_graphdef, weights, self.built.qcfg)
        (_, result, scores), sampling_metrics, timings = self.sampler.sample(policy, key, self.state.step)

        advantage_start = time.monotonic()
        advantages = step_advantages(self.built.inputs.estimator, scores, self.cfg.rollout.n,
                                     self.cfg.loss.dynamic_sampling)
        times = {"rollout_s": 0.0, "reward_s": 0.0, **timings}
        times["reward_s"] += time.monotonic() - advantage_start  # advantages count as reward work

        update_start = time.monotonic()
        batch = self.update_batch(result, advantages, weights)
        del weights, policy  # freed before the update, which casts the masters inside its own jit
        train_metrics = self.run_updates(batch)
        update_s = time.monotonic() - update_start

        step_s = time.monotonic() - start
        self.state.step += 1
        self.step_times.append(step_s)
        metrics = self.step_metrics(result, scores, advantages, train_metrics,
                                    dict(**times, update_s=update_s, step_s=step_s))
        return {**metrics, **sampling_metrics, **self.teacher_metrics}

    def update_batch(self, result: RolloutResult, advantages, weights) -> UpdateBatch:
        """The update's inputs; `weights` (the rollout's compute-dtype params) score old log-probs."""
        trimmed = self.built.rollout.trim(result)
        width = trimmed.prompt_width
        put = lambda x: jax.device_put(x, self.train_sharding)  # noqa: E731
        input_ids, attention_mask = put(trimmed.input_ids), put(trimmed.attention_mask)
        targets = put(trimmed.input_ids[:, width:])
        routing = replayed_routing(self.cfg.loss.routing_replay, trimmed.experts, put)
        inputs = loss_inputs(self.built.logps, advantages.keep, host_array(result.finished),
                             lambda: put(trimmed.sampler_logps[:, width:]),
                             lambda w: self.score(w, input_ids, attention_mask, targets, width, routing),
                             weights, self.ops.reference)
        loss_mask = put(trimmed.completion_mask[:, width:]) * put(inputs.keep[:, None])  # host keep: same everywhere
        values = update_advantages(advantages.advantages, targets.shape[1])  # [N], or [N, C] placed like loss_mask
        batch_advantages = jax.device_put(values, self.train_sharding if values.ndim == 2 else self.row_sharding)
        teacher_fields: dict = {}
        if self.ops.teacher is not None:  # per-token advantages, or the teacher's states for the exact KL
            batch_advantages, teacher_fields, self.teacher_metrics = self.ops.teacher.update_inputs(
                batch_advantages, put(trimmed.sampler_logps[:, width:]), loss_mask, input_ids, attention_mask,
                targets, width)
        return UpdateBatch(input_ids, attention_mask, targets, loss_mask, batch_advantages, inputs.old_logp,
                           inputs.ref_logp, inputs.sampler_logp, **teacher_fields, routing=routing, prompt_width=width)

    def score(self, weights, input_ids, attention_mask, targets, width: int, routing=None) -> jax.Array:
        args = (weights, input_ids, attention_mask, targets)
        self.ops.memory.check("log-probs", self.built.score, *args, prompt_width=width, routing=routing)
        return self.built.score(*args, prompt_width=width, routing=routing)

    def run_updates(self, batch: UpdateBatch) -> dict:
        totals: dict[str, float] = {}
        for _ in range(self.cfg.train.ppo_epochs):
            args = (self.state.params, self.state.opt_state, batch, *self.built.policy.frozen)
            self.ops.memory.check("train step", self.built.update, *args)
            self.state.params, self.state.opt_state, metrics = self.built.update(*args)
            metrics = jax.device_get(metrics)
            self.state.skipped_steps += int(metrics["skipped"])
            totals = metrics  # the last epoch's metrics describe the final update
        return totals

    # ---- metrics ---------------------------------------------------------------
    def step_metrics(self, result, scores, advantages, train: dict, times: dict) -> dict:
        lengths = host_array(result.lengths)
        prompt_lengths = host_array(result.prompt_mask).sum(axis=1)
        total = scores.total
        out = {f"time/train/{k}": v for k, v in times.items()}
        out["time/train/step_avg_last10_s"] = float(np.mean(self.step_times))
        out["throughput/train/valid_tokens_per_s"] = float(lengths.sum() / times["step_s"])
        out.update({"train-reward/total/mean": float(total.mean()), "train-reward/total/std": float(total.std()),
                    "train-reward/total/min": float(total.min()), "train-reward/total/max": float(total.max())})
        for name, values in scores.per_fn.items():
            out[f"train-reward/func/{name}/mean"] = float(values.mean())
            out[f"train-reward/func/{name}/errors"] = scores.errors[name]
        out.update(reward_details(self.built.inputs.rewards))
        out.update({
            "train-other/loss": train["loss"], "train-other/grad_norm": train["grad_norm"],
            "train-other/clip_frac_low": train["clip_frac_low"], "train-other/clip_frac_high": train["clip_frac_high"],
            "train-other/ratio_mean": train["ratio_mean"], "train-other/update_ratio": train["update_ratio"],
            "train-other/entropy": train.get("entropy_mean", float("nan")),
            "train-other/kl": train.get("kl_mean", 0.0),
            "train-other/lr": float(self.built.lr_schedule(self.state.step - 1)),
            "train-other/skipped_steps": self.state.skipped_steps,
            "train-seq_len/prompt/mean": float(prompt_lengths.mean()), "train-seq_len/prompt/max": int(prompt_lengths.max()),
            "train-seq_len/completion/mean": float(lengths.mean()), "train-seq_len/completion/max": int(lengths.max()),
        })
        out.update(advantages.metrics)
        out.update(objective_metrics(train, result, self.cfg.loss))
        out.update(memory_metrics())
        return out

    # ---- eval ------------------------------------------------------------------
    def eval_key(self) -> jax.Array:
        """A function of train.seed and the step, apart from the training stream: when and how
        often a run evaluates never changes what it trains on."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.train.seed), EVAL_STREAM), self.state.step)

    def evaluate(self) -> dict:
        return training_eval(self.built, self.forward_params(self.state.params), self.ops.eval_tasks,
                             self.eval_key(), self.ops.eval_ks, self.ops.eval_turns)

    def eval_due(self) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and (self.state.step % every == 0 or self.state.step == self.cfg.train.steps)

    # ---- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        if isinstance(self.sampler, CarryingSampler):  # the carried rows are run state, saved with the step's params
            self.state.carried = self.sampler.state()
        self.checkpoints.save(self.state, self.built.inputs.task.state(), self.built.qcfg.to_hf_dict(),
                              config_to_dict(self.cfg), lora_base=self.built.policy.fingerprint)

    # ---- the job -----------------------------------------------------------------
    def run(self) -> dict:
        """Steps to train.steps (see train_steps); the logger, checkpointer and lock close at the end."""
        logger = self.ops.logger
        try:
            with StopRequest() as stop:
                metrics = self.train_steps(logger, stop)
        finally:
            logger.close()
            try:
                self.checkpoints.close()  # a save in flight completes before the process exits
            finally:
                self.ops.lock.release()
        if self.built.layout.process_index == 0:
            logger.summary(metrics, self.last_checkpoint())
        return metrics

    def train_steps(self, logger: MetricsLogger, stop: StopRequest) -> dict:
        """Steps until train.steps, or until a signal: then the step in progress ends, is saved,
        and `Stopped` is raised (see preemption.py)."""
        metrics: dict = {}
        while self.state.step < self.cfg.train.steps:
            metrics = self.step()
            if self.eval_due():
                metrics.update(self.evaluate())
            logger.log(self.state.step, metrics)
            self.registry.step_end(self.state.step, metrics, str(self.run_dir))
            self.checkpoints.check()
            stopping = stop.agreed()
            if stopping or self.checkpoints.due(self.state.step, self.cfg.train.steps):
                self.save()
            if stopping and self.state.step < self.cfg.train.steps:  # a signal after the last step changes nothing
                self.checkpoints.close()  # the stop message promises a complete checkpoint
                raise stop.stopped(self.state.step, self.cfg.train.steps, self.last_checkpoint())
        return metrics

    def last_checkpoint(self) -> str:
        return str(self.checkpoints.directory / str(self.state.step))


def train(cfg: RunConfig, registry: Registry, resume: bool = False) -> dict:
    """Builds the run and runs the whole job; returns the last step's metrics."""
    return Trainer(build_run(cfg, registry, resume)).run()
