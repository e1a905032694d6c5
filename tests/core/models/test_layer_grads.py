"""Layer gradients summed in the backward layer loop (grpo_core.models.layer_grads) equal
jax.grad of the scanned model, added to whatever the accumulator held.

Tolerances: f32 on CPU; the same math in the same order except that each layer's
backward is a separate vjp, ~1e-6 on O(1) values (as the remat test in test_model.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, init_from_config

FAMILIES = {
    "qwen2": QwenConfig.tiny("qwen2", tie_word_embeddings=False),
    "qwen3": QwenConfig.tiny("qwen3", tie_word_embeddings=True, rope_theta=1e6),
    "gemma3": QwenConfig.tiny("gemma3_text"),  # per-layer windows and RoPE tables inside the accumulating loop
}


def loss_of_hidden(model, hidden):
    return jnp.mean(jnp.square(model.logits(hidden)))


def reference(model, ids, mask):
    """(loss, layer grads, other grads) by jax.grad of the ordinary forward."""
    graphdef, params = nnx.split(model)

    def loss(p):
        m = nnx.merge(graphdef, p)
        return loss_of_hidden(m, m(ids, attention_mask=mask))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    layers, others = nnx.split_state(grads, nnx.PathContains("layers"), ...)
    return value, layers["layers"], others


def accumulated(model, ids, mask, seed_grads):
    """(loss, seed_grads + layer grads, other grads) through accumulating_forward."""
    graphdef, params = nnx.split(model)
    layers, others = nnx.split_state(params, nnx.PathContains("layers"), ...)

    def loss(other_params, layer_grads):
        m = nnx.merge(graphdef, nnx.merge_state(layers, other_params))
        hidden, layer_grads = m.accumulating_forward(ids, mask, layer_grads)
        return loss_of_hidden(m, hidden), layer_grads

    @jax.jit
    def run(other_params, layer_grads):
        (value, passed), vjp = jax.vjp(loss, other_params, layer_grads)
        other_grads, summed = vjp((jnp.ones_like(value), layer_grads))
        return value, passed, summed, other_grads

    value, passed, summed, other_grads = run(others, seed_grads)
    jax.tree.map(np.testing.assert_array_equal, passed, seed_grads)  # passed through unchanged
    return value, summed, other_grads


@pytest.mark.parametrize("attention", ["xla", "chunked"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_accumulated_layer_gradients_equal_jax_grad_plus_the_seed(family, attention, randomize, left_padded):
    model = randomize(init_from_config(FAMILIES[family], remat="full"), seed=3)
    model.set_attention(attention)
    ids, mask = map(jnp.asarray, left_padded(model.config.vocab_size, 11, pads=(0, 4, 7)))
    ref_loss, ref_layers, ref_others = reference(model, ids, mask)
    rng = np.random.default_rng(0)
    seed = jax.tree.map(lambda g: jnp.asarray(rng.normal(size=g.shape), jnp.float32), ref_layers)
    loss, summed, others = accumulated(model, ids, mask, seed)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, s, g: np.testing.assert_allclose(a - s, g, atol=1e-6, rtol=1e-5), summed, seed, ref_layers)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), others, ref_others)


def test_layers_cast_one_at_a_time_match_a_model_cast_whole(randomize, left_padded):
    """compute_dtype: the float32 layers cast per layer give the hidden states of the model
    with every parameter cast to bfloat16 up front (the same values in the same ops)."""
    model = randomize(init_from_config(FAMILIES["qwen3"], remat="full"), seed=4)
    ids, mask = map(jnp.asarray, left_padded(model.config.vocab_size, 9))
    graphdef, params = nnx.split(model)
    layers, others = nnx.split_state(params, nnx.PathContains("layers"), ...)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)  # noqa: E731
    zeros = jax.tree.map(jnp.zeros_like, layers["layers"])

    @jax.jit
    def both():
        per_layer = nnx.merge(graphdef, nnx.merge_state(layers, cast(others)))
        whole = nnx.merge(graphdef, cast(params))
        return per_layer.accumulating_forward(ids, mask, zeros, jnp.bfloat16)[0], whole(ids, attention_mask=mask)

    per_layer, whole = both()
    assert per_layer.dtype == whole.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(per_layer, np.float32), np.asarray(whole, np.float32))
