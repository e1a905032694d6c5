"""Checks of the `teacher:` section (on-policy distillation) at load, before any device work."""

from __future__ import annotations

import dataclasses

from grpo_core.config import RunConfig, TeacherConfig
from grpo_core.errors import ConfigError


def check_teacher_section(tree: dict) -> None:
    """A `teacher:` section written without a model path is a mistake, not "no teacher"; the
    section exactly as `--print-config` writes it for a run without a teacher is accepted."""
    if "teacher" not in tree:
        return
    section = tree["teacher"]
    if isinstance(section, dict) and (section.get("path") or section == dataclasses.asdict(TeacherConfig())):
        return
    shown = "null" if section is None else repr(section)
    raise ConfigError(f"teacher section without teacher.path (teacher = {shown}); set teacher.path to the "
                      "teacher's HF model directory or Hub id, or remove the teacher section")


def check_teacher(cfg: RunConfig) -> None:
    """Settings that contradict distillation alone."""
    if cfg.teacher.path and not cfg.teacher.use_task_reward and cfg.loss.dynamic_sampling:
        raise ConfigError("loss.dynamic_sampling with teacher.use_task_reward = false: dynamic sampling drops groups "
                          "by their task rewards, which distillation alone does not train on; set "
                          "loss.dynamic_sampling=false or teacher.use_task_reward=true")
    if cfg.teacher.path and cfg.teacher.baseline == "leave_one_out" and cfg.rollout.n < 2:
        raise ConfigError(f"teacher.baseline = 'leave_one_out' with rollout.n = {cfg.rollout.n}: the baseline is the mean "
                          "over the other rows of a prompt's group; set rollout.n >= 2 or teacher.baseline=none")
    if cfg.teacher.path and cfg.teacher.estimator == "full" and cfg.teacher.baseline != "none":
        raise ConfigError(f"teacher.baseline = {cfg.teacher.baseline!r} with teacher.estimator = 'full': the exact KL "
                          "has no sampling variance for a baseline to reduce; set teacher.baseline=none")
    if cfg.teacher.path and cfg.teacher.divergence != "reverse" and cfg.teacher.estimator != "full":
        raise ConfigError(f"teacher.divergence = {cfg.teacher.divergence!r} with teacher.estimator = "
                          f"{cfg.teacher.estimator!r}: the sampled estimate is of the reverse KL only; set "
                          "teacher.estimator=full or teacher.divergence=reverse")
