"""Logical axis names -> mesh axes.

Parameters carry logical names (`embed`, `vocab`, `heads`, ...) in their nnx
`out_sharding` metadata. A rule table maps each logical name to a mesh axis, a tuple
of mesh axes, or None (replicated), e.g.

    RULES = (("vocab", "tp"), ("embed", "fsdp"), ("heads", "tp"), ("kv_heads", "tp"),
             ("mlp", "tp"), ("batch", ("dp", "fsdp")), ("norm", None), ("head_dim", None))

A logical name with no rule is replicated. Within one array a mesh axis is used at
most once: a later dimension whose rule needs an axis already taken falls through to
its next rule; when none is left the tables collide, which is an error (a silently
replicated dimension costs memory nobody planned for).

The logic lives here; the tables of the mesh strategies live in `grpo_meshes.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

# FSDP over `fsdp`, tensor parallel over `tp`, data parallel over `dp` (+ `fsdp`).
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("dp", "fsdp")),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),  # stacked decoder layers: the scan slices this axis, never split it
    ("expert", None),  # MoE experts: replicated (no expert-parallel axis yet); their embed/mlp dims shard
)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded arrays or ShapeDtypeStructs."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree) if getattr(leaf, "sharding", None) is not None)


def rules_to_dict(rules: Rules) -> dict[str, MeshAxes]:
    """The first rule per logical name wins, as in flax's logical axis rules."""
    table: dict[str, MeshAxes] = {}
    for name, axes in rules:
        table.setdefault(name, axes)
    return table


def with_batch_axes(rules: Rules, batch_axes: tuple[str, ...]) -> Rules:
    """`rules` with `batch` mapped to `batch_axes`; logical names that would reuse
    one of those mesh axes become replicated (an axis can shard one dimension)."""
    taken = set(batch_axes)
    updated = [("batch", batch_axes)]
    for name, axes in rules:
        if name == "batch":
            continue
        used = {axes} if isinstance(axes, str) else set(axes or ())
        updated.append((name, None if used & taken else axes))
    return tuple(updated)


def as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _pick_axes(name: str | None, rules: Rules, used: dict[str, str]) -> MeshAxes:
    if name is None:
        return None
    clashes = []
    for logical, axes in rules:
        if logical != name:
            continue
        taken = [axis for axis in as_tuple(axes) if axis in used]
        if not taken:
            return axes
        clashes += [(axis, used[axis]) for axis in taken]
    if clashes:
        axis, holder = clashes[0]
        raise ValueError(f"sharding rules collide: dimension {name!r} maps to mesh axis {axis!r}, which "
                         f"dimension {holder!r} of the same array already uses; give {name!r} another axis "
                         f"(or None) in the rule table")
    return None


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have these logical names."""
    used: dict[str, str] = {}  # mesh axis -> the logical dimension holding it
    spec = []
    for name in names:
        axes = _pick_axes(name, rules, used)
        used.update({axis: name for axis in as_tuple(axes)})
        spec.append(tuple(axes) if isinstance(axes, list) else axes)
    return PartitionSpec(*spec)


def mesh_ways(mesh: Mesh, axes: MeshAxes) -> int:
    """Devices a dimension sharded over `axes` is split across."""
    unknown = [a for a in as_tuple(axes) if a not in mesh.shape]
    if unknown:
        raise ValueError(f"sharding rules use mesh axes {unknown} that the mesh {dict(mesh.shape)} does not have.")
    return math.prod(mesh.shape[a] for a in as_tuple(axes))


def divides(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> bool:
    """Whether every dimension is a multiple of the devices it is split over."""
    return all(size % mesh_ways(mesh, axes) == 0 for size, axes in zip(shape, spec))


def freeze_rules(rules: Rules) -> tuple[tuple[str, MeshAxes], ...]:
    """Rules as nested tuples (hashable, so a module can keep them as static data)."""
    return tuple((name, axes if axes is None or isinstance(axes, str) else tuple(axes)) for name, axes in rules)


def check_divisible(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, what: str) -> None:
    """Raise if a dimension is not a multiple of the mesh axes it is sharded over."""
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        ways = mesh_ways(mesh, axes)
        if size % ways:
            raise ValueError(
                f"{what}: dimension {dim} of size {size} cannot be split over mesh axes {axes} "
                f"({ways} devices, mesh {dict(mesh.shape)}); change the mesh or the logical rules."
            )


def named_sharding(names: Sequence[str | None], mesh: Mesh, rules: Rules, shape=None, what="array") -> NamedSharding:
    spec = logical_to_spec(names, rules)
    if shape is not None:
        check_divisible(shape, spec, mesh, what)
    return NamedSharding(mesh, spec)


def variable_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    """Logical axis names of an nnx Variable (all None when it has none)."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * len(variable.shape)


def check_auto_mesh(mesh: Mesh) -> None:
    """Models rely on sharding propagation, which needs Auto mesh axes."""
    if not mesh.are_all_axes_auto:
        raise ValueError(
            f"mesh axis types {mesh.axis_types} are not all Auto; build the mesh with "
            "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)) "
            "or jax.sharding.Mesh(devices, names)."
        )


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Rules) -> nnx.State:
    """The model's state with each Variable's value replaced by its NamedSharding."""
    check_auto_mesh(mesh)
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def to_sharding(path, variable):
        what = ".".join(str(p) for p in path)
        return variable.replace(named_sharding(variable_names(variable), mesh, rules, variable.shape, what))

    return nnx.map_state(to_sharding, state)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Move every Variable of `model` onto its NamedSharding (in place; returns model)."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    if hasattr(model, "set_activation_sharding"):
        model.set_activation_sharding(mesh, rules)
    return model


def tree_shardings(logical_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree whose leaves are tuples of logical names
    (e.g. `KVCache.logical_axes()`)."""
    return jax.tree.map(
        lambda names: named_sharding(names, mesh, rules),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x),
    )
