"""`mesh.expert_parallel` in a run: the update of a mixture-of-experts policy with its experts
split over fsdp compiles without a collective of any expert weight, gradient or partial product
(FSDP moves them in every layer), on XLA:CPU and for a v6e-8 by the TPU compiler (libtpu,
compile-only devices; skipped without it), and the run prints what `auto` chose with both byte
counts."""

from __future__ import annotations

import pytest
from grpo_core.errors import UserError
from grpo_core.hlo import COLLECTIVES, HloModule, array_dims
from grpo_core.registry import default_registry
from grpo_core.replica_groups import replica_groups
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.plan.abstract import abstract_run
from jax.sharding import PartitionSpec as P

# 8 experts of 40 columns: no other dimension of the tiny model is 40, so a collective carrying
# a 40 carries expert weights (or their gradients).
MOE = ["model.architecture.model_type=qwen3_moe", "model.architecture.num_experts=8",
       "model.architecture.num_experts_per_tok=2", "model.architecture.moe_intermediate_size=40",
       "rollout.prompts_per_step=8", "rollout.n=8", "mesh.strategy=full_fsdp"]
EXPERT_COLUMNS = 40


def update_hlo(inputs: plan.PlanInputs) -> str:
    lower, args = plan.update_lowering(inputs, inputs.run.cfg.train.micro_batch_size_per_device)
    return lower(*args).compile().as_text()


def update_collectives(inputs: plan.PlanInputs, hlo: str | None = None) -> list[tuple[str, list[list[int]]]]:
    """The compiled update's collectives that move data, as (op, array dims): those whose every group
    is one device (shard_map's sums over the size-1 dp and tp axes) move nothing."""
    module = HloModule(hlo or update_hlo(inputs))
    devices = inputs.run.mesh.devices.size
    return [(op, array_dims(inst.shape)) for comp in module.computations.values() for inst in comp.instructions
            if (op := inst.op.removesuffix("-done").removesuffix("-start")) in COLLECTIVES
            and any(len(group) > 1 for group in replica_groups(inst, devices))]


def compiled_update(cfg):
    """(the abstract run, `update_collectives` of its update)."""
    inputs = plan.PlanInputs(abstract_run(cfg, default_registry()))
    return inputs.run, update_collectives(inputs)


def expert_collectives(collectives):
    return [(op, dims) for op, dims in collectives if any(EXPERT_COLUMNS in d for d in dims)]


def expert_spec(run):
    return run.state.params["layers"]["mlp"]["experts"]["gate_proj"].sharding.spec


def test_the_expert_parallel_update_gathers_no_expert_weights(tiny_config, capsys):
    run, collectives = compiled_update(tiny_config(*MOE, "mesh.expert_parallel=true"))
    assert expert_spec(run) == P(None, "fsdp", None, "tp")  # [L, E, H, I]: the experts split over fsdp, H whole
    assert "mesh: expert parallelism over fsdp=8 (1 of 8 experts per device; mesh.expert_parallel=true)" in \
        capsys.readouterr().out
    assert not expert_collectives(collectives), expert_collectives(collectives)
    assert any(op == "all-gather" for op, _ in collectives)  # the tokens (and the dense weights) still are

    run, collectives = compiled_update(tiny_config(*MOE, "mesh.expert_parallel=false"))
    assert expert_spec(run) == P(None, None, "fsdp", "tp")  # FSDP: the hidden dim split, every expert on every device
    # XLA:CPU keeps the FSDP-split weights in place and all-reduces the [N*k, I] partial products of
    # their split hidden dim instead (3 per layer and pass); either way the experts' traffic crosses fsdp.
    assert {op for op, _ in expert_collectives(collectives)} == {"all-reduce"}


@pytest.mark.parametrize("columns, line", [
    # 8 rows of 17 tokens per device: 0.503 MB of tokens against 3 x 8 x 64 x 40 f32 weights, 7/8 gathered
    (40, "mesh: no expert parallelism (mesh.expert_parallel=auto): per MoE layer and pass one device receives "
         "0.503 MB of tokens with expert parallelism vs 0.215 MB of expert weights with FSDP"),
    (256, "mesh: expert parallelism over fsdp=8 (1 of 8 experts per device; mesh.expert_parallel=auto): per MoE layer "
          "and pass one device receives 0.503 MB of tokens with expert parallelism vs 1.376 MB of expert weights "
          "with FSDP"),
])
def test_auto_takes_the_layout_that_moves_fewer_bytes_and_prints_both(tiny_config, capsys, columns, line):
    run = abstract_run(tiny_config(*MOE, f"model.architecture.moe_intermediate_size={columns}"), default_registry())
    assert [text for text in capsys.readouterr().out.splitlines() if text.startswith("mesh:")] == [line]
    assert expert_spec(run) == (P(None, "fsdp", None, "tp") if "expert parallelism over" in line else
                                P(None, None, "fsdp", "tp"))


