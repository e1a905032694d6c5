"""Optimizer and learning-rate schedule from the `train` config section."""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
import optax

from grpo_core.config import TrainConfig
from grpo_core.models.precision import cast_floating


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, then constant / cosine / linear decay to lr * min_lr_ratio."""
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    final = cfg.lr * cfg.min_lr_ratio
    decay = {
        "constant": optax.constant_schedule(cfg.lr),
        "cosine": optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio),
        "linear": optax.linear_schedule(cfg.lr, final, decay_steps),
    }[cfg.schedule]
    if cfg.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def _base_optimizer(cfg: TrainConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    if cfg.optimizer == "adamw":
        return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lion":
        return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    return optax.sgd(lr)


def with_moment_dtype(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """`inner` with its floating state (the moments) kept in `dtype`: float32 gradients
    would otherwise promote bfloat16 moments, and the state's dtype would change."""

    def init(params):
        return cast_floating(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        return updates, cast_floating(state, dtype)

    return optax.GradientTransformation(init, update)


def build_optimizer(cfg: TrainConfig, lr: optax.Schedule,
                    moments: Optional[str] = None) -> optax.GradientTransformation:
    """Clip by global norm (when set), then the configured optimizer following the `lr`
    schedule (`learning_rate_schedule(cfg)`); its moments in the `moments` dtype when given."""
    parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm else []
    optimizer = optax.chain(*parts, _base_optimizer(cfg, lr))
    return optimizer if moments is None else with_moment_dtype(optimizer, jnp.dtype(moments))
