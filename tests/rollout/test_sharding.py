"""Rollout under an 8-device mesh (fake CPU devices from tests/conftest.py) equals the
unsharded rollout, for both batch sharding styles."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.contracts import Policy
from grpo_core.testing import assert_same_rollout, with_random_adapters
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams

PROMPTS = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30], [88, 1]]
PARAMS = SamplingParams(max_new_tokens=8, n=2, temperature=0.9, stop_token_ids=tuple(range(100, 108)))
ROLLOUT = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,)))
STYLES = {"legacy": ("dp", "fsdp", "tp"), "maxtext": "dp"}


def sample(model, prompts, key, batch_sharding=None):
    ROLLOUT.load_weights(Policy.of(model))
    return ROLLOUT.generate(prompts, key, PARAMS, batch_sharding=batch_sharding)


@pytest.fixture(scope="module")
def models(mesh):
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False)
    plain = init_from_config(cfg, seed=1)
    sharded = shard_model(nnx.clone(init_from_config(cfg, seed=1)), mesh, DEFAULT_RULES)
    return plain, sharded


@pytest.mark.parametrize("style", sorted(STYLES))
def test_sharded_rollout_equals_unsharded(models, mesh, style):
    plain, sharded = models
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES[style]))
    expected = sample(plain, PROMPTS, jax.random.key(7))
    result = sample(sharded, PROMPTS, jax.random.key(7), batch_sharding=batch_sharding)
    assert result.completion_ids.sharding.spec[0] == STYLES[style]
    np.testing.assert_array_equal(result.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(result.completion_mask, expected.completion_mask)
    np.testing.assert_allclose(result.sampler_logps, expected.sampler_logps, atol=1e-5)
    assert 0 < int(expected.finished.sum()) < 8


def test_a_batch_that_does_not_split_over_the_devices_is_a_clear_error(models, mesh):
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES["legacy"]))
    with pytest.raises(ValueError, match="multiple of 8"):
        sample(models[1], PROMPTS[:3], jax.random.key(0), batch_sharding=batch_sharding)


@pytest.mark.parametrize("free, gathered", [(None, False), (1, False), (1 << 40, True)])
def test_auto_gathers_sharded_weights_only_when_the_gathered_decode_fits(models, mesh, monkeypatch, capsys,
                                                                          free, gathered):
    """gather_weights=auto: with the devices' spare memory faked (the CPU backend reports
    none), the gathered decode is taken exactly when it fits, and samples the same tokens."""
    from grpo_rollout import gather

    monkeypatch.setattr(gather, "spare_device_bytes", lambda devices: free)
    plain, sharded = models
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES["legacy"]))
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights="auto"))
    rollout.load_weights(Policy.of(sharded))
    result = rollout.generate(PROMPTS, jax.random.key(7), PARAMS, batch_sharding=batch_sharding)
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"rollout: gather_weights=auto: {'gathered' if gathered else 'sharded'} weights")
    assert ("no memory limit" in line) == (free is None)
    expected = sample(plain, PROMPTS, jax.random.key(7))
    np.testing.assert_array_equal(result.completion_ids, expected.completion_ids)
    np.testing.assert_allclose(result.sampler_logps, expected.sampler_logps, atol=1e-5)
    rollout.generate(PROMPTS, jax.random.key(8), PARAMS, batch_sharding=batch_sharding)
    assert capsys.readouterr().out == ""  # decided once per batch shape


def test_gather_weights_accepts_auto_true_false_and_the_split_layouts_only():
    for value in ("auto", True, False, "model_parallel", "head_parallel", "expert_parallel"):
        assert JaxRolloutOptions(gather_weights=value).gather_weights == value
    with pytest.raises(ValueError, match="gather_weights='yes' must be true, false, auto, model_parallel, head_par"):
        JaxRolloutOptions(gather_weights="yes")
    for split in ("model_parallel", "head_parallel", "expert_parallel"):
        with pytest.raises(ValueError, match=f"gather_weights={split} .* set decode_attention=rollout"):
            JaxRolloutOptions(gather_weights=split, decode_attention="model")


def assert_same_samples(pairs, batch_sharding):
    """Two (rollout, model) pairs sample the same tokens, log-probs within 1e-5 (f32; only the order
    of the partial sums differs), greedy and sampled."""
    for params in (PARAMS, SamplingParams(max_new_tokens=8, n=2, greedy=True)):
        results = []
        for rollout, model in pairs:
            rollout.load_weights(Policy.of(model))
            results.append(rollout.generate(PROMPTS, jax.random.key(5), params, batch_sharding=batch_sharding))
        assert_same_rollout(*results)


def assert_samples_like_gathered(model, layout: str, batch_sharding, **options):
    """The `layout` decode samples the gathered decode's tokens (`assert_same_samples`)."""
    split = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights=layout, **options))
    gathered = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights=True, **options))
    assert_same_samples(((split, model), (gathered, model)), batch_sharding)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_model_parallel_decode_samples_the_gathered_decodes_tokens(mesh, style):
    """8 query heads, 2 KV heads, MLP and vocabulary split over the batch devices (the KV
    projections stay replicated: 2 heads do not split 8 ways); greedy and sampled."""
    from grpo_rollout import model_parallel

    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    specs = model_parallel.weight_shardings(nnx.state(sharded), mesh, STYLES[style])
    assert specs["layers"]["self_attn"]["q_proj"]["kernel"].get_value().spec[2] == STYLES[style]
    assert specs["layers"]["mlp"]["down_proj"]["kernel"].get_value().spec[1] == STYLES[style]
    assert_samples_like_gathered(sharded, "model_parallel", NamedSharding(mesh, PartitionSpec(STYLES[style])))


