"""Collective bytes per decoded token of the rollout decode compiled by the TPU compiler
(libtpu) for a v6e-8 topology with FSDP-sharded weights; skipped without libtpu."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_meshes import build_mesh_from_config
from grpo_rollout.collectives import decode_collective_bytes_per_token
from grpo_core.contracts import SamplingParams
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.program import build_program

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
SHAPE = ["model.dtype=bfloat16", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=8"]


@pytest.fixture
def tpu_devices(monkeypatch):
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile only: other processes may hold libtpu
    topologies = pytest.importorskip("jax.experimental.topologies")
    try:
        return topologies.get_topology_desc("v6e:2x4", platform="tpu").devices
    except Exception as exc:  # no libtpu (or no TPU plugin) on this machine
        pytest.skip(f"libtpu not available: {exc}")


def plan_inputs(devices, tmp_path: Path, *overrides: str) -> plan.PlanInputs:
    registry = default_registry()
    cfg = load_config(TINY, [*SHAPE, f"logging.dir={tmp_path}", *overrides], registry=registry)
    resolved = build_mesh_from_config(cfg.mesh, registry.mesh, devices=devices)  # auto: fsdp over all 8
    qcfg = plan.plan_architecture(cfg)
    graphdef, params = plan.abstract_run_model(cfg, qcfg, resolved.mesh, resolved.strategy)
    program = build_program(cfg, registry, resolved.mesh, graphdef, SamplingParams.from_config(cfg.rollout))
    return plan.PlanInputs(cfg=cfg, mesh=resolved.mesh, qcfg=qcfg, program=program, params=params, opt_state=None)


def decode_bytes_per_token(devices, tmp_path: Path, *overrides: str) -> dict[str, int]:
    return decode_collective_bytes_per_token(plan.compile_rollout(plan_inputs(devices, tmp_path, *overrides))[1])


def test_gathered_weights_leave_no_collective_in_the_decode_loop(tpu_devices, tmp_path):
    sharded = decode_bytes_per_token(tpu_devices, tmp_path)
    assert sum(sharded.values()) > 0  # FSDP weights: collectives every token
    assert decode_bytes_per_token(tpu_devices, tmp_path, "rollout.options.gather_weights=true") == {}


@pytest.mark.parametrize("capacity_gib, gathered", [(32.0, True), (0.001, False)])
def test_the_plan_takes_gathered_weights_when_auto_and_they_fit(tpu_devices, tmp_path, capacity_gib, gathered):
    inputs = plan_inputs(tpu_devices, tmp_path, "rollout.options.gather_weights=auto")
    decode = plan.rollout_phases(inputs, plan.Capacity(int(capacity_gib * plan.GIB), "test"))[-1]
    assert decode.name == "rollout decode"
    if gathered:
        assert decode.note == ("gather_weights=auto: weights gathered once per rollout (the copy fits); "
                               "collectives per decoded token: none")
    else:
        assert decode.note.startswith("gather_weights=auto: sharded weights (a gathered decode needs ")
        assert "all-gather" in decode.note or "all-reduce" in decode.note
