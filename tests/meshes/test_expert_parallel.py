"""`mesh.expert_parallel`: the byte rule `auto` decides by, the refusals of `true`, and the rules
of a strategy with the experts split over fsdp."""

from __future__ import annotations

import pytest
from grpo_core.sharding import logical_to_spec, rules_to_dict
from grpo_meshes import resolve_strategy
from grpo_meshes.errors import MeshError
from grpo_meshes.expert import choose_expert_parallel, expert_traffic, with_expert_parallel
from grpo_meshes.rules import PARAM_RULES, TRAIN_ACTIVATION_RULES, expert_parallel_rules
from grpo_core.config import MeshConfig
from jax.sharding import PartitionSpec as P

# Qwen3-30B-A3B: 128 experts of 768 columns, hidden 2048, 8 experts per token; bfloat16, fsdp = 8.
A3B = dict(experts=128, hidden=2048, intermediate=768, top_k=8, fsdp=8, weight_bytes=2, act_bytes=2)


def test_the_byte_counts_of_one_layer_and_pass():
    traffic = expert_traffic(tokens=4096, **A3B)
    assert traffic.fsdp_bytes == 3 * 128 * 2048 * 768 * 2 * 7 // 8  # 1.057 GB of expert weights
    assert traffic.expert_parallel_bytes == 4096 * 7 * (2048 * 2 + 8 * 8) + 4096 * 7 * 2048 * 4  # 0.354 GB
    assert expert_traffic(tokens=4096, **{**A3B, "fsdp": 1}) == type(traffic)(0, 0)  # one device moves nothing


def test_auto_takes_expert_parallelism_when_it_moves_fewer_bytes():
    few, many = expert_traffic(tokens=4096, **A3B), expert_traffic(tokens=16384, **A3B)
    chosen, line = choose_expert_parallel("auto", 128, 8, few)
    assert chosen and line.startswith("mesh: expert parallelism over fsdp=8 (16 of 128 experts per device")
    assert "354.157 MB of tokens" in line and "1056.965 MB of expert weights" in line and "\n" not in line
    assert choose_expert_parallel("auto", 128, 8, many)[0] is False  # 1.42 GB of tokens: FSDP's gathers win
    assert choose_expert_parallel(True, 128, 8, many)[0] is True  # forced
    assert choose_expert_parallel(False, 128, 8, few) == (
        False, "mesh: experts replicated over fsdp, no expert parallelism (mesh.expert_parallel=false)")


@pytest.mark.parametrize("experts, fsdp, why", [
    (None, 8, "the model is dense"), (12, 8, "fsdp=8 does not divide the model's 12 experts"),
    (8, 1, "the mesh has a single fsdp device")])
def test_auto_keeps_it_off_and_true_is_refused_where_it_cannot_run(experts, fsdp, why):
    traffic = None if experts is None else expert_traffic(experts, 64, 32, 2, 1, fsdp, 4, 4)
    chosen, line = choose_expert_parallel("auto", experts, fsdp, traffic)
    assert not chosen and why in line
    with pytest.raises(MeshError, match=f"mesh.expert_parallel=true: {why}.*; set mesh.expert_parallel to auto or "
                                        "false, or use a mesh whose fsdp size divides the experts") as refused:
        choose_expert_parallel(True, experts, fsdp, traffic)
    assert "\n" not in str(refused.value)


def test_the_strategy_splits_the_experts_over_fsdp_and_nothing_else_changes():
    strategy = with_expert_parallel(resolve_strategy(MeshConfig(strategy="1,-1,2")))
    rules = strategy.param_rules
    assert logical_to_spec(("layers", "expert", "embed", "mlp"), rules) == P(None, "fsdp", None, "tp")
    assert logical_to_spec(("layers", "expert", "mlp", "embed"), rules) == P(None, "fsdp", "tp", None)
    assert logical_to_spec(("layers", "embed", "expert"), rules) == P(None, "fsdp", None)  # the router
    for names in [("vocab", "embed"), ("layers", "embed", "heads", "head_dim"), ("layers", "mlp", "embed")]:
        assert logical_to_spec(names, rules) == logical_to_spec(names, PARAM_RULES)  # dense weights as before
    assert rules_to_dict(strategy.activation_rules)["expert"] == "fsdp"
    assert strategy.activation_rules == expert_parallel_rules(TRAIN_ACTIVATION_RULES)
    assert rules_to_dict(PARAM_RULES)["expert"] is None  # without it: replicated experts
