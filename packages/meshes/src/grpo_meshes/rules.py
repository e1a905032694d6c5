"""Logical axis name -> mesh axis rules.

A rule table is a tuple of `(logical_name, mesh_axes)` pairs, where `mesh_axes`
is one mesh axis name, a tuple of them (the dimension is split over their
product), or None (replicated). `grpo_core.sharding.logical_to_spec(names,
rules)` turns a parameter's logical names into a PartitionSpec with them; the rule
logic (`with_batch_axes`, collisions) lives there too, the tables here.

Parameters are sharded FSDP-style over `fsdp` on the model dimension and
Megatron-style over `tp` on heads / MLP / vocab, and replicated over `dp`.
Activations are split on the batch over the data axes; their hidden dimension
stays whole so that no array maps two dimensions onto the same mesh axis.
"""

from __future__ import annotations

from grpo_core.sharding import MeshAxes, Rules, rules_to_dict, with_batch_axes  # noqa: F401  (re-exported)

PARAM_RULES: Rules = (
    ("embed", "fsdp"),      # hidden size: the FSDP dimension of every weight matrix
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("norm", None),         # norm scales are tiny; replicating avoids a gather per layer
    ("layers", None),       # stacked decoder layers: the scan slices this axis, never split it
    ("expert", None),       # MoE experts: replicated unless expert parallel (`expert_parallel_rules`)
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


def expert_parallel_rules(rules: Rules, axis: str = "fsdp") -> Rules:
    """`rules` with the MoE experts split over `axis` (expert parallelism, grpo_core.models.moe_parallel):
    `expert` takes the axis first, so an expert weight [E, H, I] keeps its hidden dimension whole
    (`embed` falls through to None) and the router [H, E] its expert dimension (`expert` falls
    through to None). In the activation rules the same entry tells the MoE layer where its experts are."""
    kept = tuple(rule for rule in rules if rule[0] != "expert")
    return (("expert", axis), *kept, ("expert", None), ("embed", None))
