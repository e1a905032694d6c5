"""The GRPO loop: rollout -> rewards -> advantages -> update -> eval -> log.

One step: P prompts x K samples are rolled out with the current policy, scored,
turned into group-relative advantages, and used for `train.ppo_epochs` updates,
each accumulating exact gradients over micro-batches (see step.py).
"""

from __future__ import annotations

import time
from collections import deque

import jax
import numpy as np

from grpo_core.config import RunConfig
from grpo_core.config_io import config_to_dict
from grpo_core.errors import UserError
from grpo_core.registry import Registry
from grpo_meshes import train_batch_sharding
from grpo_core.rollout_records import DecodeTally, RolloutResult, waste_metrics

from grpo_runner_gsm8k.advantages import step_advantages
from grpo_runner_gsm8k.build import prompt_token_ids
from grpo_runner_gsm8k.checkpoint import TrainState
from grpo_runner_gsm8k.evaluation import decode_completions, rollout_prompts, training_eval
from grpo_runner_gsm8k.loss_inputs import loss_inputs
from grpo_runner_gsm8k.metrics import MetricsLogger
from grpo_runner_gsm8k.operations import Operations
from grpo_runner_gsm8k.train_metrics import memory_metrics, objective_metrics
from grpo_runner_gsm8k.multihost import gather_objects, host_array
from grpo_runner_gsm8k.multi_turn_step import multi_turn_sampler
from grpo_runner_gsm8k.partial_step import PartialSampler
from grpo_runner_gsm8k.preemption import StopRequest
from grpo_runner_gsm8k.refill import Sampled, merge_results, merge_scores, needs_more, pick_groups, refill_metrics
from grpo_runner_gsm8k.run import BuiltRun, build_run
from grpo_runner_gsm8k.scoring import score
from grpo_runner_gsm8k.step import UpdateBatch, update_advantages


EVAL_STREAM = 0x45564C  # folded into train.seed's key for eval sampling, apart from the training stream


def tokenize_prompts(run: BuiltRun, examples: list) -> list[list[int]]:
    """Token ids of the prompts: from the ids checked at start where there are, else tokenized now."""
    inputs = run.inputs
    unseen = [ex for ex in examples if ex.id not in inputs.prompt_ids]
    fresh = iter(prompt_token_ids(inputs.tokenizer, inputs.task.use_chat_template, unseen,
                                  system_prompt=run.cfg.task.system_prompt, max_length=run.cfg.rollout.max_prompt_length)
                 if unseen else ())
    return [inputs.prompt_ids[ex.id] if ex.id in inputs.prompt_ids else next(fresh) for ex in examples]


def rollout(run: BuiltRun, weights, examples: list, key, sampling) -> RolloutResult:
    """One rollout of the examples' prompts with `weights` (see evaluation.rollout_prompts)."""
    return rollout_prompts(run, weights, tokenize_prompts(run, examples), key, sampling)


