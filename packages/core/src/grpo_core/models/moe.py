"""Sparse mixture-of-experts MLP (Qwen3-MoE): a top-k router and dropless SwiGLU experts run as
grouped matmuls.

Routing (as HF `Qwen3MoeSparseMoeBlock`): router logits = x . gate in x's dtype, softmax in
float32, the k most probable experts per token, their probabilities renormalised to sum to 1
when `norm_topk_prob`, cast to x's dtype. A token's output is the sum over its k experts of
weight * expert(x), each expert a SwiGLU MLP of `moe_intermediate_size`.

Dropless dispatch: the N*k (token, expert) assignments are sorted by expert, so each expert's
rows are one contiguous group, and one grouped matmul (`grouped_matmul.ragged_matmul`:
`jax.lax.ragged_dot`, a Pallas kernel on TPU) multiplies every group by its own expert's weights:
no capacity factor, no token dropped, no padding of groups. The outputs are put back in (token,
slot) order and summed with the router weights.

Routing replay (`replayed`): a token may come with recorded experts (the rollout's routing); it
then goes to them, weighted by the current router's probabilities there, renormalised like the
top-k ones, so the router keeps its gradient.

Parameters of one layer (stacked over `layers` like every layer parameter):
    gate.kernel              [H, E]     (embed, expert)        the router
    experts.{gate,up}_proj   [E, H, I]  (expert, embed, mlp)
    experts.down_proj        [E, I, H]  (expert, mlp, embed)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.models.grouped_matmul import ragged_matmul
from grpo_core.models.layers import INIT_STD, Projection, logical_param
from grpo_core.models.moe_parallel import expert_parallel_from_rules, expert_parallel_moe

_normal = jax.nn.initializers.normal(INIT_STD)  # as the dense kernels


class Experts(nnx.Module):
    """E SwiGLU MLPs, their weights stacked on a leading `expert` axis."""

    def __init__(self, experts: int, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
        wide = ("expert", "embed", "mlp")
        self.gate_proj = logical_param(rngs, _normal, (experts, hidden, intermediate), dtype, wide)
        self.up_proj = logical_param(rngs, _normal, (experts, hidden, intermediate), dtype, wide)
        narrow = ("expert", "mlp", "embed")
        self.down_proj = logical_param(rngs, _normal, (experts, intermediate, hidden), dtype, narrow)

    def __call__(self, x: jax.Array, experts: jax.Array) -> jax.Array:
        """x [N, H], experts [N, k] (int) -> [N, k, H]: each token through each of its experts."""
        return grouped_swiglu(x, experts, self.gate_proj[...], self.up_proj[...], self.down_proj[...])


def grouped_swiglu(x: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Dropless expert MLPs (module doc): x [N, H], experts [N, k] -> [N, k, H] in x's dtype."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # [N*k, H]

    def matmul(lhs, weights):
        # f32 accumulation, result in the compute dtype (as the dense Projection).
        return ragged_matmul(lhs, weights, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)

    out = matmul(jax.nn.silu(matmul(rows, gate)) * matmul(rows, up), down)
    unsorted = jnp.take(out, jnp.argsort(order), axis=0)
    return unsorted.reshape(tokens, k, -1)


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits [N, E] -> (probabilities [N, E] f32, top-k weights [N, k] f32, experts [N, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts


class SparseMoE(nnx.Module):
    """The MoE MLP block: [..., H] -> [..., H]."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, normalize: bool, *, dtype,
                 rngs: nnx.Rngs):
        self.top_k, self.normalize = top_k, normalize
        self.gate = Projection((hidden,), (experts,), ("embed", "expert"), bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(experts, hidden, intermediate, dtype=dtype, rngs=rngs)
        self.expert_parallel = None  # set_expert_parallel: the experts split over a mesh axis (moe_parallel)

    def set_expert_parallel(self, mesh, rules) -> None:
        """Expert parallelism when the activation `rules` map `expert` to a mesh axis that divides
        the experts (grpo_core.models.moe_parallel); otherwise the replicated-expert path."""
        experts = self.experts.gate_proj.shape[-3]  # [(L,) E, H, I]
        self.run_experts_as(expert_parallel_from_rules(mesh, rules, experts))

    def run_experts_as(self, plan) -> None:
        """Run the experts as `plan` holds them (a moe_parallel.ExpertParallel; None: replicated),
        e.g. the rollout's expert-parallel decode layout."""
        self.expert_parallel = plan

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [N, H] -> `route`'s (probabilities, weights, experts) for each token."""
        return route(self.gate(x), self.top_k, self.normalize)

    def __call__(self, x: jax.Array, replay: jax.Array | None = None) -> jax.Array:
        return self.routed(x, replay)[0]

    def routed(self, x: jax.Array, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [..., H] -> (output [..., H], the experts each token went to [N, k]). `replay` [..., k]
        (int, -1: no record): the recorded experts of routing replay (`replayed`)."""
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, experts = self.route(flat)
        if replay is not None:
            weights, experts = replayed(probs, weights, experts, replay.reshape(-1, self.top_k).astype(jnp.int32),
                                        self.normalize)
        return self.mixed(flat, experts, weights).reshape(x.shape), experts

    def mixed(self, flat: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """flat [N, H], experts and router weights [N, k] -> the weighted sum of each token's experts [N, H]."""
        if self.expert_parallel is not None:
            e = self.experts
            return expert_parallel_moe(self.expert_parallel, flat, experts, weights, e.gate_proj[...], e.up_proj[...],
                                       e.down_proj[...], grouped_swiglu)
        outputs = self.experts(flat, experts)  # [N, k, H]
        # HF multiplies in the compute dtype; the k-term sum accumulates in f32.
        weighted = outputs * weights.astype(flat.dtype)[..., None]
        return jnp.sum(weighted.astype(jnp.float32), axis=1).astype(flat.dtype)


def replayed(probs: jax.Array, weights: jax.Array, experts: jax.Array, replay: jax.Array,
             normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Routing replay (rollout routing replay, 2025): a token with a record (replay [N, k] >= 0) goes
    to the recorded experts, weighted by the current router's probabilities there (renormalised
    when `normalize`), so the router still gets a gradient; a token without one (-1) keeps its own
    top-k `weights`, `experts`."""
    has_record = replay[:, :1] >= 0  # a token's record is all k slots or none
    chosen = jnp.where(has_record, replay, experts)
    at_chosen = jnp.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        at_chosen = at_chosen / jnp.sum(at_chosen, axis=-1, keepdims=True)
    return jnp.where(has_record, at_chosen, weights), chosen
