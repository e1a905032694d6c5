"""Expert parallelism of the sparse MoE MLP (`grpo_core.models.moe`): the experts split over one
mesh axis (the rule `expert -> fsdp`), each device holding E / f whole experts, and the tokens
brought to them instead of the experts' weights to the tokens.

Under plain FSDP every device all-gathers each layer's [E, H, I] expert weights (forward and
backward) and reduce-scatters their gradients. Here, in one `jax.shard_map` over the mesh:

    1. each device all-gathers the tokens [n, H] of its expert-axis group, with their experts
       [n, k] and router weights [n, k] (f * n tokens; no gather when the tokens are not split
       over that axis);
    2. runs its E / f local experts on the assignments routed to them (`grouped_swiglu`, dropless;
       assignments of other devices' experts are zeroed), weights them by the router and sums
       each token's k slots in float32, as the replicated path does;
    3. sums the partial outputs over the MLP's tensor-parallel axes (expert columns split over
       `tp`) and reduce-scatters them over the expert axis (psum_scatter), so each device gets
       its own tokens' outputs [n, H] (an all-reduce when the tokens were not split).

Every assignment is computed by exactly one device, so the result is the replicated path's up to
the order of float32 additions; the transposes (all-gather <-> reduce-scatter) give the same
gradients. The expert weights' gradients stay on their device: nothing of them crosses the axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from grpo_core.sharding import Rules, as_tuple, rules_to_dict


@dataclass(frozen=True)
class ExpertParallel:
    """Where the experts and tokens are: `axis` splits the experts (one mesh axis in training, the
    decode's batch axes in the rollout's expert-parallel layout), `tokens` the tokens (the
    activations' batch axes), `mlp` the experts' intermediate columns."""

    mesh: Mesh
    axis: str | tuple[str, ...]
    tokens: tuple[str, ...]
    mlp: tuple[str, ...]


def expert_parallel_from_rules(mesh: Mesh | None, rules: Rules | None, experts: int) -> ExpertParallel | None:
    """The expert parallelism an activation rule table asks for (`expert` mapped to one mesh axis
    of more than one device that divides the experts), else None: the replicated-expert path."""
    table = rules_to_dict(rules or ())
    axis = table.get("expert")
    if mesh is None or not isinstance(axis, str) or axis not in mesh.shape:
        return None
    if mesh.shape[axis] == 1 or experts % mesh.shape[axis]:
        return None
    present = lambda axes: tuple(a for a in as_tuple(axes) if a in mesh.shape)  # noqa: E731
    return ExpertParallel(mesh, axis, present(table.get("batch")), present(table.get("mlp")))


def expert_parallel_moe(plan: ExpertParallel, x: jax.Array, experts: jax.Array, weights: jax.Array,
                        gate: jax.Array, up: jax.Array, down: jax.Array, swiglu) -> jax.Array:
    """x [N, H], experts [N, k] (int), router weights [N, k] -> the weighted sum of each token's
    experts [N, H] in x's dtype (the module doc's steps); `swiglu` is the dropless grouped MLP
    (`grpo_core.models.moe.grouped_swiglu`) run on the local experts."""
    mesh = plan.mesh
    ways = 1
    for axis in plan.tokens:
        ways *= mesh.shape[axis]
    tokens = plan.tokens if x.shape[0] % ways == 0 else ()  # an indivisible N: every device has all
    split = plan.axis in tokens
    row = PartitionSpec(tokens or None)
    mlp = plan.mlp or None
    wide, narrow = PartitionSpec(plan.axis, None, mlp), PartitionSpec(plan.axis, mlp, None)

    def local(x, experts, weights, gate, up, down):
        if split:
            x, experts, weights = (jax.lax.all_gather(a, plan.axis, axis=0, tiled=True) for a in (x, experts, weights))
        out = local_experts(x, experts, weights, gate, up, down, jax.lax.axis_index(plan.axis), swiglu)
        if plan.mlp:
            out = jax.lax.psum(out, plan.mlp)
        out = jax.lax.psum_scatter(out, plan.axis, scatter_dimension=0, tiled=True) if split else \
            jax.lax.psum(out, plan.axis)
        return out.astype(x.dtype)

    run = jax.shard_map(local, mesh=mesh, in_specs=(row, row, row, wide, wide, narrow), out_specs=row)
    return run(x, experts, weights, gate, up, down)


def local_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, index: jax.Array, swiglu) -> jax.Array:
    """The part of each token's output [n, H] (float32) that this device's experts (`index`-th
    block of gate.shape[0]) give: other devices' assignments go to no group and are zeroed."""
    count = gate.shape[0]
    first = index * count
    mine = (experts >= first) & (experts < first + count)  # [n, k]
    # An id past the local experts falls in no group (bincount drops it, the sort puts it last).
    outputs = swiglu(x, jnp.where(mine, experts - first, count), gate, up, down)  # [n, k, H]
    outputs = jnp.where(mine[..., None], outputs, jnp.zeros((), outputs.dtype))
    # As the replicated path: the product in the compute dtype, the k-term sum in float32.
    weighted = outputs * weights.astype(x.dtype)[..., None]
    return jnp.sum(weighted.astype(jnp.float32), axis=1)
