"""The GRPO loop: rollout -> rewards -> advantages -> update -> eval -> log.

One step: the run's step sampler (grpo_runner_gsm8k.samplers) rolls out P prompts x K
samples with the current policy and scores them; the rewards are turned into
group-relative advantages and used for `train.ppo_epochs` updates, each accumulating
exact gradients over micro-batches (see step.py).
"""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from grpo_core.config import RunConfig
from grpo_core.config_io import config_to_dict, config_to_yaml
from grpo_core.contracts import CarryingSampler, MemoryCheckedRollout, Policy, ProjectingRollout
from grpo_core.models.precision import compute_params, needs_cast
from grpo_core.errors import UserError
from grpo_core.registry import Registry
from grpo_meshes import train_batch_sharding
from grpo_core.rollout_records import RolloutResult

from grpo_runner_gsm8k.adapters import check_same_base
from grpo_runner_gsm8k.advantages import step_advantages
from grpo_runner_gsm8k.build import check_run_dir, prepare_run_dir, warn_if_updates_round_away
from grpo_runner_gsm8k.checkpoint import Checkpointer, Resume, TrainState, resume_point
from grpo_runner_gsm8k.evaluation import checked_eval_tasks, eval_ks, training_eval
from grpo_runner_gsm8k.lock import RunDirLock
from grpo_runner_gsm8k.memory_check import MemoryGuard
from grpo_runner_gsm8k.metrics import MetricsLogger, truncate_metrics
from grpo_runner_gsm8k.train_metrics import memory_metrics, objective_metrics
from grpo_runner_gsm8k.multihost import host_array
from grpo_runner_gsm8k.costs.roofline import decode_seconds
from grpo_runner_gsm8k.preemption import StopRequest
from grpo_runner_gsm8k.run import build_run
from grpo_runner_gsm8k.samplers import step_sampler
from grpo_runner_gsm8k.step import UpdateBatch, update_advantages
from grpo_runner_gsm8k.teacher import TeacherScoring
from grpo_runner_gsm8k.tpu_target import generation_of


EVAL_STREAM = 0x45564C  # folded into train.seed's key for eval sampling, apart from the training stream


def project_decodes(rollout) -> None:
    """On TPU chips of a known generation the rollout picks its decode layout by projected
    time, as `grpo-run --plan --target` does."""
    chip = generation_of(jax.devices()[0])
    if chip is not None and isinstance(rollout, ProjectingRollout):
        rollout.project_decodes_with(functools.partial(decode_seconds, chip))


