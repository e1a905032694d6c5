"""Model-parallel decode: each weight read by one device per token, activations exchanged.

A decode step is memory-bound: with the weights gathered (replicated), every device reads
all of them for every token; FSDP-sharded, XLA all-gathers them per token. Here the
weights are resharded once per rollout over the devices that split the rollout batch,
by attention heads, MLP columns and vocabulary (`heads`, `mlp`, `vocab`; a dimension
those devices do not divide, e.g. 2 KV heads over 8 devices, stays replicated), so each
device reads about 1/D of them per token. The step's activations are pinned so that only
they move (a few MB per token, not the weights):

- the residual stream is replicated ([rows, hidden] is small), also as the layer loop carries
  it (grpo_rollout.attention.decode_layers: the pins that keep it so);
- q goes to the rows' devices (all-to-all), where the KV cache of those rows lives (the cache
  stays split by rows, as in the other layouts) and attention runs locally; k and v, whose
  projections stay replicated, are computed whole and each device writes its rows;
- the attention output goes back to head-split for o_proj, whose partial sums and the
  MLP's (down_proj is split by its input columns) are all-reduced into the residual;
- the logits, split by vocabulary, go to the rows' devices for sampling.

The expert-parallel variant (`experts`) splits a mixture-of-experts model's experts whole instead
of by their MLP columns, E / D experts per device (the layout training's expert parallelism keeps
them in, so the move into it leaves them in place); the MoE layer then runs each device's experts
on the replicated tokens routed to them and all-reduces the outputs (grpo_core.models.moe_parallel).

Across TPU slices (grpo_meshes.slices) all of that stays within each slice: the layout's mesh is
(slice, model, rest), the weights split within a slice and copied per slice, each
slice's rows "replicated" over its own devices only, so no decoded token crosses the data-center
network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.errors import ConfigError
from grpo_core.models.moe_parallel import ExpertParallel
from grpo_core.sharding import as_tuple, mesh_ways, variable_names
from grpo_rollout.slices import SLICE, batch_ordered, batch_slices

SPLIT_DIMENSIONS = ("heads", "mlp", "vocab")  # logical names split over the batch devices
MODEL, REST = "model", "rest"  # a slice's devices in the layout across slices: splitting the rows, copying them


def model_parallel_layout(mesh: Mesh, axes: Any, slices: int | None = None,
                          experts: bool = False) -> "ActivationLayout":
    """The model-parallel layout of a batch split over `axes` of `mesh`; across `slices` slices
    (default: the TPU slices, `batch_slices`) on a (slice, model, rest) mesh of the same devices in
    the batch's order: the rows split over (slice, model) as in the batch, the weights over `model`,
    or, where the batch is split over the slices alone (model 1, e.g. over dp), over `rest`, the
    devices it is copied over (else each slice would read whole weights)."""
    slices = batch_slices(mesh, axes) if slices is None else slices
    if slices == 1:
        return ActivationLayout(mesh, axes, experts=experts)
    devices = batch_ordered(mesh, axes).reshape(slices, mesh_ways(mesh, axes) // slices, -1)
    grid = Mesh(devices, (SLICE, MODEL, REST))
    return ActivationLayout(grid, MODEL if grid.shape[MODEL] > 1 else REST, SLICE, MODEL, experts)


def split_layout(weights: nnx.State, mesh: Mesh, axes: Any, experts: bool) -> "ActivationLayout":
    """`model_parallel_layout`; `experts`: its expert-parallel variant, refused (LayoutUnsupported)
    for a model without experts."""
    if experts and not holds_experts(weights):
        raise LayoutUnsupported("gather_weights=expert_parallel splits a mixture-of-experts model's experts; this "
                                "model has none: set gather_weights to auto, model_parallel or head_parallel")
    return model_parallel_layout(mesh, axes, experts=experts)


def run_experts(model: nnx.Module, layout: Any) -> nnx.Module:
    """`model` with its experts run as `layout` holds them: whole experts per device in the
    expert-parallel variant (grpo_core.models.moe_parallel); other layouts leave it as it is."""
    if getattr(layout, "experts", False):
        model.layers.mlp.run_experts_as(layout.expert_plan())
    return model


def is_expert_kernel(names: tuple) -> bool:
    """An expert MLP's stacked kernel ([(L,) E, H, I] or [(L,) E, I, H]), not the router ([H, E])."""
    return "expert" in names and "mlp" in names


