"""LoRA adapters in the stacked projections: step 0 is the base, the unmerged forward equals
the merged weights W + scale * A . B, and the adapters' gradients agree across both forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models import lora

CFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
IDS = (jnp.arange(24).reshape(2, 12) * 7) % 64


def _with_adapters(targets=("all-linear",), rank=4, rslora=False):
    model = init_from_config(CFG, seed=0)
    base_graphdef, base = nnx.split(model)
    spec = lora.LoRASpec(rank, 8.0, lora.resolve_targets(targets), rslora)
    lora.add_adapters(model, spec, jax.random.key(1))
    return model, base_graphdef, base, spec


def _randomized(adapters, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), adapters)


def test_b_is_zero_so_step_zero_is_the_base_bitwise():
    model, base_graphdef, base, _ = _with_adapters()
    assert np.array_equal(model(IDS), nnx.merge(base_graphdef, base)(IDS))


@pytest.mark.parametrize("targets,rslora", [(("all-linear",), False), (("q_proj", "o_proj", "down_proj"), True)])
def test_unmerged_forward_equals_merged_weights(targets, rslora):
    model, base_graphdef, base, spec = _with_adapters(targets, rslora=rslora)
    graphdef, state = nnx.split(model)
    adapters, rest = lora.split_adapters(state)
    adapters = _randomized(adapters)
    unmerged = nnx.merge(graphdef, nnx.merge_state(rest, adapters))(IDS)
    merged = nnx.merge(base_graphdef, lora.merged_state(base, adapters, spec))(IDS)
    assert float(jnp.abs(unmerged - nnx.merge(base_graphdef, base)(IDS)).max()) > 0.1  # the adapters matter
    np.testing.assert_allclose(unmerged, merged, rtol=1e-5, atol=1e-5)


def test_merge_is_w_plus_scaled_a_times_b_per_layer():
    """Independent numpy reference of one merged kernel (o_proj: [L, N, D, H], two input axes)."""
    _, _, base, spec = _with_adapters(("o_proj",), rslora=True)
    model, _, _, _ = _with_adapters(("o_proj",), rslora=True)
    adapters = _randomized(lora.split_adapters(nnx.state(model))[0])
    merged = dict(nnx.to_flat_state(lora.merged_state(base, adapters, spec)))
    a, b = lora.adapter_arrays(adapters, spec)["o_proj"]
    w = np.asarray(dict(nnx.to_flat_state(base))[("layers", "self_attn", "o_proj", "kernel")].get_value())
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    expected = w + 8.0 / np.sqrt(4) * np.einsum("lndr,lrh->lndh", a, b)
    got = merged[("layers", "self_attn", "o_proj", "kernel")].get_value()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_adapter_gradients_of_both_forms_agree():
    model, base_graphdef, base, spec = _with_adapters()
    graphdef, state = nnx.split(model)
    adapters, rest = lora.split_adapters(state)
    adapters = _randomized(adapters)

    def unmerged(ad):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, nnx.merge_state(rest, ad))(IDS)))

    def merged(ad):
        return jnp.sum(jnp.sin(nnx.merge(base_graphdef, lora.merged_state(base, ad, spec))(IDS)))

    # float32 sums in another order: agreement to ~1e-5 of each gradient's largest entry
    for g1, g2 in zip(jax.tree.leaves(jax.grad(unmerged)(adapters)), jax.tree.leaves(jax.grad(merged)(adapters))):
        assert float(jnp.abs(g1 - g2).max()) <= 2e-5 * float(jnp.abs(g2).max())


def test_adapters_are_stacked_with_logical_axes_of_their_kernel():
    model, _, _, _ = _with_adapters(("q_proj", "down_proj"))
    q, down = model.layers.self_attn.q_proj.lora, model.layers.mlp.down_proj.lora
    assert q.a.shape == (2, 32, 4) and q.b.shape == (2, 4, 4, 8)
    assert q.a.get_metadata()["out_sharding"] == ("layers", "embed", None)
    assert q.b.get_metadata()["out_sharding"] == ("layers", None, "heads", "head_dim")
    assert down.a.get_metadata()["out_sharding"] == ("layers", "mlp", None) and down.a.dtype == jnp.float32
    assert getattr(model.layers.self_attn.k_proj, "lora", None) is None


def test_unknown_target_and_rank_above_dims_are_refused():
    with pytest.raises(ValueError, match="unknown LoRA target module 'qproj'"):
        lora.resolve_targets(["qproj"])
    spec = lora.LoRASpec(33, 1.0, ("q_proj",))
    with pytest.raises(ValueError, match=r"rank 33 is larger than q_proj's dims \(32 in, 32 out\)"):
        lora.check_rank_fits(spec, lora.layer_shapes(CFG))
