"""Forward-pass properties: padding, GQA, tied heads, remat, KV cache, dtypes.

Tolerances: f32 on CPU; two computations of the same math that differ only in
reduction order or in extra exactly-masked softmax terms agree to ~1e-6 on O(1) logits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, QwenModel, init_from_config
from grpo_core.models.attention import causal_visibility, grouped_query_attention

FAMILIES = {
    "qwen2_tied": QwenConfig.tiny("qwen2", tie_word_embeddings=True),
    "qwen2_untied": QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_key_value_heads=1),
    "qwen3": QwenConfig.tiny("qwen3", tie_word_embeddings=False, rope_theta=1e6),
    "gemma3": QwenConfig.tiny("gemma3_text"),  # a 4-slot window: rows of 9 and 11 tokens reach past it
}


@pytest.fixture(params=list(FAMILIES))
def model(request, randomize):
    return randomize(init_from_config(FAMILIES[request.param], seed=0), seed=1)


def test_padded_row_equals_unpadded_row(model, left_padded, logits_of):
    ids, mask = left_padded(model.config.vocab_size, 9, pads=(0, 3, 6))
    batch = logits_of(model, ids, mask)
    for row, pads in enumerate((0, 3, 6)):
        alone = logits_of(model, ids[row : row + 1, pads:])
        np.testing.assert_allclose(batch[row, pads:], alone[0], atol=1e-5, rtol=0)


def test_shapes_and_dtypes(model):
    ids = jnp.ones((2, 5), jnp.int32)
    hidden = nnx.jit(lambda m, x: m(x))(model, ids)
    assert hidden.shape == (2, 5, model.config.hidden_size) and hidden.dtype == jnp.float32
    assert model.lm_head_weight().shape == (model.config.hidden_size, model.config.vocab_size)
    assert model.logits(hidden).shape == (2, 5, model.config.vocab_size)


def test_tied_head_is_embedding_transposed(randomize):
    tied = init_from_config(FAMILIES["qwen2_tied"])
    assert tied.lm_head is None
    np.testing.assert_array_equal(tied.lm_head_weight(), tied.embed_tokens.embedding[...].T)
    untied = init_from_config(FAMILIES["qwen2_untied"])
    np.testing.assert_array_equal(untied.lm_head_weight(), untied.lm_head.kernel[...])
    assert not np.allclose(untied.lm_head_weight(), untied.embed_tokens.embedding[...].T)


def test_grouped_attention_equals_repeated_kv():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 5, 6, 8))  # 6 query heads
    k = jax.random.normal(kk, (2, 5, 2, 8))  # 2 kv heads -> groups of 3
    v = jax.random.normal(kv, (2, 5, 2, 8))
    visible = causal_visibility(jnp.array([[1] * 5, [0, 0, 1, 1, 1]]))
    k_rep, v_rep = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)  # HF repeat_kv order
    scores = jnp.einsum("btnd,bsnd->bnts", q, k_rep) / jnp.sqrt(8.0)
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    expected = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(scores, -1), v_rep)
    got = grouped_query_attention(q, k, v, visible)
    np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
    np.testing.assert_allclose(got[1, 2:], expected[1, 2:], atol=1e-6)  # real queries only


def _loss_and_grads(model, ids, mask):
    def loss(m):
        return jnp.mean(jnp.square(m.logits(m(ids, attention_mask=mask))))

    return nnx.jit(nnx.value_and_grad(loss))(model)


def test_remat_modes_same_outputs_and_grads(randomize, left_padded):
    model = randomize(init_from_config(FAMILIES["qwen3"]), seed=2)
    ids, mask = map(jnp.asarray, left_padded(model.config.vocab_size, 7))
    ref_loss, ref_grads = _loss_and_grads(model, ids, mask)
    for mode in ("dots", "full"):
        model.remat = mode
        loss, grads = _loss_and_grads(model, ids, mask)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, ref_grads)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("mode, per_layer", [("none", 0), ("dots", 1), ("full", 1)])
def test_remat_wraps_each_decoder_layer(mode, per_layer, scan_layers):
    model = init_from_config(FAMILIES["qwen2_tied"], remat=mode, scan_layers=scan_layers)  # 2 layers
    graphdef, state = nnx.split(model)
    jaxpr = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x).sum())(state, jnp.ones((1, 4), jnp.int32)))
    # Scanned: one remat inside the one scan body; unrolled: one per layer.
    assert jaxpr.count("remat2[") + jaxpr.count("checkpoint[") == per_layer * (1 if scan_layers else 2)
    assert jaxpr.count("scan[") == (1 if scan_layers else 0)


def test_unrolled_layers_match_the_scan():
    cfg = FAMILIES["qwen3"]
    ids = jnp.array([[3, 5, 7, 9, 11], [0, 0, 4, 6, 8]], jnp.int32)
    mask = (ids > 0).astype(jnp.int32)
    scanned = init_from_config(cfg, scan_layers=True)
    unrolled = init_from_config(cfg, scan_layers=False)
    # Same params and ops; XLA may fuse the scan body differently (f32 rounding only).
    np.testing.assert_allclose(scanned(ids, mask), unrolled(ids, mask), rtol=1e-6, atol=1e-6)
    cache_s, cache_u = scanned.init_cache(2, 8), unrolled.init_cache(2, 8)
    hidden_s, cache_s = scanned(ids, mask, cache=cache_s)
    hidden_u, cache_u = unrolled(ids, mask, cache=cache_u)
    np.testing.assert_allclose(hidden_s, hidden_u, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cache_s.k, cache_u.k, rtol=1e-6, atol=1e-6)


def test_bad_remat_mode():
    with pytest.raises(ValueError, match="remat='some'.*none, dots, full"):
        init_from_config(FAMILIES["qwen3"], remat="some")


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _cached_step(graphdef, state, ids, cache, mask):
    model = nnx.merge(graphdef, state)
    hidden, cache = model(ids, attention_mask=mask, cache=cache)
    return model.logits(hidden), cache


def test_kv_cache_prefill_and_decode_equal_full_forward(model, left_padded, logits_of):
    prompt, steps = 6, 5
    ids, mask = left_padded(model.config.vocab_size, prompt + steps, pads=(0, 2, 4))
    full = logits_of(model, ids, mask)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch=3, max_len=16)
    logits, cache = _cached_step(graphdef, state, jnp.asarray(ids[:, :prompt]), cache, jnp.asarray(mask[:, :prompt]))
    pieces = [np.asarray(logits)]
    for t in range(prompt, prompt + steps):
        logits, cache = _cached_step(
            graphdef, state, jnp.asarray(ids[:, t : t + 1]), cache, jnp.asarray(mask[:, t : t + 1])
        )
        pieces.append(np.asarray(logits))
    cached = np.concatenate(pieces, axis=1)
    real = mask.astype(bool)
    assert np.abs(cached - full)[real].max() <= 1e-5
    assert int(cache.index) == prompt + steps
    np.testing.assert_array_equal(cache.lengths(), mask.sum(1))


def test_kv_cache_finished_row_and_chunked_prefill(randomize, left_padded, logits_of):
    model = randomize(init_from_config(FAMILIES["qwen2_tied"]), seed=3)
    ids, mask = left_padded(model.config.vocab_size, 8, pads=(0, 3))
    full = logits_of(model, ids, mask)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 12)
    _, cache = _cached_step(graphdef, state, jnp.asarray(ids[:, :5]), cache, jnp.asarray(mask[:, :5]))
    logits, cache = _cached_step(graphdef, state, jnp.asarray(ids[:, 5:]), cache, jnp.asarray(mask[:, 5:]))
    np.testing.assert_allclose(logits, full[:, 5:], atol=1e-5, rtol=0)
    # A finished row (mask 0) writes an invisible slot and keeps its length.
    lengths = np.asarray(cache.lengths())
    _, cache = _cached_step(graphdef, state, jnp.ones((2, 1), jnp.int32), cache, jnp.array([[1], [0]]))
    np.testing.assert_array_equal(cache.lengths(), lengths + np.array([1, 0]))


def test_bfloat16_params_compute_in_bfloat16_close_to_f32(randomize, left_padded, logits_of):
    f32 = randomize(init_from_config(FAMILIES["qwen3"]), seed=4, std=0.1)
    bf16 = nnx.eval_shape(lambda: QwenModel(FAMILIES["qwen3"], dtype="bfloat16", rngs=nnx.Rngs(0)))
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
    ids, mask = left_padded(f32.config.vocab_size, 6)
    hidden = nnx.jit(lambda m, x, a: m(x, attention_mask=a))(bf16, jnp.asarray(ids), jnp.asarray(mask))
    assert hidden.dtype == jnp.bfloat16 and bf16.logits(hidden).dtype == jnp.float32
    real = mask.astype(bool)
    # bf16 has 8 mantissa bits: relative error ~1e-2 per op; loose sanity bound.
    diff = np.abs(logits_of(bf16, ids, mask) - logits_of(f32, ids, mask))[real].max()
    assert diff < 0.1