def holds_experts(weights: nnx.State) -> bool:
    """The weights are a mixture-of-experts model's (the expert-parallel layout has something to split)."""
    variables = jax.tree.leaves(weights, is_leaf=lambda leaf: isinstance(leaf, nnx.Variable))
    return any(is_expert_kernel(variable_names(v)) for v in variables if isinstance(v, nnx.Variable))


def weight_spec(names: tuple, shape: tuple, mesh: Mesh, axes: Any, experts: bool = False) -> PartitionSpec:
    """Split the first dimension named in SPLIT_DIMENSIONS that `axes` divides; the rest replicated.
    `experts`: an expert kernel splits its `expert` dimension instead (whole experts per device)."""
    spec: list = [None] * len(shape)
    ways = mesh_ways(mesh, axes)
    if experts and is_expert_kernel(names):
        dim = names.index("expert")
        if shape[dim] % ways:
            raise LayoutUnsupported(f"gather_weights=expert_parallel: {shape[dim]} experts do not split over {ways} "
                                    "devices; set gather_weights to auto, model_parallel or head_parallel")
        spec[dim] = axes
        return PartitionSpec(*spec)
    for dim, (name, size) in enumerate(zip(names, shape)):
        if name in SPLIT_DIMENSIONS and size % ways == 0:
            spec[dim] = axes
            break
    return PartitionSpec(*spec)


def weight_shardings(weights: nnx.State, mesh: Mesh, axes: Any, experts: bool = False) -> nnx.State:
    """`weights` with each Variable's value replaced by its model-parallel NamedSharding(s)
    (`experts`: the expert-parallel variant's)."""
    def to_sharding(_, variable):
        spec = weight_spec(variable_names(variable), variable.shape, mesh, axes, experts)
        return variable.replace(named(mesh, value_spec(variable.get_value(), spec, mesh)))

    return nnx.map_state(to_sharding, weights)


class LayoutUnsupported(ConfigError, ValueError):
    """A split decode layout cannot split this model or batch (the message says why): bad input,
    printed by grpo-run as one line; `auto` skips the layout."""


def value_spec(value: Any, spec: PartitionSpec, mesh: Mesh) -> Any:
    """`spec` as the PartitionSpec(s) of a weight's value: an 8-bit kernel (grpo_rollout.quantize)
    splits its values by `spec` and its scales likewise, but not along the axes where a scale has
    size 1 (per channel: the input axes; a split contracted axis leaves partial sums, which its scale
    multiplies alike). Block scales (fp8_block) split with their blocks, each device's blocks whole:
    an axis whose block count its devices do not divide is refused (LayoutUnsupported)."""
    scale = getattr(value, "scale", None)
    if scale is None:
        return spec
    padded = tuple(spec) + (None,) * (scale.ndim - len(spec))
    for axis, blocks, size in zip(padded, scale.shape, value.shape):
        if axis is not None and 1 < blocks < size and blocks % mesh_ways(mesh, axis):
            raise LayoutUnsupported(f"rollout.quantize=fp8_block: an axis of {size} weights in {blocks} blocks does "
                                    f"not split over {mesh_ways(mesh, axis)} devices; use rollout.quantize=fp8 or "
                                    "another rollout.options.gather_weights layout")
    return dataclasses.replace(value, values=spec, scale=scale_spec(spec, scale.shape, value.shape))


def scale_spec(spec: PartitionSpec, scale_shape: tuple, value_shape: tuple, split_blocks: bool = True) -> PartitionSpec:
    """The PartitionSpec of an 8-bit kernel's scales beside its values' `spec`: replicated along an
    axis where the scale has one entry (per channel: the input axes), split like the values where it
    has one per element (the output axes), and where it has one per block, split with the blocks
    (`split_blocks`) or replicated."""
    padded = tuple(spec) + (None,) * (len(scale_shape) - len(spec))
    return PartitionSpec(*(None if scale == 1 or (scale != size and not split_blocks) else axis
                           for axis, scale, size in zip(padded, scale_shape, value_shape)))


