"""Pre-flight validation: every problem is a MeshError that says what, the value, and the fix."""

import pytest

from grpo_core.config import MeshConfig
from grpo_meshes import MeshError, ModelDims, build_mesh_from_config, validate_plan

TINY = ModelDims(num_attention_heads=4, num_key_value_heads=2, vocab_size=64, hidden_size=64,
                 intermediate_size=192)


def test_a_good_plan_passes():
    mesh = build_mesh_from_config(MeshConfig(strategy="1,-1,2")).mesh
    validate_plan(mesh, TINY, rollout_batch=16, train_micro_batch=8, rollout_style="legacy", device_count=8)
    validate_plan((2, 4, 1), TINY, rollout_batch=6, train_micro_batch=16, rollout_style="maxtext")


@pytest.mark.parametrize("shape, dims, kwargs, message", [
    ((2, 2, 1), None, {"device_count": 8},
     r"2,2,1 \(dp\*fsdp\*tp = 4\) does not match the 8 devices; the product must equal 8; try '2,-1,1'"),
    ((1, 1, 8), TINY, {},
     r"tp=8 does not divide num_attention_heads=4 \(split over tp\); use tp in \[1, 2\]"),
    ((1, 2, 4), TINY, {},
     r"tp=4 does not divide num_key_value_heads=2 \(split over tp\); use tp in \[1, 2\]"),
    ((1, 4, 2), ModelDims(4, 2, 63, 64, 192), {},
     r"tp=2 does not divide vocab_size=63 .*use tp in \[1\], or pad the vocabulary to a multiple of tp"),
    ((1, 4, 2), ModelDims(4, 2, 64, 64, 191), {},
     r"tp=2 does not divide intermediate_size=191"),
    ((1, 8, 1), ModelDims(4, 2, 64, 36, 192), {},
     r"fsdp=8 does not divide hidden_size=36 .*use fsdp in \[1, 2, 4\]"),
    ((2, 2, 2), None, {"rollout_batch": 12, "rollout_style": "legacy"},
     r"rollout batch of 12 rows is not divisible by dp\*fsdp\*tp = 8 \(rollout.sharding=legacy\); "
     r"use a multiple of 8, the nearest being 8 or 16"),
    ((4, 2, 1), None, {"rollout_batch": 6, "rollout_style": "maxtext"},
     r"rollout batch of 6 rows is not divisible by dp = 4 \(rollout.sharding=maxtext\).*nearest being 4 or 8"),
    ((2, 2, 2), None, {"train_micro_batch": 2},
     r"training micro-batch of 2 rows is not divisible by dp\*fsdp = 4 \(training\).*nearest being 4$"),
])
def test_each_problem_is_reported(shape, dims, kwargs, message):
    with pytest.raises(MeshError, match=message):
        validate_plan(shape, dims, **kwargs)


def test_all_problems_are_listed_together():
    with pytest.raises(MeshError) as caught:
        validate_plan((2, 1, 4), TINY, rollout_batch=4, train_micro_batch=3, device_count=8)
    lines = str(caught.value).splitlines()
    assert lines[0] == "mesh 2,1,4 (dp,fsdp,tp) cannot run this plan:"
    assert [line.split(" is ")[0].split(" does ")[0] for line in lines[1:]] == [
        "  - tp=4", "  - rollout batch of 4 rows", "  - training micro-batch of 3 rows"]


def test_legacy_and_maxtext_need_different_batch_multiples():
    validate_plan((2, 2, 2), rollout_batch=2, rollout_style="maxtext")
    with pytest.raises(MeshError, match="dp\\*fsdp\\*tp = 8"):
        validate_plan((2, 2, 2), rollout_batch=2, rollout_style="legacy")


def test_unresolved_shape_is_rejected():
    with pytest.raises(MeshError, match=r"must be three sizes >= 1 .* resolve -1 entries"):
        validate_plan((1, -1, 1))


def test_model_dims_from_configs():
    hf = {"num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "hidden_size": 896,
          "intermediate_size": 4864, "rope_theta": 1e6}
    assert ModelDims.from_config(hf) == ModelDims(14, 2, 151936, 896, 4864)
    with pytest.raises(MeshError, match=r"model config lacks \['vocab_size'\]"):
        ModelDims.from_config({k: v for k, v in hf.items() if k != "vocab_size"})


def test_model_dims_from_qwen_config():
    models = pytest.importorskip("grpo_core.models")
    cfg = models.QwenConfig(vocab_size=64, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
    assert ModelDims.from_config(cfg) == TINY
