"""Registers the `jax` rollout backend (entry point `grpo` -> `rollouts`)."""

from __future__ import annotations

from grpo_core import RolloutSpec, hookimpl

from grpo_rollout.backend import JaxRollout, JaxRolloutOptions


@hookimpl
def grpo_rollouts() -> list[RolloutSpec]:
    return [RolloutSpec("jax", JaxRollout, JaxRolloutOptions,
                        "KV-cached jitted Qwen decode (one while loop), exact one-uniform sampling")]