class Trainer:
    """Runs the steps of a built run; `run()` is the whole job."""

    def __init__(self, cfg: RunConfig, registry: Registry, resume: bool = False):
        check_run_dir(cfg)  # bad input fails before anything is built or written
        resume_from = resume_point(cfg, required=resume)
        warn_if_updates_round_away(cfg)
        note_void_correction(cfg)
        self.built = build_run(cfg, registry)
        self.registry = registry
        self.sampler = step_sampler(self.built, registry)  # the step's rollout (grpo_core.step_samplers)
        self.eval_tasks = checked_eval_tasks(self.built, registry) if cfg.eval.every_steps else {}
        self.eval_ks = eval_ks(cfg)
        self.memory = MemoryGuard(cfg)
        if isinstance(self.built.rollout, MemoryCheckedRollout):  # the jax backend checks its own compiles
            self.built.rollout.memory_check = self.memory.check_compiled
        project_decodes(self.built.rollout)
        self.run_dir = prepare_run_dir(cfg)
        self.lock = RunDirLock(self.run_dir)
        if self.built.layout.process_index == 0:  # the processes of one multi-host run share the directory
            self.lock.acquire()
        try:
            self._build_training(resume_from)
        except BaseException:
            self.lock.release()
            raise

    @property
    def cfg(self) -> RunConfig:
        return self.built.cfg

    @property
    def state(self) -> TrainState:
        return self.built.state

    def _build_training(self, resume_from: Optional[Resume]) -> None:
        params = self.state.params
        # the copy keeps the params' shardings exactly (as the plan assumes), size-1 mesh axes included
        self.cast = jax.jit(compute_params, static_argnums=1, out_shardings=jax.tree.map(lambda x: x.sharding, params))
        # The frozen reference is only ever run forward: stored in the compute dtype (LoRA: the base itself).
        self.ref_params = self.reference_params(params) if self.built.scores_ref_logps else None
        # the teacher is its own frozen model, never the reference (LoRA's base without adapters)
        self.teacher = None if self.built.teacher is None else TeacherScoring(self.built.teacher, self.cfg,
                                                                              self.memory.check)
        self.teacher_metrics: dict = {}
        self.step_times: deque = deque(maxlen=10)  # seconds of the last steps, for the average metric
        self.train_sharding = train_batch_sharding(self.built.mesh)
        self.row_sharding = train_batch_sharding(self.built.mesh, ndim=1)
        self.checkpoints = Checkpointer(self.run_dir, self.cfg.checkpoint)
        if resume_from is not None:
            self.restore(resume_from)

    def reference_params(self, params):
        if self.built.lora is not None:
            return self.built.lora.reference(params, self.built.compute_dtype)
        return jax.tree.map(jnp.copy, self.forward_params(params))

    def forward_params(self, params):
        """`params` in the compute dtype: one copy of the float32 masters per call (the
        rollout's decode reads it at every token: half the bytes of the masters), or the
        params themselves when they are stored in that dtype."""
        dtype = self.built.compute_dtype
        if self.built.lora is not None:
            return self.built.lora.policy(params, dtype)[1]
        return self.cast(params, dtype) if needs_cast(params, dtype) else params

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
        keep = put(trained_rows(result, advantages, self.cfg.loss)[:, None])  # host values: the same on every process
        loss_mask = put(trimmed.completion_mask[:, width:]) * keep
        old_logp = self.old_logps(trimmed, weights, input_ids, attention_mask, targets, width)
        ref_logp = None
        if self.built.scores_ref_logps:
            ref_logp = self.score(self.ref_params, input_ids, attention_mask, targets, width)
        sampler_logp = put(trimmed.sampler_logps[:, width:]) if self.built.carries_sampler_logps else None
        values = update_advantages(advantages.advantages, targets.shape[1])  # [N], or [N, C] placed like loss_mask
        batch_advantages = jax.device_put(values, self.train_sharding if values.ndim == 2 else self.row_sharding)
        if self.teacher is not None:  # [N, C]: the teacher's per-token advantages (grpo_losses.distillation)
            batch_advantages, self.teacher_metrics = self.teacher.advantages(
                batch_advantages, put(trimmed.sampler_logps[:, width:]), loss_mask, input_ids, attention_mask,
                targets, width)
        return UpdateBatch(input_ids, attention_mask, targets, loss_mask, batch_advantages,
                           old_logp, ref_logp, sampler_logp, prompt_width=width)

    def old_logps(self, trimmed, weights, input_ids, attention_mask, targets, width) -> Optional[jax.Array]:
        """Sampler log-probs when asked; None (exactly on-policy) for a single epoch, where the loss
        takes stop_grad(logp) as the old training log-prob (also for the mismatch correction: the
        params have not moved since the rollout); else one forward."""
        if self.cfg.rollout.use_sampler_logps:
            return jax.device_put(trimmed.sampler_logps[:, width:], self.train_sharding)
        if not self.built.scores_old_logps:
            return None  # params do not change before the only update: ratio is exactly 1
        return self.score(weights, input_ids, attention_mask, targets, width)

    def score(self, weights, input_ids, attention_mask, targets, width: int) -> jax.Array:
        args = (weights, input_ids, attention_mask, targets)
        self.memory.check("log-probs", self.built.score, *args, prompt_width=width)
        return self.built.score(*args, prompt_width=width)

    def run_updates(self, batch: UpdateBatch) -> dict:
        totals: dict[str, float] = {}
        for _ in range(self.cfg.train.ppo_epochs):
            args = (self.state.params, self.state.opt_state, batch, *self.built.frozen)
            self.memory.check("train step", self.built.update, *args)
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
        return training_eval(self.built, self.forward_params(self.state.params), self.eval_tasks, self.eval_key(),
                             self.eval_ks)

    def eval_due(self) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and (self.state.step % every == 0 or self.state.step == self.cfg.train.steps)

    # ---- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        if isinstance(self.sampler, CarryingSampler):  # the carried rows are run state, saved with the step's params
            self.state.carried = self.sampler.state()
        self.checkpoints.save(self.state, self.built.inputs.task.state(), self.built.qcfg.to_hf_dict(),
                              config_to_dict(self.cfg), lora_base=self.built.lora and self.built.lora.fingerprint)

    def restore(self, resume_from: Resume) -> None:
        """Continues from the newest readable checkpoint of `resume_from`: params, optimizer,
        RNG key, counters, data position."""
        if self.built.lora is not None:
            where = self.checkpoints.directory / str(resume_from.steps[0])
            check_same_base(resume_from.meta.get("lora_base"), self.built.lora.fingerprint, where)
        step = self.checkpoints.restore_newest(resume_from, self.state, self.built.inputs.task, self.built.mesh)
        if isinstance(self.sampler, CarryingSampler) and self.state.carried is not None:
            try:
                self.sampler.restore(self.state.carried)
            except ValueError as exc:
                raise UserError(f"checkpoint {self.checkpoints.directory / str(step)}: {exc}") from None
        print(f"resumed from step {step} of {self.checkpoints.directory}", file=sys.stderr)

    # ---- the job -----------------------------------------------------------------
    def run(self) -> dict:
        is_main = self.built.layout.process_index == 0
        (self.run_dir / "config.yaml").write_text(config_to_yaml(self.cfg))
        if is_main:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.state.step)
        logger = MetricsLogger(self.cfg.logging, self.run_dir, self.cfg.train.steps, config_to_dict(self.cfg),
                               is_main_process=is_main)
        try:
            with StopRequest() as stop:
                metrics = self.train_steps(logger, stop)
        finally:
            logger.close()
            try:
                self.checkpoints.close()  # a save in flight completes before the process exits
            finally:
                self.lock.release()
        if is_main:
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


def note_void_correction(cfg: RunConfig) -> None:
    """One start-up line when the mismatch correction is on but cannot do anything."""
    if cfg.loss.mismatch_correction != "none" and cfg.rollout.use_sampler_logps:
        print(f"grpo-run: note: loss.mismatch_correction = {cfg.loss.mismatch_correction} has nothing to correct: "
              "with rollout.use_sampler_logps: true the old log-probs are the sampler's, so every ratio is 1; "
              "set rollout.use_sampler_logps=false to correct the rollout/training mismatch", file=sys.stderr)


def trained_rows(result: RolloutResult, advantages, loss_cfg) -> np.ndarray:
    """[N] float32 host values, 1 on rows the loss trains on: the dynamic-sampling keep mask,
    without completions cut at max_new_tokens when `mask_truncated_completions` (DAPO)."""
    keep = np.asarray(advantages.keep, np.float32)
    if loss_cfg.mask_truncated_completions:
        keep = keep * host_array(result.finished).astype(np.float32)
    return keep


def train(cfg: RunConfig, registry: Registry, resume: bool = False) -> dict:
    """Runs the whole job; returns the last step's metrics."""
    return Trainer(cfg, registry, resume=resume).run()