def test_a_dense_model_is_left_alone_and_says_nothing(tiny_config, capsys):
    abstract_run(tiny_config("mesh.strategy=full_fsdp"), default_registry())
    assert "mesh:" not in capsys.readouterr().out


def test_true_is_refused_in_one_line_where_fsdp_does_not_divide_the_experts(tiny_config):
    cfg = tiny_config(*MOE, "model.architecture.num_experts=12", "mesh.expert_parallel=true")
    with pytest.raises(UserError, match="mesh.expert_parallel=true: fsdp=8 does not divide the model's 12 experts; "
                                        "set mesh.expert_parallel to auto or false"):
        abstract_run(cfg, default_registry())


TPU_SHAPE = [*MOE, "model.dtype=bfloat16", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=8"]


def test_tpu_compiles_the_expert_parallel_update_without_moving_expert_weights(tpu_devices, tiny_config):
    split = plan.PlanInputs(abstract_run(tiny_config(*TPU_SHAPE, "mesh.expert_parallel=true"), default_registry(),
                                         tpu_devices))
    assert expert_spec(split.run) == P(None, "fsdp", None, "tp")  # [L, E, H, I]: one whole expert per chip
    assert {d.platform for d in split.run.mesh.devices.flat} == {"tpu"}
    hlo = update_hlo(split)
    assert not expert_collectives(update_collectives(split, hlo))
    # Inside the expert-parallel shard_map each chip's experts run the grouped-matmul Mosaic kernel
    # (grpo_core.models.grouped_matmul), forward and backward.
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert any("grouped_matmul_transposed" in line for line in kernels), len(kernels)
    fsdp = plan.PlanInputs(abstract_run(tiny_config(*TPU_SHAPE, "mesh.expert_parallel=false"), default_registry(),
                                        tpu_devices))
    assert expert_spec(fsdp.run) == P(None, None, "fsdp", "tp")
    assert expert_collectives(update_collectives(fsdp))


def phase_collectives(program, devices: int) -> list[tuple[str, list[list[int]]]]:
    """A compiled phase's collectives that move data, as (op, array dims)."""
    module = HloModule(program.as_text())
    return [(op, array_dims(inst.shape)) for comp in module.computations.values() for inst in comp.instructions
            if (op := inst.op.removesuffix("-done").removesuffix("-start")) in COLLECTIVES
            and any(len(group) > 1 for group in replica_groups(inst, devices))]


def test_tpu_compiles_the_expert_parallel_decode_in_place_with_the_kernel(tpu_devices, tiny_config):
    """gather_weights=expert_parallel after an expert-parallel update: the move into the decode's
    layout (2 segments compile it as its own phase) and every decoded token carry no expert weight
    (each chip keeps its expert and runs the tokens routed to it), and the experts' grouped matmuls
    are the Mosaic kernel; model_parallel splits each expert's 40 columns instead, so its move
    exchanges every expert kernel (one all-to-all each, of [chips, L, H x 40 / chips])."""
    programs = {}
    for layout in ("expert_parallel", "model_parallel"):
        inputs = plan.PlanInputs(abstract_run(tiny_config(
            *TPU_SHAPE, "mesh.expert_parallel=true", f"rollout.options.gather_weights={layout}",
            "rollout.options.decode_segments=2"), default_registry(), tpu_devices))
        programs[layout] = plan.compile_rollout(inputs)
    expert = programs["expert_parallel"]
    print("expert-parallel decode layout move:", phase_collectives(expert["rollout decode layout"], 8))
    for phase in ("rollout decode layout", "rollout decode"):
        assert not expert_collectives(phase_collectives(expert[phase], 8)), phase
    assert 'custom_call_target="tpu_custom_call"' in expert["rollout decode"].as_text()
    moves = {name: [dims for op, dims in phase_collectives(program["rollout decode layout"], 8) if op == "all-to-all"]
             for name, program in programs.items()}
    assert moves == {"expert_parallel": [], "model_parallel": [[[8, 2, 64 * EXPERT_COLUMNS // 8]]] * 3}
