"""Expert parallelism of mixture-of-experts models (`mesh.expert_parallel`): the byte rule `auto`
decides by, and the strategy whose rules split the experts over `fsdp`.

With expert parallelism the experts' `expert` dimension goes to the fsdp axis (each device holds
E / fsdp whole experts; their hidden dimension is no longer split) and the MoE layer brings its
fsdp group's tokens to them (grpo_core.models.moe_parallel). Per layer and pass (the backward
mirrors the forward), what one device receives:

    FSDP gathers the expert weights       3 * E * H * I * weight_bytes * (f - 1) / f
    EP gathers the tokens and routing     t * (f - 1) * (H * act_bytes + k * 8)
       and reduce-scatters the outputs    t * (f - 1) * H * 4            (float32 partial sums)

with t the tokens per device of a micro-batch, f the fsdp devices, k the experts per token (an
int32 expert id and a float32 router weight each). `auto` takes expert parallelism when its
bytes are fewer; besides, FSDP reduce-scatters the experts' gradients each step, which expert
parallelism never does (they stay on their device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpo_meshes.errors import MeshError
from grpo_meshes.rules import expert_parallel_rules
from grpo_meshes.strategies import MeshStrategy

EXPERT_AXIS = "fsdp"


@dataclass(frozen=True)
class ExpertTraffic:
    """Bytes one device receives per MoE layer and pass under each layout (module doc)."""

    fsdp_bytes: int
    expert_parallel_bytes: int


def expert_traffic(experts: int, hidden: int, intermediate: int, top_k: int, tokens: int, fsdp: int,
                   weight_bytes: int, act_bytes: int) -> ExpertTraffic:
    """The module doc's byte counts; `tokens` per device of a micro-batch, `fsdp` the devices of the axis."""
    weights = 3 * experts * hidden * intermediate * weight_bytes * (fsdp - 1) // fsdp
    gathered = tokens * (fsdp - 1) * (hidden * act_bytes + top_k * 8)
    scattered = tokens * (fsdp - 1) * hidden * 4
    return ExpertTraffic(weights, gathered + scattered)


def expert_parallel_refusal(experts: int | None, fsdp: int) -> str | None:
    """Why expert parallelism cannot run (a dense model, one fsdp device, fsdp not dividing the
    experts), or None when it can."""
    if experts is None:
        return "the model is dense"
    if fsdp == 1:
        return "the mesh has a single fsdp device"
    if experts % fsdp:
        return f"fsdp={fsdp} does not divide the model's {experts} experts"
    return None


def choose_expert_parallel(setting: bool | str, experts: int | None, fsdp: int,
                           traffic: ExpertTraffic | None) -> tuple[bool, str]:
    """(expert parallel?, one line saying the choice and why) for `mesh.expert_parallel`;
    `true` where it cannot run is a MeshError (value, why, fix)."""
    refusal = expert_parallel_refusal(experts, fsdp)
    if setting is True and refusal is not None:
        raise MeshError(f"mesh.expert_parallel=true: {refusal}; set mesh.expert_parallel to auto or false, "
                        f"or use a mesh whose fsdp size divides the experts")
    if setting is not True and (refusal is not None or setting is False):
        why = "mesh.expert_parallel=false" if setting is False else refusal
        return False, f"mesh: experts replicated over fsdp, no expert parallelism ({why})"
    counts = "" if traffic is None else (
        f"per MoE layer and pass one device receives {traffic.expert_parallel_bytes / 1e6:.3f} MB of tokens with "
        f"expert parallelism vs {traffic.fsdp_bytes / 1e6:.3f} MB of expert weights with FSDP")
    if setting == "auto" and traffic is not None and traffic.expert_parallel_bytes >= traffic.fsdp_bytes:
        return False, f"mesh: no expert parallelism (mesh.expert_parallel=auto): {counts}"
    return True, f"mesh: expert parallelism over fsdp={fsdp} ({experts // fsdp} of {experts} experts per device; " \
                 f"mesh.expert_parallel={str(setting).lower()}): {counts}"


def with_expert_parallel(strategy: MeshStrategy) -> MeshStrategy:
    """`strategy` with the experts split over fsdp in its parameter and activation rules."""
    return dataclasses.replace(strategy, param_rules=expert_parallel_rules(strategy.param_rules, EXPERT_AXIS),
                               activation_rules=expert_parallel_rules(strategy.activation_rules, EXPERT_AXIS))
