"""Two slices of 4 of the 8 fake CPU devices (mesh.slices=2, dp across slices): the tiny run's compiled
programs, read with the replica groups of their collectives, send nothing across slices per decoded
token, and the train step's only collectives across slices are the gradient reduction (all-reduces
of parameter-sized float32 shards)."""

from __future__ import annotations

import jax
import pytest
from grpo_core.hlo import COLLECTIVES, HloModule
from grpo_core.replica_groups import crosses_groups
from grpo_core.registry import default_registry
from grpo_meshes.slices import device_slices
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.costs.roofline import collectives, data_dependent_loop
from grpo_runner_gsm8k.plan.abstract import abstract_run


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """(slice of each partition, rollout decode, train step, float32 parameter bytes) compiled for the
    tiny run on 2 x 4 devices."""
    from grpo_core.config_io import load_config
    from pathlib import Path

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"),
                      [f"logging.dir={tmp_path_factory.mktemp('run')}", "mesh.slices=2", "rollout.prompts_per_step=4",
                       "rollout.n=2", "rollout.max_new_tokens=8", "train.micro_batch_size_per_device=1"],
                      registry=default_registry())
    inputs = plan.PlanInputs(abstract_run(cfg, default_registry()))
    mesh = inputs.run.mesh
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 4, "tp": 1}
    slices = list(device_slices(mesh.devices, 2).flat)  # partition i is mesh.devices.flat[i]
    params = sum(leaf.size * 4 for leaf in jax.tree.leaves(inputs.run.state.params))
    return slices, plan.compile_rollout(inputs)["rollout decode"], plan.compile_update(inputs), params


def test_the_decode_loop_sends_nothing_across_slices(programs):
    slices, decode, _, _ = programs
    module = HloModule(decode.as_text())
    body = data_dependent_loop(module).body()
    within = collectives(module, body)
    across = collectives(module, body, crosses_groups(slices))
    assert within.total > 0  # the FSDP-sharded weights are gathered within each slice every token
    assert across.total == 0


def test_the_train_step_reduces_gradients_across_slices(programs):
    """The gradient all-reduce over dp crosses slices with at least every gradient shard. XLA:CPU's
    partitioning of the embedding lookup also gathers that lookup's activations over dp (the TPU
    compiler's multislice program sends only all-reduces: tests/runner/test_plan_target.py)."""
    slices, _, update, params = programs
    module = HloModule(update.as_text())
    crossing = crosses_groups(slices)
    across = [inst for c in module.computations.values() for inst in c.instructions
              if inst.op in COLLECTIVES and crossing(inst)]
    reduced = module.collective_bytes(where=crossing).get("all-reduce", 0)  # loops times their trip counts
    assert reduced >= params // 4  # at least every float32 gradient shard (fsdp 4) once
    assert all(inst.op == "all-reduce" or "_take" in inst.attrs for inst in across)
