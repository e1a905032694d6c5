"""Head-parallel decode: the attention runs where its KV heads are, 2 collectives per layer.

The model-parallel decode (grpo_rollout.model_parallel) splits q_proj and o_proj by query heads
over all D devices but keeps the KV cache split by rows (a model has fewer KV heads than
devices, e.g. 2 over 8), so q travels to the rows' devices and the attention back: 4
collectives per layer and token, and at a few microseconds each that latency is a large part
of a decode step. Here the devices form a (rows R, kv A) grid, A = gcd(KV heads, D):

- device (r, a) holds KV head group a of the rows in row group r (the cache split both ways)
  and the q, k, v and o_proj weights of head group a (replicated over the R row groups);
- it projects q, k and v of its own rows and heads from the replicated residual, attends
  locally, and multiplies by its slice of o_proj: a partial sum over head groups for its
  rows. Placed at its rows in a zero [B, H] block, one all-reduce over all D devices sums the
  head groups and gathers the rows at once;
- the MLP is split by columns over all D devices (down_proj's partial sums all-reduced), as in
  the model-parallel decode; the vocabulary too.

So each layer runs 2 all-reduces per token, against 2 all-to-alls and 2 all-reduces. The price
is weight bytes: each device reads 1/A of the attention weights instead of 1/D (for a 3B
model with 2 KV heads on 8 chips, about 5 MB more per layer and token). `auto` compares it
with the other layouts by projected time (grpo_rollout.gather).

Across TPU slices the grid is (slice S, rows R, kv A) within each slice: the collectives above
run over a slice's devices, each slice decoding its own rows ("replicated" means within a slice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec

from grpo_core.sharding import variable_names
from grpo_rollout.model_parallel import (SLICE, ActivationLayout, LayoutUnsupported, embed_from_slice,  # noqa: F401 (re-exported)
                                         named, value_spec)

ROWS, KV = "rows", "kv"  # axes of the decode's device grid within a slice
BOTH = (ROWS, KV)  # flattened in the devices' own order: the batch's row order within a slice
ALL_ROWS = (SLICE, ROWS)  # what splits the rows
HEAD_DIMENSIONS = ("heads", "kv_heads")  # split over KV (query head h serves KV head h // G)
COLUMN_DIMENSIONS = ("mlp", "vocab")  # split over all devices


def grid_mesh(mesh: Mesh, kv_heads: int, slices: int = 1) -> Mesh:
    """The (slice, rows, kv) grid over `mesh`'s devices in their order, kv = gcd(kv_heads, devices
    of a slice): device (s, r, a) is the mesh's device (s * R + r) * kv + a, so row group r of slice
    s holds the rows that those kv devices hold when the batch is split over the whole mesh."""
    devices = np.asarray(mesh.devices).reshape(-1)
    ways = math.gcd(kv_heads, devices.size // slices)
    return Mesh(devices.reshape(slices, devices.size // slices // ways, ways), (SLICE,) + BOTH)


def unsupported(config: Any, rows: int, groups: int, devices: int, slices: int = 1) -> str | None:
    """Why the head-parallel decode cannot run this model and batch on `devices` in `slices` slices, or None."""
    per_slice = devices // slices
    ways = math.gcd(config.num_key_value_heads, per_slice)
    row_groups = devices // ways
    columns = config.moe_intermediate_size if config.num_experts else config.intermediate_size  # a MoE's experts'
    if columns % per_slice:
        return f"the MLP's {columns} columns do not split over {per_slice} devices"
    if rows % row_groups or groups % row_groups:
        return (f"{groups} prompts ({rows} rows) do not split into {row_groups} row groups of whole prompts "
                f"({devices} devices / {ways} KV head groups): use a multiple of {row_groups} prompts")
    return None


def weight_spec(names: tuple, shape: tuple, mesh: Mesh) -> PartitionSpec:
    """Heads split over the kv axis, MLP columns and vocabulary over all devices, the rest
    replicated; a dimension its devices do not divide stays replicated."""
    spec: list = [None] * len(shape)
    for dim, (name, size) in enumerate(zip(names, shape)):
        axes = KV if name in HEAD_DIMENSIONS else BOTH if name in COLUMN_DIMENSIONS else None
        if axes is not None and size % math.prod(mesh.shape[a] for a in jax.tree.leaves(axes)) == 0:
            spec[dim] = axes
    return PartitionSpec(*spec)


def weight_specs(weights: nnx.State, mesh: Mesh) -> nnx.State:
    def to_spec(_, variable):
        spec = weight_spec(variable_names(variable), variable.shape, mesh)
        return variable.replace(value_spec(variable.get_value(), spec, mesh))

    return nnx.map_state(to_spec, weights)


def cache_spec(cache: Any) -> Any:
    """PartitionSpecs of a KVCache or SharedCache: rows (or prompts) over rows, KV heads over kv."""
    def spec(x):
        by_rank = {5: PartitionSpec(None, ALL_ROWS, None, KV, None), 2: PartitionSpec(ALL_ROWS, None)}
        return by_rank.get(x.ndim, PartitionSpec())

    return jax.tree.map(spec, cache)


@dataclass(frozen=True)
class HeadParallel:
    """The head-parallel decode on `mesh` (a grid_mesh); `outside` pins what runs outside the
    layers (embedding, logits) with the vocabulary split over all devices."""

    mesh: Mesh

    @property
    def outside(self) -> ActivationLayout:
        return ActivationLayout(self.mesh, BOTH, SLICE)

    def replicated(self, x):
        return self.outside.replicated(x)

    def logits(self, logits):
        return self.outside.logits(logits)

    def weight_shardings(self, weights: nnx.State) -> nnx.State:
        return nnx.map_state(lambda _, v: v.replace(named(self.mesh, v.get_value())), weight_specs(weights, self.mesh))

    def cache_shardings(self, cache: Any) -> Any:
        return named(self.mesh, cache_spec(cache))

    def weights(self, weights: nnx.State) -> nnx.State:
        """The weights resharded for the decode loop (inside jit: once per call)."""
        return jax.lax.with_sharding_constraint(weights, self.weight_shardings(weights))

    def pin_cache(self, cache: Any) -> Any:
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache))

    def forward(self, model, tokens: jax.Array, live: jax.Array, cache: Any,
                attention: Callable[[Any], Callable]) -> tuple[jax.Array, Any]:
        """One token per row through the embedding and every layer, all inside one shard_map:
        tokens and live [B] replicated; returns x [B, 1, H] replicated and the cache with the
        new slot marked. `attention(cache)` builds the attend function of
        grpo_rollout.attention.decode_layers from a device's share of the cache. "Replicated": within
        a slice, each slice's rows on its own devices."""
        graphdef, state = nnx.split(model)
        per_slice = PartitionSpec(SLICE)
        specs = (weight_specs(state, self.mesh), per_slice, per_slice, cache_spec(cache))

        def local(state, tokens, live, cache):
            return local_forward(nnx.merge(graphdef, state), tokens, live, cache, attention)

        return shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=(per_slice, specs[-1]),
                         check_vma=False)(state, tokens, live, cache)


