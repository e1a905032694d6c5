"""A mixture-of-experts policy's router statistics in the update, and its load-balancing loss.

The statistics come from one router pass over the update's whole batch on the params before
the update (grpo_core.models.router_stats: real tokens only), beside the policy loss's
micro-batched forward: the balance loss multiplies two averages over all tokens, so it is
not a sum over micro-batches. With `loss.router_balance_coef` c > 0 the update's gradient is

    grad(policy loss) + c * grad(balance loss)

(the gradient of the summed objective); c = 0 computes no gradient and leaves the policy
gradient as it is. Memory: that pass holds the whole batch's activations, not a micro-batch's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.errors import ConfigError
from grpo_core.models.precision import compute_params
from grpo_core.models.router_stats import RouterStats, router_statistics


def router_metrics(stats: RouterStats) -> dict:
    """router/* metrics: the balance loss, the largest and smallest expert share over all
    layers (1 / E each when balanced), each expert's share averaged over the layers, and the
    dropped assignments (0: dropless dispatch); with routing replay the share of recorded
    assignments the router itself would have chosen (router/replay_agreement)."""
    per_expert = jnp.mean(stats.load, axis=0)
    replay = {} if stats.agreement is None else {"router/replay_agreement": stats.agreement}
    return {"router/balance_loss": stats.balance_loss, "router/max_load": jnp.max(stats.load),
            "router/min_load": jnp.min(stats.load), "router/dropped": jnp.zeros((), jnp.float32),
            **{f"router/load/expert_{e}": share for e, share in enumerate(per_expert)}, **replay}


def router_terms(graphdef: nnx.GraphDef, compute_dtype: Any, coef: float, params: nnx.State, input_ids: jax.Array,
                 attention_mask: jax.Array, frozen: Any = None, routing: Any = None) -> tuple[Optional[Any], dict]:
    """(coef * the balance loss's float32 gradient w.r.t. `params`, or None when coef is 0;
    router/* metrics). `frozen`: a LoRA run's base state, as in the update; `routing`: the
    experts the update replays (None: none)."""
    def balance(weights):
        state = weights if frozen is None else nnx.merge_state(frozen, weights)
        stats = router_statistics(nnx.merge(graphdef, state), input_ids, attention_mask, routing)
        return stats.balance_loss, (stats.load, stats.agreement)  # aux must be a pytree: RouterStats is not one

    weights = compute_params(params, compute_dtype)
    if coef == 0.0:
        loss, (load, agreement) = balance(weights)
        return None, router_metrics(RouterStats(load, loss, agreement))
    (loss, (load, agreement)), grads = jax.value_and_grad(balance, has_aux=True)(weights)
    return (jax.tree.map(lambda g: coef * g.astype(jnp.float32), grads),
            router_metrics(RouterStats(load, loss, agreement)))


def router_update_terms(graphdef: nnx.GraphDef, compute_dtype: Any, coef: Optional[float]):
    """The update's `(grads, params, batch, frozen) -> (grads, router/* metrics)`: `grads` (the policy
    loss's) plus `router_terms`' balance gradient; for a dense model (coef None) unchanged, no metrics."""
    def with_router_terms(grads, params, batch, frozen):
        if coef is None:
            return grads, {}
        router_grads, metrics = router_terms(graphdef, compute_dtype, coef, params, batch.input_ids,
                                             batch.attention_mask, frozen, batch.routing)
        return grads if router_grads is None else jax.tree.map(jnp.add, grads, router_grads), metrics

    return with_router_terms


def router_coef(loss: Any, qcfg: Any) -> Optional[float]:
    """The update's `router_coef`: None for a dense model (no router/* metrics), else
    `loss.router_balance_coef`. A coefficient set for a dense model is refused, not ignored."""
    if qcfg.family.sparse_mlp:
        return float(loss.router_balance_coef)
    if loss.router_balance_coef > 0.0:
        raise ConfigError(f"loss.router_balance_coef = {loss.router_balance_coef} weighs a mixture-of-experts "
                          f"router's load-balancing loss, but model_type {qcfg.model_type} has no router; "
                          "set loss.router_balance_coef=0")
    return None


def routing_replay(loss: Any, rollout: Any, qcfg: Any) -> bool:
    """`loss.routing_replay`, refused in one line for a dense model and for rollouts that record no
    routing: partial and multi-turn rounds, the model's own decode step (decode_attention: model)
    and the head-parallel decode."""
    if not loss.routing_replay:
        return False
    if not qcfg.family.sparse_mlp:
        raise ConfigError(f"loss.routing_replay = true replays a mixture-of-experts router's choices, but model_type "
                          f"{qcfg.model_type} has no router; set loss.routing_replay=false")
    unrecorded = {"rollout.partial.enabled": rollout.partial.enabled,
                  "rollout.multi_turn.enabled": rollout.multi_turn.enabled,
                  "rollout.options.decode_attention=model": rollout.options.get("decode_attention") == "model",
                  "rollout.options.gather_weights=head_parallel":
                      rollout.options.get("gather_weights") == "head_parallel"}
    for name, used in unrecorded.items():
        if used:
            raise ConfigError(f"loss.routing_replay = true with {name}: that rollout records no routing to replay; "
                              "set loss.routing_replay=false or leave that option at its default")
    return True


def replayed_routing(replay: bool, experts: Any, place: Callable[[Any], Any]) -> Optional[Any]:
    """The update batch's `routing`: with `loss.routing_replay` the trimmed rollout's record
    (TrainBatch.experts) placed by `place`, else None."""
    if not replay:
        return None
    if experts is None:
        raise RuntimeError("loss.routing_replay = true but the rollout returned no routing record "
                           "(RolloutResult.experts); use the jax rollout backend or set loss.routing_replay=false")
    return place(experts)