@pytest.mark.parametrize(("style", "shared_prompt"), [("legacy", True), ("maxtext", False)])
def test_head_parallel_decode_samples_the_gathered_decodes_tokens(mesh, style, shared_prompt):
    """2 KV heads over 8 devices: a grid of 4 row groups x 2 KV head groups, 8 rows of 4 prompts;
    the batch split over all 8 devices (legacy) or over 2 of them (maxtext)."""
    from grpo_rollout import head_parallel

    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    grid = head_parallel.grid_mesh(mesh, cfg.num_key_value_heads)
    assert dict(grid.shape) == {"slice": 1, "rows": 4, "kv": 2}
    specs = head_parallel.weight_specs(nnx.state(sharded), grid)
    assert specs["layers"]["self_attn"]["k_proj"]["kernel"].get_value() == PartitionSpec(None, None, "kv", None)
    assert specs["layers"]["mlp"]["down_proj"]["kernel"].get_value() == PartitionSpec(None, ("rows", "kv"), None)
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES[style]))
    assert_samples_like_gathered(sharded, "head_parallel", batch_sharding, shared_prompt=shared_prompt)


@pytest.mark.parametrize(("groups", "spec"), [(8, ("dp", "fsdp", "tp")), (4, ("dp", "fsdp")), (2, ("dp",)), (3, None)])
def test_prompts_split_over_the_leading_batch_axes_that_divide_them(mesh, groups, spec):
    """Per-prompt arrays beside a batch over (dp, fsdp, tp): over the longest leading run of those axes
    whose devices divide the prompts (across slices dp: each slice prefills its own), else replicated."""
    from grpo_rollout.decode import group_sharding

    sharding = group_sharding(NamedSharding(mesh, PartitionSpec(STYLES["legacy"])), groups)
    assert sharding.spec == (PartitionSpec(spec) if spec else PartitionSpec())


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_model_parallel_layout_across_slices_splits_the_weights_over_every_device_of_a_slice(mesh, style):
    """Two slices of 4 devices: the weights split 4 ways within each, over the devices the batch is
    split over (legacy: every axis) or, for a batch over dp alone (maxtext: each slice's rows copied
    over its devices), over those it is copied over."""
    from grpo_rollout import model_parallel

    layout = model_parallel.model_parallel_layout(mesh, STYLES[style], slices=2)
    rows, weights = {"legacy": (4, "model"), "maxtext": (1, "rest")}[style]  # a slice's devices splitting them
    assert dict(layout.mesh.shape) == {"slice": 2, "model": rows, "rest": 4 // rows}
    assert layout.row_axes == ("slice", "model") and layout.axes == weights
    assert [d.id for d in layout.mesh.devices[1].flat] == [4, 5, 6, 7]  # slice 1: the batch's second half
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    specs = model_parallel.weight_shardings(nnx.state(init_from_config(cfg, seed=3)), layout.mesh, layout.axes)
    assert specs["layers"]["self_attn"]["q_proj"]["kernel"].get_value().spec[2] == weights


@pytest.fixture
def two_slices(monkeypatch):
    """Devices 0-3 and 4-7 of the batch taken as two TPU slices (as the devices' slice_index
    would say), with the compiled decodes of one slice cleared before and after."""
    from grpo_rollout import slices

    jax.clear_caches()
    monkeypatch.setattr(slices, "decode_slices", lambda devices: 2)
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize(("layout", "style"), [("model_parallel", "legacy"), ("model_parallel", "maxtext"),
                                               ("head_parallel", "legacy"), (True, "legacy")])
def test_decodes_across_two_slices_sample_the_one_slice_decodes_tokens(mesh, layout, style, request):
    """Across slices the split layouts keep to each slice and the loop tests for its end every 16
    tokens: the same tokens, lengths and log-probs (within 1e-5) as the gathered decode on one slice,
    which stops when every row is done (here all of them, before the 16th token: half the vocabulary
    stops a row)."""
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES[style]))
    one_slice = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights=True))
    one_slice.load_weights(Policy.of(sharded))
    params = SamplingParams(max_new_tokens=24, n=2, temperature=0.9, stop_token_ids=tuple(range(64, 128)))
    expected = one_slice.generate(PROMPTS, jax.random.key(5), params, batch_sharding=batch_sharding)
    assert bool(expected.finished.all()) and int(expected.completion_mask.sum(axis=1).max()) < 15
    request.getfixturevalue("two_slices")
    from grpo_rollout.slices import batch_slices, end_test_every
    assert end_test_every(batch_slices(mesh, STYLES[style])) == 16
    across = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights=layout))
    across.load_weights(Policy.of(sharded))
    assert_same_rollout(across.generate(PROMPTS, jax.random.key(5), params, batch_sharding=batch_sharding), expected)