def own_rows(x: jax.Array) -> jax.Array:
    """This device's row group of a replicated [B, ...] array."""
    size = x.shape[0] // jax.lax.axis_size(ROWS)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(ROWS) * size, size)


def sum_over_grid(partial: jax.Array, rows: int) -> jax.Array:
    """[B/R, ...] partial sums of this device's rows -> [B, ...] summed over head groups, every
    row on every device: the block placed at its rows among zeros, then one all-reduce."""
    start = jax.lax.axis_index(ROWS) * partial.shape[0]
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((rows,) + partial.shape[1:], partial.dtype), partial,
                                                 start, 0)
    return jax.lax.psum(placed, BOTH)


def local_forward(model, tokens, live, cache, attention):
    """One device's share of a decode step (inside shard_map). Its rows' positions come from its
    own cache and its rows' mask is updated locally: the embedding's sum over vocabulary slices
    and 2 all-reduces per layer are the step's only collectives before the logits. The embedding
    scale and RoPE tables are the model's own (`QwenModel.scale_embeddings`, `QwenModel.rope`)."""
    positions = cache.lengths()[:, None]  # this device's rows: the position of each row's next token
    cos, sin = model.rope(positions)
    x = model.scale_embeddings(embed_from_slice(model.embed_tokens.embedding[...], tokens[:, None], BOTH))
    cache = cache.with_new_tokens(own_rows(live)[:, None])
    return local_layers(model, x, cos, sin, cache, attention)


def local_layers(model, x, cos, sin, cache, attention):
    """Every layer for x [B, 1, H] (replicated) and this device's rows (cos, sin, cache): its rows'
    attention over its KV heads (within the layer's sliding window, with its RoPE tables:
    `QwenModel.layer_tables`), its columns of the MLP; 2 all-reduces per layer. A family's
    post-norms are applied to the summed outputs, as the model's layer does (`DecoderLayer.add_attention`)."""
    attend = attention(cache)
    rows = x.shape[0]

    def step(layer, i, carry):
        (x, cache), (cos_i, sin_i, window) = carry, model.layer_tables(i, cos, sin)
        q, k, v = layer.self_attn.project_qkv(layer.input_layernorm(own_rows(x)), cos_i, sin_i)
        attended, cache = attend(i, cache, q[:, 0], k, v, window)
        x = layer.add_attention(x, sum_over_grid(layer.self_attn.o_proj(attended[:, None]), rows))
        return layer.add_mlp(x, lambda partial: jax.lax.psum(partial, BOTH)), cache

    return model.over_layers(step, (x, cache))
