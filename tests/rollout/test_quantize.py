"""`rollout.quantize: int8 | fp8`: per-channel 8-bit projection kernels in the rollout (grpo_rollout.quantize)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.contracts import Policy
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_core.testing import assert_same_rollout
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams
from grpo_rollout.decode import prefill, prefill_shared
from grpo_core.models import lora
from grpo_rollout.quantize import FP8, FP8_MAX, QuantizedKernel, is_quantized, quantize_kernel, quantize_weights
from grpo_core.models.kv_quant import LARGEST, STORED, QuantizedKV

PROMPTS = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30, 4, 4, 9]]
STYLE = ("dp", "fsdp", "tp")  # the rollout batch split over every device


KERNEL = jax.random.normal(jax.random.key(0), (2, 8, 3, 4)) * jnp.arange(1, 13).reshape(3, 4)  # [L, in, N, D]


def test_int8_kernel_is_per_output_channel_and_within_half_a_step():
    kernel = KERNEL
    quantized = quantize_kernel(kernel, (1,))
    assert quantized.values.dtype == jnp.int8 and quantized.scale.shape == (2, 1, 3, 4)
    # Each output channel's largest |w| maps to +-127, and every weight is within half a step.
    np.testing.assert_array_equal(np.abs(np.asarray(quantized.values)).max(axis=1), 127)
    error = np.abs(np.asarray(quantized[...]) - np.asarray(kernel))
    assert (error <= np.asarray(quantized.scale) / 2 * (1 + 1e-6)).all()


def test_fp8_kernel_is_per_output_channel_and_within_e4m3_rounding():
    quantized = quantize_kernel(KERNEL, (1,), "fp8")
    assert quantized.values.dtype == FP8 and quantized.scale.shape == (2, 1, 3, 4)
    values = np.asarray(quantized.values).astype(np.float32)
    # Each output channel's largest |w| maps to e4m3's largest value, 448.
    np.testing.assert_array_equal(np.abs(values).max(axis=1), FP8_MAX)
    # e4m3 keeps 3 mantissa bits: above its smallest normal (2^-6) a value rounds within 2^-4 of
    # itself; below, within half its subnormal step 2^-9, both in units of the scale.
    scaled = np.asarray(KERNEL) / np.asarray(quantized.scale)
    bound = np.maximum(np.abs(scaled) * 2.0**-4, 2.0**-10) * (1 + 1e-6)
    assert (np.abs(values - scaled) <= bound).all()
    assert np.abs(values - scaled).max() > 0  # rounded, not passed through


def test_fp8_block_kernel_has_a_scale_per_128_by_128_block_and_contracts_block_by_block():
    """q_proj-like [L, H=256, heads=4, head_dim=64]: blocks of 128 of H by 2 heads (128 outputs); each
    block's largest |w| maps to 448, each weight within e4m3's rounding of its block-scaled value, and
    the projection (partial sums per input block, each scaled) equals x . the dequantized kernel."""
    kernel = jax.random.normal(jax.random.key(0), (2, 256, 4, 64)) * jnp.arange(1, 5)[:, None]
    quantized = quantize_kernel(kernel, (1,), "fp8_block")
    assert quantized.values.dtype == FP8 and quantized.scale.shape == (2, 2, 2, 1)
    blocks = np.asarray(quantized.values).astype(np.float32).reshape(2, 2, 128, 2, 128)
    np.testing.assert_array_equal(np.abs(blocks).max(axis=(2, 4)), FP8_MAX)
    scale = np.repeat(np.repeat(np.asarray(quantized.scale), 128, axis=1), 2, axis=2)
    scaled = np.asarray(kernel) / scale
    values = np.asarray(quantized.values).astype(np.float32)
    assert (np.abs(values - scaled) <= np.maximum(np.abs(scaled) * 2.0**-4, 2.0**-10) * (1 + 1e-6)).all()
    layer = QuantizedKernel(quantized.values[0], quantized.scale[0], jnp.float32)
    x = jax.random.normal(jax.random.key(1), (3, 5, 256))
    expected = jnp.einsum("rth,hnd->rtnd", x, quantized[...][0])
    np.testing.assert_allclose(layer.contract(x, ((2,), (0,))), expected, rtol=1e-5, atol=1e-5 * 16)
    with pytest.raises(ValueError, match="^rollout.quantize=fp8_block: a kernel axis of 96 does not split"):
        quantize_kernel(jnp.ones((256, 96)), (0,), "fp8_block")


BLOCK_MODEL = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "head_dim": 64,
               "tie_word_embeddings": False}  # every projection has input blocks; the untied head 128 outputs


def test_fp8_block_sampler_logps_are_the_block_model_s_and_near_full_precision():
    model = init_from_config(QwenConfig.tiny("qwen2", **BLOCK_MODEL), seed=3)
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8, 16)))
    rollout.quantize_with("fp8_block")
    rollout.load_weights(Policy.of(model))
    batch = rollout.trim(rollout.generate(PROMPTS, jax.random.key(0), SamplingParams(max_new_tokens=12, n=2),
                                          pad_token_id=0))
    graphdef, weights = nnx.split(model)
    quantized = quantize_weights(graphdef, weights, "fp8_block")
    q_proj = nnx.to_flat_state(quantized)
    assert dict(q_proj)[("layers", "self_attn", "q_proj", "kernel")].get_value().scale.shape == (2, 2, 2, 1)
    mask = np.asarray(batch.completion_mask, bool)
    sampled = np.asarray(batch.sampler_logps)[mask]
    np.testing.assert_allclose(sampled, forward_logps(graphdef, quantized, batch)[mask], atol=1e-5)
    full = forward_logps(graphdef, weights, batch)[mask]
    gap = np.abs(sampled - full)
    channel = np.abs(forward_logps(graphdef, quantize_weights(graphdef, weights, "fp8"), batch)[mask] - full)
    print(f"fp8_block vs full-precision per-token log-prob gap: mean {gap.mean():.2e}, max {gap.max():.2e} "
          f"(per-channel fp8 on the same tokens: mean {channel.mean():.2e}, max {channel.max():.2e})")
    # e4m3 keeps 3 mantissa bits at any scale: a block's coarser scale costs little (random weights, no outliers).
    assert 1e-5 < gap.mean() < 1.5 * channel.mean() and gap.max() < 1.5 * channel.max()


def test_fp8_block_split_layouts_split_whole_blocks_and_refuse_the_rest(mesh):
    """Head-parallel over 8 devices (4 row groups x 2 KV head groups): with 1024 MLP columns (8 blocks
    of 128) every split axis keeps whole blocks per device and the decode samples the gathered one's
    tokens; with 384 columns (3 blocks over 8 devices) the layout is refused in one line."""
    results = []
    for intermediate in (1024, 384):
        cfg = QwenConfig.tiny("qwen2", **{**BLOCK_MODEL, "intermediate_size": intermediate})
        sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
        for gather in ("head_parallel", True):
            rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(16,), gather_weights=gather))
            rollout.quantize_with("fp8_block")
            rollout.load_weights(Policy.of(sharded))
            sample = functools.partial(rollout.generate, PROMPTS + [[88, 1]], jax.random.key(5),
                                       SamplingParams(max_new_tokens=6, n=2, greedy=True),
                                       batch_sharding=NamedSharding(mesh, PartitionSpec(STYLE)))
            if intermediate == 1024:
                results.append(sample())
            elif gather == "head_parallel":
                with pytest.raises(ValueError, match=r"^rollout.quantize=fp8_block: an axis of 384 weights in 3 "
                                                     r"blocks does not split over 8 devices; use"):
                    sample()
    assert_same_rollout(*results)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])  # qwen2 untied: its LM head is quantized too
def model(request):
    return init_from_config(QwenConfig.tiny(request.param, tie_word_embeddings=request.param == "qwen3"), seed=3)


def forward_logps(graphdef, weights, batch):
    """log_softmax(logits) (T = 1) of every token given the tokens before it [N, T] (column 0: 0)."""
    model = nnx.merge(graphdef, weights)
    logp = jax.nn.log_softmax(model.logits(model(batch.input_ids, attention_mask=batch.attention_mask))[:, :-1], -1)
    return np.pad(np.asarray(jnp.take_along_axis(logp, batch.input_ids[:, 1:, None], axis=-1)[..., 0]), ((0, 0), (1, 0)))


# The largest per-token gap the 8-bit sampler may have to the full-precision forward: int8 moves each
# weight by at most 1/254 of its channel's largest, e4m3 by up to 1/16 of the weight itself (measured
# max: 1.8e-3 nats int8, 7.6e-3 fp8, on logits ~0.5 apart); each bound is about 3x the measured max.
GAP_BOUNDS = {"int8": 5e-3, "fp8": 2e-2}


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_8bit_sampler_logps_are_the_quantized_model_s_and_near_full_precision(model, mode):
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8, 16)))
    rollout.quantize_with(mode)
    rollout.load_weights(Policy.of(model))
    batch = rollout.trim(rollout.generate(PROMPTS, jax.random.key(0), SamplingParams(max_new_tokens=12, n=2),
                                          pad_token_id=0))
    graphdef, weights = nnx.split(model)
    quantized = quantize_weights(graphdef, weights, mode)
    assert is_quantized(quantized) and not is_quantized(weights)
    mask = np.asarray(batch.completion_mask, bool)
    sampled = np.asarray(batch.sampler_logps)[mask]
    # The sampler samples from the 8-bit model: its log-probs are that model's (f32 sums, as in test_generate).
    np.testing.assert_allclose(sampled, forward_logps(graphdef, quantized, batch)[mask], atol=1e-5)
    gap = np.abs(sampled - forward_logps(graphdef, weights, batch)[mask])
    print(f"{mode} vs full-precision per-token log-prob gap: mean {gap.mean():.2e}, max {gap.max():.2e}")
    assert 1e-5 < gap.mean() and gap.max() < GAP_BOUNDS[mode]  # above 1e-5: the decode read 8-bit kernels


SPLIT_CASES = [("model_parallel", "int8", "int8"), ("head_parallel", "int8", "int8"), ("head_parallel", "fp8", "fp8")]


@pytest.mark.parametrize("layout, weights, cache", SPLIT_CASES, ids=["-".join(case) for case in SPLIT_CASES])
def test_split_layouts_on_8bit_weights_and_cache_sample_the_gathered_decodes_tokens(mesh, layout, weights, cache):
    """The split layouts split a kernel's 8-bit values as the kernel and its scales along the output axes
    only (a split input axis leaves partial sums that the scale multiplies alike): 8 query heads and
    2 KV heads over 8 devices, the batch over all of them, greedy and sampled, as the gathered decode."""
    from grpo_rollout import head_parallel, model_parallel

    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    quantized = quantize_weights(*nnx.split(sharded), weights)
    if layout == "model_parallel":
        specs = model_parallel.weight_shardings(quantized, mesh, STYLE)
    else:
        specs = head_parallel.HeadParallel(head_parallel.grid_mesh(mesh, 2)).weight_shardings(quantized)
    o_proj = specs["layers"]["self_attn"]["o_proj"]["kernel"].get_value()  # [L, heads, head_dim, H]: input split
    assert o_proj.values.spec[1] is not None and o_proj.scale.spec == PartitionSpec(None, None, None, None)
    q_proj = specs["layers"]["self_attn"]["q_proj"]["kernel"].get_value()  # [L, H, heads, head_dim]: output split
    assert q_proj.scale.spec[2] == q_proj.values.spec[2] is not None
    results = []
    for gather in (layout, True):
        rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(16,), gather_weights=gather))
        rollout.quantize_with(weights)
        rollout.kv_cache_with(cache)
        rollout.load_weights(Policy.of(sharded))
        results.append([rollout.generate(PROMPTS + [[88, 1]], jax.random.key(5), params,
                                         batch_sharding=NamedSharding(mesh, PartitionSpec(STYLE)))
                        for params in (SamplingParams(max_new_tokens=8, n=2, temperature=0.9),
                                       SamplingParams(max_new_tokens=8, n=2, greedy=True))])
    for split, gathered in zip(*results):
        assert_same_rollout(split, gathered)


def test_none_leaves_the_weights_as_they_are(model):
    graphdef, weights = nnx.split(model)
    assert quantize_weights(graphdef, weights, "none") is weights


def test_config_load_takes_8bit_weights_in_every_decode_layout(tiny_config):
    for layout in ("auto", "true", "model_parallel", "head_parallel"):
        config = tiny_config("rollout.quantize=int8", f"rollout.options.gather_weights={layout}")
        assert config.rollout.quantize == "int8"


def test_per_token_lora_keeps_its_adapters_in_full_precision_over_int8_kernels():
    """The rollout without a merged copy applies the adapters per token: only the base kernels are quantized."""
    model = init_from_config(QwenConfig.tiny("qwen2"), seed=3)
    lora.add_adapters(model, lora.LoRASpec(2, 4.0, tuple(lora.TARGET_PATHS)), jax.random.key(1))
    graphdef, weights = nnx.split(model)
    flat, quantized = dict(nnx.to_flat_state(weights)), dict(nnx.to_flat_state(quantize_weights(graphdef, weights,
                                                                                                    "int8")))
    kernels = [path for path in flat if path[-1] == "kernel"]
    assert len(kernels) == 7 and all(isinstance(quantized[path].get_value(), QuantizedKernel) for path in kernels)
    adapters = [path for path in flat if "lora" in path]
    assert len(adapters) == 14 and all(quantized[path].get_value() is flat[path].get_value() for path in adapters)


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("weights, cache", [("int8", "auto"), ("none", "int8")], ids=["int8_weights", "int8_cache"])
def test_int8_on_fsdp_sharded_weights_samples_as_unsharded_in_both_layouts(mesh, gather, weights, cache):
    """Weights quantized on device from sharded kernels (a max over a split axis is exact), or the
    cache quantized as it is written, with the weights gathered or left sharded."""
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False)
    plain = init_from_config(cfg, seed=1)
    sharded = shard_model(nnx.clone(init_from_config(cfg, seed=1)), mesh, DEFAULT_RULES)
    params = SamplingParams(max_new_tokens=8, n=2, temperature=0.9)
    results = []
    for model, options, batch_sharding in ((plain, {}, None), (sharded, {"gather_weights": gather},
                                                               NamedSharding(mesh, PartitionSpec(("dp", "fsdp", "tp"))))):
        rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(16,), **options))
        rollout.quantize_with(weights)
        rollout.kv_cache_with(cache)
        rollout.load_weights(Policy.of(model))
        results.append(rollout.generate(PROMPTS + [[88, 1]], jax.random.key(7), params, batch_sharding=batch_sharding))
    np.testing.assert_array_equal(results[1].completion_ids, results[0].completion_ids)
    np.testing.assert_allclose(results[1].sampler_logps, results[0].sampler_logps, atol=1e-5)


# ---- rollout.kv_cache_dtype: int8 | fp8 (grpo_core.models.kv_quant) --------------------------------------------
def cache_logps(graphdef, weights, batch, mode: str):
    """`forward_logps` with every attention reading `mode`-rounded keys and values: the prompt and completion
    run in one pass through a `mode` cache (each token's keys and values quantized alone, as the decode does)."""
    model = nnx.merge(graphdef, weights)
    ids, mask = batch.input_ids, batch.attention_mask
    hidden, _ = model(ids, attention_mask=mask, cache=model.init_cache(*ids.shape, mode))
    logp = jax.nn.log_softmax(model.logits(hidden)[:, :-1], -1)
    return np.pad(np.asarray(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]), ((0, 0), (1, 0)))