def named(mesh: Mesh, specs: Any) -> Any:
    """NamedShardings on `mesh` for a PartitionSpec or a tree of them."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


@dataclass(frozen=True)
class ActivationLayout:
    """Where a decode step pins its activations; without a mesh nothing is pinned (XLA
    places them, the layout of the gathered and sharded decodes)."""

    mesh: Mesh | None = None
    axes: Any = None  # mesh axes of the rollout batch, which also split the weights
    outer: str | None = None  # the axis of the slices: rows split over it too, "replicated" within a slice
    rows_within: Any = None  # the axes of `axes` that split the rows within a slice (None: all)
    experts: bool = False  # the expert-parallel variant: whole experts per device (module doc)

    def expert_plan(self) -> ExpertParallel:
        """How the MoE layer runs in the expert-parallel variant: experts split over `axes`, the
        tokens replicated (within each slice), so each device's outputs are all-reduced."""
        return ExpertParallel(self.mesh, self.axes, () if self.outer is None else (self.outer,), ())

    @property
    def row_axes(self) -> Any:
        if self.outer is None:
            return self.axes
        return (self.outer, *as_tuple(self.axes if self.rows_within is None else self.rows_within))

    def _pin(self, x: jax.Array, dim: int | None) -> jax.Array:
        """x (rows first) split along `dim` (None: only by slice)."""
        if self.mesh is None:
            return x
        spec: list = [self.outer] + [None] * (x.ndim - 1)
        if dim is not None:
            spec[dim] = self.row_axes if dim == 0 else self.axes
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def replicated(self, x: jax.Array) -> jax.Array:
        return self._pin(x, None)

    def rows(self, x: jax.Array) -> jax.Array:
        return self._pin(x, 0)

    def embed(self, embedding: jax.Array, ids: jax.Array) -> jax.Array:
        """Rows of a vocabulary-split table, replicated: each device looks up the ids in its
        slice and the slices are summed (XLA would otherwise all-gather the whole table per
        token to index it)."""
        ways = 1 if self.mesh is None else mesh_ways(self.mesh, self.axes)
        if ways == 1 or embedding.shape[0] % ways:
            return self.replicated(jnp.take(embedding, ids, axis=0))
        names = as_tuple(self.axes)
        return shard_map(lambda table, ids: embed_from_slice(table, ids, names), mesh=self.mesh,
                         in_specs=(PartitionSpec(self.axes, None), PartitionSpec(self.outer)),
                         out_specs=PartitionSpec(self.outer), check_vma=False)(embedding, ids)

    def split(self, x: jax.Array, dim: int) -> jax.Array:
        """x split along `dim` (heads for o_proj's input, vocabulary for the logits) where
        the devices divide it: the layout of the weight that made or reads it, so XLA moves
        x and not the weight."""
        if self.mesh is None or x.shape[dim] % mesh_ways(self.mesh, self.axes):
            return x
        return self._pin(x, dim)

    def logits(self, logits: jax.Array) -> jax.Array:
        """[rows, V] made vocabulary-split, then moved to the rows' devices for sampling."""
        return self.rows(self.split(logits, 1))


def embed_from_slice(table: jax.Array, ids: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Inside shard_map: the embeddings of replicated `ids` from this device's vocabulary slice
    `table` of a table split over `axes`, summed over the slices (one all-reduce)."""
    start = jax.lax.axis_index(axes) * table.shape[0]
    inside = (ids >= start) & (ids < start + table.shape[0])
    rows = jnp.take(table, jnp.clip(ids - start, 0, table.shape[0] - 1), axis=0)
    return jax.lax.psum(jnp.where(inside[..., None], rows, 0), axes)


def model_parallel_weights(weights: nnx.State, layout: ActivationLayout) -> nnx.State:
    """The weights resharded for the decode loop (inside jit: one reshard per rollout)."""
    shardings = weight_shardings(weights, layout.mesh, layout.axes, layout.experts)
    return jax.lax.with_sharding_constraint(weights, shardings)