def test_head_parallel_decode_with_per_token_lora_on_qwen3(mesh):
    """Adapters on every projection (o_proj's and down_proj's a split with their kernels' inputs:
    partial sums like the kernels'), q/k norms of qwen3."""
    cfg = QwenConfig.tiny("qwen3", tie_word_embeddings=True)
    sharded = shard_model(with_random_adapters(init_from_config(cfg, seed=4)), mesh, DEFAULT_RULES)
    assert_samples_like_gathered(sharded, "head_parallel", NamedSharding(mesh, PartitionSpec(STYLES["legacy"])))


def test_head_parallel_refuses_a_batch_of_prompts_it_cannot_split(mesh):
    """2 prompts over 4 row groups: an explicit head_parallel says why; auto leaves it out."""
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights="head_parallel"))
    rollout.load_weights(Policy.of(sharded))
    params = SamplingParams(max_new_tokens=4, n=4, greedy=True)
    expected = r"head_parallel: 2 prompts \(8 rows\) do not split into 4 row groups .*: use a multiple of 4 prompts"
    with pytest.raises(UserError, match=expected):  # grpo-run prints it as one line, exit 2
        rollout.generate(PROMPTS[:2], jax.random.key(5), params,
                         batch_sharding=NamedSharding(mesh, PartitionSpec(STYLES["legacy"])))


def test_auto_with_a_projector_takes_the_fastest_layout_that_fits(mesh, monkeypatch, capsys):
    """On TPU the run projects each decode layout (grpo_runner_gsm8k.costs.roofline); here a fake
    projection ranks them, and a layout over the spare memory is never taken however fast."""
    from grpo_rollout import gather

    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES["legacy"]))
    calls = []

    def projector(compiled, steps):  # called for the layouts that fit, in gather.LAYOUTS order
        calls.append(compiled)
        return {1: 3.0, 2: 2.0, 3: 1.0, 4: 1.5}[len(calls)] * steps  # gathered slowest, model-parallel fastest

    expected = None
    for free, chosen in ((1 << 40, "model_parallel"), (1, "sharded")):
        calls.clear()
        monkeypatch.setattr(gather, "spare_device_bytes", lambda devices: free)
        rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights="auto"))
        rollout.project_decodes_with(projector)
        rollout.load_weights(Policy.of(sharded))
        result = rollout.generate(PROMPTS, jax.random.key(5), PARAMS, batch_sharding=batch_sharding)
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"rollout: gather_weights=auto: {chosen} weights, the fastest projected decode of 7 steps")
        assert len(calls) == (4 if chosen == "model_parallel" else 1)  # head-parallel projected too
        if expected is None:
            expected = result
        np.testing.assert_array_equal(result.completion_ids, expected.completion_ids)


def test_fastest_layout_skips_refused_and_oversized_layouts():
    from grpo_rollout.gather import fastest_layout

    programs = {"gathered": "g", "sharded": "s", "model_parallel": None}  # None: refused by the compiler
    seconds = {"g": 1.0, "s": 5.0}
    layout, compiled, note = fastest_layout(programs.get, lambda p: p != "g", seconds.get,
                                            ("gathered", "sharded", "model_parallel"), 9)
    assert (layout, compiled) == ("sharded", "s")
    assert note.endswith("(sharded 5.00 s; gathered, model_parallel refused or over the spare memory)")
    layout, _, _ = fastest_layout(programs.get, lambda p: True, seconds.get, ("gathered", "sharded"), 9)
    assert layout == "gathered"