def int8_cache_rollout(model, mode: str = "int8", **options) -> JaxRollout:
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8, 16), **options))
    rollout.kv_cache_with(mode)
    rollout.load_weights(Policy.of(model))
    return rollout


# A cached element moves by at most half a step, 1/254 of its head's largest (int8), or 2^-4 of itself (fp8
# e4m3's 3-bit mantissa): ~1e-4 and ~1e-3 nats here (f32). Above 1e-5 proves the decode read 8-bit keys and
# values; the upper bounds leave room for a larger spread of logits.
@pytest.mark.parametrize("mode, largest_gap", [("int8", 1e-2), ("fp8", 2e-2)])
def test_8bit_cache_sampler_logps_are_the_8bit_cache_model_s_and_near_full_precision(model, mode, largest_gap):
    rollout = int8_cache_rollout(model, mode)
    batch = rollout.trim(rollout.generate(PROMPTS, jax.random.key(0), SamplingParams(max_new_tokens=12, n=2),
                                          pad_token_id=0))
    graphdef, weights = nnx.split(model)
    mask = np.asarray(batch.completion_mask, bool)
    sampled = np.asarray(batch.sampler_logps)[mask]
    same = np.abs(sampled - cache_logps(graphdef, weights, batch, mode)[mask])
    gap = np.abs(sampled - forward_logps(graphdef, weights, batch)[mask])
    print(f"{mode} cache vs its forward: max {same.max():.2e}; vs full precision ({mask.sum()} tokens): "
          f"mean {gap.mean():.2e}, max {gap.max():.2e}")
    np.testing.assert_allclose(same, 0.0, atol=1e-5)
    assert 1e-5 < gap.mean() and gap.max() < largest_gap


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_8bit_cache_holds_8bit_values_and_a_scale_per_row_position_and_kv_head(model, mode):
    """After the prefill (plain, and the shared prompt's two parts), within half a step of the f32 cache
    (int8), or 2^-4 of each element plus half of e4m3's smallest step (fp8)."""
    cfg, graphdef, weights = model.config, *nnx.split(model)
    ids, mask = np.asarray([[0, 5, 17, 33], [9, 64, 3, 8]], np.int32), np.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)
    sampling = SamplingParams(max_new_tokens=3, n=2)
    full = JaxRollout(JaxRolloutOptions()).static_args(graphdef, weights, sampling, 0, None)
    static = int8_cache_rollout(model, mode).static_args(graphdef, weights, sampling, 0, None)
    reference, _ = prefill(weights, ids, mask, jax.random.key(0), **full)
    cache, _ = prefill(weights, ids, mask, jax.random.key(0), **static)
    shared, _ = prefill_shared(weights, ids, mask, jax.random.key(0), **static)
    layers, kv_heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    for part, rows, slots in ((cache, 2, 4 + 2), (shared.prompt, 2, 4), (shared.completion, 4, 2)):
        for stored in (part.k, part.v):
            assert isinstance(stored, QuantizedKV) and stored.values.dtype == STORED[mode]
            assert stored.values.shape == (layers, rows, slots, kv_heads, dim)
            assert stored.scale.dtype == jnp.float32 and stored.scale.shape == (layers, rows, slots, kv_heads, 1)
    for stored, exact in ((cache.k, reference.k), (cache.v, reference.v)):
        # The prompt's slots: each real token's head reaches the format's largest value (127, 448).
        written = np.asarray(stored.values[:, :, :4]).astype(np.float32)
        np.testing.assert_array_equal(np.abs(written).max(axis=-1)[:, np.asarray(mask, bool)], LARGEST[mode])
        # Layer 0's keys and values come from the same inputs in both caches (later layers read 8-bit ones).
        exact0, scale = np.asarray(exact[0, :, :4]), np.asarray(stored.scale[0, :, :4])
        error = np.abs(np.asarray(stored[0, :, :4]) - exact0)
        bound = scale / 2 if mode == "int8" else np.abs(exact0) * 2.0**-4 + scale * 2.0**-10
        assert (error <= bound * (1 + 1e-5) + 1e-7).all()


