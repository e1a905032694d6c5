"""A segmented decode (rollout.options.decode_segments) on the TPU compiler: each segment's program
reads the completion cache only up to its view, and the plan prices the decode as the sum of the
segments' per-step costs over their steps (grpo_runner_gsm8k.plan.projection)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpo_core.registry import default_registry
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.plan.projection import project, projection_json, projection_lines

pytest.importorskip("libtpu")

ROWS, DEVICES, NEW = 32, 4, 33  # 8 prompts x n=4 over a v5e-4; 32 decode steps in 4 segments of 8
SHAPE = ["model.architecture.vocab_size=4096", "model.architecture.hidden_size=512",
         "model.architecture.intermediate_size=1024", "model.architecture.num_attention_heads=4",
         "model.architecture.num_key_value_heads=2", "model.architecture.max_position_embeddings=128",
         "model.dtype=bfloat16", "model.param_dtype=float32", "model.remat=none", "loss.impl=jax",
         "model.attention=xla", "rollout.prompts_per_step=8", "rollout.n=4", f"rollout.max_new_tokens={NEW}",
         "train.micro_batch_size_per_device=4", "rollout.options.cache_dtype=bfloat16",
         "rollout.options.gather_weights=true", "rollout.options.decode_segments=4"]
SEGMENTS = ["rollout decode steps 1-8", "rollout decode steps 9-16", "rollout decode steps 17-24", "rollout decode"]


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    from grpo_core.config_io import load_config

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"),
                      [f"logging.dir={tmp_path_factory.mktemp('run')}", *SHAPE], registry=default_registry())
    target = plan.parse_target("v5e-4")
    inputs = plan.build_plan_inputs(cfg, default_registry(), target)
    phases = plan.fixed_phases(inputs, plan.device_capacity(None, target)) + [plan.train_phase(inputs, 4)]
    return inputs, project(inputs, target.generation, phases)


def test_a_shorter_view_reads_fewer_hbm_bytes_per_step(projected):
    """Each segment's view is 8 completion slots longer than the one before: its step reads 8 more
    slots of K and V (bfloat16) for each of a device's rows and every layer, and nothing else more."""
    inputs, projection = projected
    q = inputs.run.qcfg
    per_step = [projection.phases[name].hbm_bytes for name in SEGMENTS]
    eight_slots = 2 * q.num_hidden_layers * (ROWS // DEVICES) * 8 * q.num_key_value_heads * q.head_dim * 2
    assert [b - a for a, b in zip(per_step, per_step[1:])] == [eight_slots] * 3
    assert per_step[0] < per_step[-1]


def test_the_plans_decode_is_the_sum_over_segments(projected):
    _, projection = projected
    p = [projection.phases[name] for name in SEGMENTS]
    assert [(first, end) for first, end, _ in projection.decode_segments()] == [(1, 9), (9, 17), (17, 25), (25, None)]
    whole = sum(s.setup_seconds + 8 * s.seconds for s in p)  # 32 steps: all four segments
    assert projection.decode_seconds(NEW) == pytest.approx(whole, rel=1e-12)
    # 11 steps: the first segment's 8 and 3 of the second; the host calls no later segment
    assert projection.decode_seconds(12) == pytest.approx(p[0].setup_seconds + 8 * p[0].seconds
                                                          + p[1].setup_seconds + 3 * p[1].seconds, rel=1e-12)
    others = projection.step_seconds(NEW) - projection.decode_seconds(NEW)
    assert projection.step_seconds(12) - projection.decode_seconds(12) == pytest.approx(others, rel=1e-12)
    report = json.loads(projection_json(projection, [NEW, 12]))["projection"]
    assert [s["first_step"] for s in report["decode_segments"]] == [1, 9, 17, 25]
    assert report["steps"][1]["decode_seconds"] == pytest.approx(projection.decode_seconds(12))
    assert "(11 decode steps in 2 of 4 segments" in "\n".join(projection_lines(projection, [NEW, 12]))