def test_auto_ranks_the_expert_parallel_decode_for_a_mixture_of_experts_model_only():
    from grpo_rollout.gather import candidate_layouts

    split = ("model_parallel", "head_parallel")
    for model_type, extra in (("qwen2", ()), ("qwen3_moe", ("expert_parallel",))):
        weights = nnx.state(init_from_config(QwenConfig.tiny(model_type), seed=0))
        assert candidate_layouts({"attention": "rollout"}, weights) == ("gathered", "sharded", *split, *extra)
        assert candidate_layouts({"attention": "model"}, weights) == ("gathered", "sharded")


def test_head_parallel_decode_of_a_moe_model_samples_the_gathered_decodes_tokens(mesh):
    """Qwen3-MoE: the experts split by their MLP columns like a dense MLP's (the router replicated),
    each device's grouped matmuls give partial sums of every token's expert outputs."""
    cfg = QwenConfig.tiny("qwen3_moe", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    assert_samples_like_gathered(sharded, "head_parallel", NamedSharding(mesh, PartitionSpec(STYLES["legacy"])))


# The experts split over fsdp (expert parallelism): `expert` takes fsdp first, their hidden dim falls through.
EXPERT_PARALLEL_RULES = (("expert", "fsdp"), *((n, a) for n, a in DEFAULT_RULES if n != "expert"), ("expert", None),
                         ("embed", None))


@pytest.mark.parametrize("style", sorted(STYLES))
def test_expert_parallel_decode_samples_the_gathered_decodes_tokens(mesh, style):
    """8 experts whole on each of the batch's devices (8 of them: 1 each; maxtext's 2: 4 each),
    attention and vocabulary split as model-parallel, every device's experts run on the replicated
    tokens routed to them and the outputs all-reduced: the gathered decode's tokens."""
    from grpo_rollout import model_parallel

    cfg = QwenConfig.tiny("qwen3_moe", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64,
                          num_experts=8)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    specs = model_parallel.weight_shardings(nnx.state(sharded), mesh, STYLES[style], experts=True)["layers"]["mlp"]
    assert specs["experts"]["down_proj"].get_value().spec == PartitionSpec(None, STYLES[style], None, None)
    assert specs["gate"]["kernel"].get_value().spec == PartitionSpec(None, None, None)  # the router: replicated
    assert_samples_like_gathered(sharded, "expert_parallel", NamedSharding(mesh, PartitionSpec(STYLES[style])))


def test_expert_parallel_decode_refuses_a_dense_model_and_indivisible_experts(mesh):
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES["legacy"]))
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights="expert_parallel"))
    for cfg, reason in ((QwenConfig.tiny("qwen2"), "this model has none"),
                        (QwenConfig.tiny("qwen3_moe"), "4 experts do not split over 8 devices")):
        rollout.load_weights(Policy.of(shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)))
        with pytest.raises(UserError, match=f"gather_weights=expert_parallel.*{reason}.*set gather_weights to auto"):
            rollout.generate(PROMPTS, jax.random.key(5), PARAMS, batch_sharding=batch_sharding)


@pytest.mark.parametrize("layout", [False, True, "model_parallel", "head_parallel", "expert_parallel"])
def test_an_expert_parallel_moe_model_samples_the_replicated_experts_tokens(mesh, layout):
    """A Qwen3-MoE policy trained with its 8 experts split over fsdp: every decode layout re-shards
    (or reads) the weights in its own layout and runs the plain MoE path (the rollout's activation
    rules name no expert axis) or, expert_parallel, its own (the experts split over all 8 devices),
    sampling the tokens of the same model with replicated experts."""
    cfg = QwenConfig.tiny("qwen3_moe", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64,
                          num_experts=8)
    replicated = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    split = shard_model(init_from_config(cfg, seed=3), mesh, EXPERT_PARALLEL_RULES)
    assert split.layers.mlp.expert_parallel is not None
    assert split.layers.mlp.experts.gate_proj[...].sharding.spec == PartitionSpec(None, "fsdp", None, "tp")
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES["legacy"]))
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), gather_weights=layout))
    assert_same_samples(((rollout, split), (rollout, replicated)), batch_sharding)
