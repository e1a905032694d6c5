"""Logical axis name -> mesh axis rules.

A rule table is a tuple of `(logical_name, mesh_axes)` pairs, where `mesh_axes`
is one mesh axis name, a tuple of them (the dimension is split over their
product), or None (replicated). `grpo_core.sharding.logical_to_spec(names,
rules)` turns a parameter's logical names into a PartitionSpec with them.

Parameters are sharded FSDP-style over `fsdp` on the model dimension and
Megatron-style over `tp` on heads / MLP / vocab, and replicated over `dp`.
Activations are split on the batch over the data axes; their hidden dimension
stays whole so that no array maps two dimensions onto the same mesh axis.
"""

from __future__ import annotations

from typing import Optional, Union

MeshAxes = Optional[Union[str, tuple[str, ...]]]
Rules = tuple[tuple[str, MeshAxes], ...]

PARAM_RULES: Rules = (
    ("embed", "fsdp"),      # hidden size: the FSDP dimension of every weight matrix
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("norm", None),         # norm scales are tiny; replicating avoids a gather per layer
    ("layers", None),       # stacked decoder layers: the scan slices this axis, never split it
)

TRAIN_ACTIVATION_RULES: Rules = (
    ("batch", ("dp", "fsdp")),
    ("length", None),
    ("embed", None),
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("norm", None),
)


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