def test_int8_cache_greedy_tokens_agree_with_and_without_the_shared_prompt_and_on_the_model_s_decode():
    model = init_from_config(QwenConfig.tiny("qwen3"), seed=3)
    params = SamplingParams(max_new_tokens=10, n=2, greedy=True)
    results = [int8_cache_rollout(model, **options).generate(PROMPTS, jax.random.key(0), params, pad_token_id=0)
               for options in ({"shared_prompt": True}, {"shared_prompt": False}, {"decode_attention": "model"})]
    for other in results[1:]:
        np.testing.assert_array_equal(other.completion_ids, results[0].completion_ids)
        np.testing.assert_allclose(other.sampler_logps, results[0].sampler_logps, atol=1e-5)


def test_int8_cache_refuses_a_second_cache_dtype_and_unknown_dtypes():
    with pytest.raises(ValueError, match="^rollout.kv_cache_dtype=int8 with rollout.options.cache_dtype=float32: "):
        JaxRollout(JaxRolloutOptions(cache_dtype="float32")).kv_cache_with("int8")
    with pytest.raises(ValueError, match="^rollout.kv_cache_dtype='int4' is not supported"):
        JaxRollout().kv_cache_with("int4")


def test_config_load_takes_int8_cache_in_every_decode_layout_and_on_kept_caches(tiny_config):
    for options in ([], ["rollout.options.gather_weights=true"], ["rollout.options.shared_prompt=false"],
                    ["rollout.options.gather_weights=model_parallel"], ["rollout.options.gather_weights=head_parallel"],
                    ["rollout.options.decode_attention=model"], ["rollout.quantize=int8"],
                    ["rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"],
                    ["rollout.partial.enabled=true", "loss.mismatch_correction=truncate"]):
        assert tiny_config("rollout.kv_cache_dtype=int8", *options).rollout.kv_cache_dtype == "int8"


@pytest.mark.parametrize("mode", ["none", "int8"])
def test_planned_weights_keep_their_shardings(mesh, mode):
    """`--plan` compiles the rollout on `abstract_weights`: the FSDP-sharded weights as the run's
    `load_weights` makes them, never replicated (a gathered copy of an 8B model is 16 GB per chip)."""
    model = shard_model(init_from_config(QwenConfig.tiny("qwen2", tie_word_embeddings=False), seed=1), mesh,
                        DEFAULT_RULES)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            nnx.split(model)[1])
    rollout = JaxRollout(JaxRolloutOptions())
    rollout.quantize_with(mode)
    planned = rollout.abstract_weights(Policy(nnx.split(model)[0], abstract, model.config))
    real = quantize_weights(*nnx.split(model), mode)
    assert jax.tree.structure(planned) == jax.tree.structure(real)
    for plan_leaf, real_leaf in zip(jax.tree.leaves(planned), jax.tree.leaves(real)):
        assert (plan_leaf.shape, plan_leaf.dtype) == (real_leaf.shape, real_leaf.dtype)
        assert plan_leaf.sharding.is_equivalent_to(real_leaf.sharding, real_leaf.ndim), (plan_leaf, real_leaf.sharding)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(planned))
