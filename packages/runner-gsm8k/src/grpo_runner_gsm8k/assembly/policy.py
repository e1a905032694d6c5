"""The policy model of a run, decided once by `policy_model`: every parameter trained
(`FullPolicy`, here) or LoRA adapters on a frozen base (`adapters.LoRAPolicy`).

Both answer the same questions, so no other module asks which one a run has:
  train_graphdef   the model the update differentiates (its state: the train state's params)
  policy_graphdef  the model of the weights rollout and scoring take
  frozen           the update's arguments after the batch (LoRA: the base, no gradient)
  base             the frozen base held beside the trained params, or None
  forward_params(params)  the compute-dtype weights of `policy_graphdef` (rollout, scoring, eval)
  reference(params)       the reference model's weights for the KL term (loss.beta > 0)
and the plan's figures of the same weights on abstract params.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from grpo_core.config import ModelConfig
from grpo_core.models.precision import abstract_compute_params, compute_params, needs_cast
from grpo_core.sharding import per_device_bytes

from grpo_runner_gsm8k.assembly.adapters import LoRAPolicy, lora_spec, setup_lora


class FullPolicy:
    """Every parameter trained: float32 masters (model.param_dtype), forward in the compute dtype."""

    def __init__(self, graphdef: nnx.GraphDef, params: Any, compute_dtype: Any):
        self.graphdef, self.compute_dtype = graphdef, compute_dtype
        # the copy keeps the params' shardings exactly (as the plan assumes), size-1 mesh axes included
        self.cast = jax.jit(compute_params, static_argnums=1, out_shardings=jax.tree.map(lambda x: x.sharding, params))

    train_graphdef = policy_graphdef = property(lambda self: self.graphdef)
    frozen: tuple = ()
    base = None
    fingerprint = None  # what a checkpoint records of a LoRA base: nothing here
    adapter_spec = None

    def forward_params(self, params: Any) -> Any:
        """One copy of the masters in the compute dtype per call (the rollout's decode reads it at
        every token: half the bytes of float32 masters), or the params themselves when stored so."""
        return self.cast(params, self.compute_dtype) if needs_cast(params, self.compute_dtype) else params

    def reference(self, params: Any) -> Any:
        """A frozen copy of the starting policy in the compute dtype (only ever run forward)."""
        return jax.tree.map(jnp.copy, self.forward_params(params))

    def abstract_forward_params(self, params: Any) -> Any:
        return abstract_compute_params(params, self.compute_dtype)

    def masters_beside_rollout(self, params: Any) -> int:
        """The stored params stay alive beside their compute-dtype copy when the dtypes differ."""
        return per_device_bytes(params) if needs_cast(params, self.compute_dtype) else 0

    def reference_bytes(self, params: Any) -> int:
        """The reference is a copy of the compute-dtype params."""
        return per_device_bytes(self.abstract_forward_params(params))

    def decide_rollout(self, decode_needs: Optional[int], spare: Optional[int]) -> None:
        """Nothing to decide: the rollout decodes the compute-dtype params."""

    def choose_rollout(self, rollout: Any, shapes_for: Any, devices: list) -> None:
        """Nothing to measure (see decide_rollout)."""

    def check_checkpoint(self, saved_base: Optional[dict], where: Any) -> None:
        """A full-parameter checkpoint carries no base to compare (the config check covers LoRA)."""


PolicyModel = Union[FullPolicy, LoRAPolicy]


def policy_model(model_cfg: ModelConfig, model: nnx.Module, mesh: Mesh, rules: Any,
                 compute_dtype: Any) -> tuple[PolicyModel, nnx.State]:
    """The run's policy model and its initial trained params: the model's params, or (model.lora.rank
    set) float32 adapters attached to the model, whose params become the frozen base."""
    if lora_spec(model_cfg.lora) is None:
        graphdef, params = nnx.split(model)
        return FullPolicy(graphdef, params, compute_dtype), params
    return setup_lora(model_cfg, model, mesh, rules, compute_dtype)
