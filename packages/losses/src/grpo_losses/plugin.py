"""Entry point `grpo = losses`: registers the built-in loss implementations and advantage estimators."""

from __future__ import annotations

from grpo_core import AdvantageSpec, LossSpec, NoOptions, hookimpl

from grpo_losses.estimators import ADVANTAGE_SPECS
from grpo_losses.fused import FusedOptions, build_fused
from grpo_losses.pallas_kernels import PallasOptions, build_pallas
from grpo_losses.reference import build_reference


@hookimpl
def grpo_losses() -> list[LossSpec]:
    return [
        LossSpec("jax", build_reference, NoOptions, "Reference: materialises float32 [B, T, V] logits"),
        LossSpec("fused", build_fused, FusedOptions,
                 "Pure-JAX custom VJP over token x vocab blocks, never builds [B, T, V]; vocab may be sharded over tp"),
        LossSpec("pallas", build_pallas, PallasOptions,
                 "Pallas kernels (TPU Mosaic; CPU interpret mode), never builds [B, T, V]"),
    ]


@hookimpl
def grpo_advantages() -> list[AdvantageSpec]:
    return list(ADVANTAGE_SPECS)
