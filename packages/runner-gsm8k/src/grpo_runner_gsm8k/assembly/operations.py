"""What a training run keeps beside its model: run directory and its lock, checkpointer,
memory guard, metric sinks, eval tasks (and a multi-turn run's eval rollout), the reference
weights and the teacher's scoring. Built by `run.build_run` for training; eval and the plan's
abstract twin have none."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax

from grpo_core.config_io import config_to_dict, config_to_yaml
from grpo_core.contracts import MemoryCheckedRollout, ProjectingRollout

from grpo_runner_gsm8k.assembly.build import check_run_dir, prepare_run_dir
from grpo_runner_gsm8k.operations.checkpoint import Checkpointer, Resume, resume_point
from grpo_runner_gsm8k.costs.roofline import decode_seconds
from grpo_runner_gsm8k.assembly.eval_tasks import checked_eval_tasks
from grpo_runner_gsm8k.evaluation.evaluate import eval_ks
from grpo_runner_gsm8k.evaluation.multi_turn import MultiTurnEval
from grpo_runner_gsm8k.operations.lock import RunDirLock
from grpo_runner_gsm8k.operations.memory_check import MemoryGuard
from grpo_runner_gsm8k.operations.atomic import write_text_atomic
from grpo_runner_gsm8k.operations.metrics import MetricsLogger, truncate_metrics
from grpo_runner_gsm8k.assembly.teacher import TeacherScoring
from grpo_runner_gsm8k.costs.tpu_target import generation_of


@dataclass(frozen=True)
class Operations:
    """reference: the KL term's weights (None unless loss.beta > 0), made before any restore:
    the reference is the starting policy. The lock is held from here until `Trainer.run` ends."""

    run_dir: Path
    lock: RunDirLock
    memory: MemoryGuard
    checkpoints: Checkpointer
    logger: MetricsLogger
    eval_tasks: dict
    eval_ks: list[int]
    reference: Any
    teacher: Optional[TeacherScoring]
    eval_turns: Optional[MultiTurnEval] = None  # a multi-turn run's eval rollout (its own tools)


def start_point(cfg: Any, resume: bool) -> Optional[Resume]:
    """The checkpoint to continue from (None: a fresh start); bad input fails before anything is
    built or written."""
    check_run_dir(cfg.logging)
    return resume_point(Path(cfg.logging.dir), config_to_dict(cfg), required=resume)


def project_decodes(rollout: Any) -> None:
    """On TPU chips of a known generation the rollout picks its decode layout by projected
    time, as `grpo-run --plan --target` does."""
    chip = generation_of(jax.devices()[0])
    if chip is not None and isinstance(rollout, ProjectingRollout):
        rollout.project_decodes_with(functools.partial(decode_seconds, chip))


def build_operations(run: Any, resume_from: Optional[Resume]) -> Operations:
    """The operations of built run `run` (a grpo_runner_gsm8k.assembly.run.BuiltRun without them); the
    state is restored from `resume_from`. The lock is released if anything after it fails."""
    cfg = run.cfg
    memory = MemoryGuard(cfg.model.remat)
    if isinstance(run.rollout, MemoryCheckedRollout):  # the jax backend checks its own compiles
        run.rollout.memory_check = memory.check_compiled
    project_decodes(run.rollout)
    eval_turns = MultiTurnEval(run, run.registry) if cfg.eval.every_steps and cfg.rollout.multi_turn.enabled else None
    eval_tasks = checked_eval_tasks(run, run.registry, eval_turns) if cfg.eval.every_steps else {}
    run_dir = prepare_run_dir(cfg.logging)
    lock = RunDirLock(run_dir)
    if run.layout.process_index == 0:  # the processes of one multi-host run share the directory
        lock.acquire()
    try:
        return _locked_operations(run, resume_from, memory, (eval_tasks, eval_turns), run_dir, lock)
    except BaseException:
        lock.release()
        raise


def _locked_operations(run: Any, resume_from: Optional[Resume], memory: MemoryGuard,
                       evals: tuple[dict, Optional[MultiTurnEval]], run_dir: Path, lock: RunDirLock) -> Operations:
    cfg, state = run.cfg, run.state
    reference = run.policy.reference(state.params) if run.logps.reference else None
    # the teacher is its own frozen model, never the reference (LoRA's base without adapters)
    teacher = None if run.teacher is None else TeacherScoring(run.teacher, cfg.teacher, cfg.rollout.n, memory.check)
    checkpoints = Checkpointer(run_dir, cfg.checkpoint)
    if resume_from is not None:
        restore(run, checkpoints, resume_from)
    return Operations(run_dir, lock, memory, checkpoints, metric_sinks(run, run_dir), evals[0], eval_ks(cfg.eval),
                      reference, teacher, evals[1])


def restore(run: Any, checkpoints: Checkpointer, resume_from: Resume) -> None:
    """Continues from the newest readable checkpoint of `resume_from`: params, optimizer, RNG key,
    counters, data position and the carried rows (`state.carried`, for the step sampler)."""
    run.policy.check_checkpoint(resume_from.meta.get("lora_base"), checkpoints.directory / str(resume_from.steps[0]))
    step = checkpoints.restore_newest(resume_from, run.state, run.inputs.task, run.mesh)
    print(f"resumed from step {step} of {checkpoints.directory}", file=sys.stderr)


def metric_sinks(run: Any, run_dir: Path) -> MetricsLogger:
    """metrics.jsonl (cut back to the restored step: later steps run again), W&B and the progress
    display; the resolved config is written beside them."""
    cfg, is_main = run.cfg, run.layout.process_index == 0
    write_text_atomic(run_dir / "config.yaml", config_to_yaml(cfg))
    if is_main:
        truncate_metrics(run_dir / "metrics.jsonl", run.state.step)
    return MetricsLogger(cfg.logging, run_dir, cfg.train.steps, config_to_dict(cfg), is_main_process=is_main)