class Trainer:
    """Runs the steps of a built run; `run()` is the whole job."""

    def __init__(self, built: BuiltRun):
        """`built` is a training run (`build_run(..., training=True)`); its lock is released if
        what is made here fails."""
        self.built = built
        try:
            self.multi_turn = multi_turn_sampler(self.built, self.registry)
            self.teacher_metrics: dict = {}
            self.step_times: deque = deque(maxlen=10)  # seconds of the last steps, for the average metric
            self.train_sharding = train_batch_sharding(self.built.mesh)
            self.row_sharding = train_batch_sharding(self.built.mesh, ndim=1)
            self.partial = (PartialSampler(self.built, tokenize_prompts, decode_completions)
                            if self.cfg.rollout.partial.enabled else None)
            self.restore_carried()
        except BaseException:
            self.ops.lock.release()
            raise

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
        """`params` as rollout, scoring and eval take them (see grpo_runner_gsm8k.policy)."""
        return self.built.policy.forward_params(params)

    # ---- one step -------------------------------------------------------------
    def step(self) -> dict:
        start = time.monotonic()
        self.state.key, key = jax.random.split(self.state.key)
        weights = self.forward_params(self.state.params)
        times = {"rollout_s": 0.0, "reward_s": 0.0}
        tally = DecodeTally()
        (_, result, scores), sampling_metrics = self.sample_step(weights, key, times, tally)

        reward_start = time.monotonic()
        advantages = step_advantages(self.built.inputs.estimator, scores, self.cfg.rollout.n,
                                     self.cfg.loss.dynamic_sampling)
        times["reward_s"] += time.monotonic() - reward_start

        update_start = time.monotonic()
        batch = self.update_batch(result, advantages, weights)
        del weights  # freed before the update, which casts the masters inside its own jit
        train_metrics = self.run_updates(batch)
        update_s = time.monotonic() - update_start

        step_s = time.monotonic() - start
        self.state.step += 1
        self.step_times.append(step_s)
        metrics = self.step_metrics(result, scores, advantages, train_metrics,
                                    dict(**times, update_s=update_s, step_s=step_s))
        return {**metrics, **sampling_metrics, **waste_metrics(tally, host_array(result.lengths)), **self.teacher_metrics}

    def sample_step(self, weights, key, times: dict, tally: DecodeTally) -> tuple[Sampled, dict]:
        """The groups this step trains on, and the metrics of how they were sampled."""
        if self.multi_turn is not None:
            return self.multi_turn.sample(weights, key, times, tally)
        if self.partial is None:
            return self.sample_batch(weights, key, times, tally)
        sampled, _, metrics = self.partial.sample(weights, key, self.state.step, times, tally)
        return sampled, metrics

    def scored_rollout(self, weights, key, times: dict, tally: DecodeTally) -> Sampled:
        """Fresh prompts from the task, rolled out with `weights` and scored; adds its seconds to
        `times` and its decode work to `tally`."""
        start = time.monotonic()
        inputs = self.built.inputs
        examples = gather_objects(inputs.task.train_batch(inputs.prompts_per_process))
        result = rollout(self.built, weights, examples, key, self.built.sampling)
        jax.block_until_ready(result.completion_ids)
        tally.add_synchronous(host_array(result.lengths))
        reward_start = time.monotonic()
        answers = [ex.answer for ex in examples for _ in range(self.cfg.rollout.n)]
        scores = score(inputs.rewards, decode_completions(inputs.tokenizer, result), answers)
        times["rollout_s"] += reward_start - start
        times["reward_s"] += time.monotonic() - reward_start
        return Sampled(examples, result, scores)

    def sample_batch(self, weights, key, times: dict, tally: DecodeTally) -> tuple[Sampled, dict]:
        """The step's rollout batch and the refill metrics ({} unless dynamic sampling refills,
        see refill.py)."""
        rounds = [self.scored_rollout(weights, key, times, tally)]
        loss, n, want = self.cfg.loss, self.cfg.rollout.n, self.cfg.rollout.prompts_per_step
        if not (loss.dynamic_sampling and loss.dynamic_sampling_mode == "refill"):
            return rounds[0], {}
        while needs_more(rounds, n, want, loss.max_extra_rollouts):
            self.state.key, key = jax.random.split(self.state.key)
            rounds.append(self.scored_rollout(weights, key, times, tally))
        picks = pick_groups(rounds, n, want)
        result = self.on_train_devices(merge_results([r.result for r in rounds], picks, n))
        examples = [rounds[i].examples[g] for i, g in picks]
        scores = merge_scores([r.scores for r in rounds], picks, n)
        return Sampled(examples, result, scores), refill_metrics(rounds, picks, n)

    def on_train_devices(self, result: RolloutResult) -> RolloutResult:
        """A host-side result placed like the update batch (host values: the same on every process)."""
        return jax.tree.map(lambda x: jax.device_put(x, self.train_sharding if x.ndim == 2 else self.row_sharding),
                            result)

    def update_batch(self, result: RolloutResult, advantages, weights) -> UpdateBatch:
        """The update's inputs; `weights` (the rollout's compute-dtype params) score old log-probs."""
        trimmed = self.built.rollout.trim(result)
        width = trimmed.prompt_width
        put = lambda x: jax.device_put(x, self.train_sharding)  # noqa: E731
        input_ids, attention_mask = put(trimmed.input_ids), put(trimmed.attention_mask)
        targets = put(trimmed.input_ids[:, width:])
        inputs = loss_inputs(self.built.logps, advantages.keep, host_array(result.finished),
                             lambda: put(trimmed.sampler_logps[:, width:]),
                             lambda w: self.score(w, input_ids, attention_mask, targets, width),
                             weights, self.ops.reference)
        loss_mask = put(trimmed.completion_mask[:, width:]) * put(inputs.keep[:, None])  # host keep: same everywhere
        values = update_advantages(advantages.advantages, targets.shape[1])  # [N], or [N, C] placed like loss_mask
        batch_advantages = jax.device_put(values, self.train_sharding if values.ndim == 2 else self.row_sharding)
        if self.ops.teacher is not None:  # [N, C]: the teacher's per-token advantages (grpo_losses.distillation)
            batch_advantages, self.teacher_metrics = self.ops.teacher.advantages(
                batch_advantages, put(trimmed.sampler_logps[:, width:]), loss_mask, input_ids, attention_mask,
                targets, width)
        return UpdateBatch(input_ids, attention_mask, targets, loss_mask, batch_advantages,
                           inputs.old_logp, inputs.ref_logp, inputs.sampler_logp, prompt_width=width)

    def score(self, weights, input_ids, attention_mask, targets, width: int) -> jax.Array:
        args = (weights, input_ids, attention_mask, targets)
        self.ops.memory.check("log-probs", self.built.score, *args, prompt_width=width)
        return self.built.score(*args, prompt_width=width)

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
                             self.eval_key(), self.ops.eval_ks)

    def eval_due(self) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and (self.state.step % every == 0 or self.state.step == self.cfg.train.steps)

    # ---- checkpoints ---------------------------------------------------------------
    def save(self) -> None:
        if self.partial is not None:  # the carried rows are run state, saved with the step's params
            self.state.carried = self.partial.pool.state()
        self.checkpoints.save(self.state, self.built.inputs.task.state(), self.built.qcfg.to_hf_dict(),
                              config_to_dict(self.cfg), lora_base=self.built.policy.fingerprint)

    def restore_carried(self) -> None:
        """The rows a restored checkpoint carried into its next step, back in the partial sampler's pool."""
        if self.partial is None or self.state.carried is None:
            return
        try:
            self.partial.pool.restore(self.state.carried)
        except ValueError as exc:
            raise UserError(f"checkpoint {self.checkpoints.directory / str(self.state.step)}: {exc}") from None

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
