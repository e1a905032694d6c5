"""Memory-efficient attention implementations against the dense XLA reference.

Tolerance: float32 throughout; the implementations differ from the reference only in
summation order (blockwise online softmax, f32 accumulators), which moves results by
a few ulps of the largest value: outputs and gradients agree to 1e-5 relative to the
reference's largest magnitude (observed ~1e-6). Only real (non-pad) query rows count:
a left-pad query sees no key and its output is never used.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.attention import attend, grouped_query_attention
from grpo_core.models.attention_impls import (
    CHUNK,
    CausalMask,
    chunked_attention,
    cudnn_attention,
    memory_efficient_attention,
    resolve_attention,
)

RTOL = 1e-5
PADS = (0, 41, 128)  # a full row, a ragged one, one padded past the first block


def _inputs(length, heads, kv_heads, head_dim, pads=PADS, seed=0):
    rng = np.random.default_rng(seed)
    b = len(pads)
    q, k, v, w = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (
        (b, length, heads, head_dim), (b, length, kv_heads, head_dim), (b, length, kv_heads, head_dim),
        (b, length, heads, head_dim)))
    real = jnp.asarray(np.arange(length)[None, :] >= np.array(pads)[:, None])
    return q, k, v, w * real[:, :, None, None], real


def _assert_close(got, want, real):
    rows = np.asarray(real)
    err = np.abs(np.asarray(got) - np.asarray(want))[rows].max()
    assert err <= RTOL * np.abs(np.asarray(want))[rows].max(), err


def _value_and_grads(attention, q, k, v, w):
    out = attention(q, k, v)
    grads = jax.grad(lambda *qkv: jnp.sum(attention(*qkv) * w), argnums=(0, 1, 2))(q, k, v)
    return out, grads


def _check_against_dense(attention, q, k, v, w, real, window=None):
    dense = functools.partial(grouped_query_attention, visible=CausalMask(real, window=window).dense(q.shape[1]))
    out, grads = _value_and_grads(jax.jit(attention), q, k, v, w)
    ref_out, ref_grads = _value_and_grads(jax.jit(dense), q, k, v, w)
    _assert_close(out, ref_out, real)
    for got, want in zip(grads, ref_grads):  # pad rows get zero cotangent, so all rows count
        _assert_close(got, want, jnp.ones(got.shape[:2], bool))


IMPLS = {
    "chunked": lambda real: lambda q, k, v: memory_efficient_attention(q, k, v, CausalMask(real, impl="chunked")),
    "splash": lambda real: lambda q, k, v: memory_efficient_attention(q, k, v, CausalMask(real, impl="splash")),
    # The cudnn path's padding handling, run by XLA's implementation (no GPU here).
    "cudnn_layout": lambda real: functools.partial(cudnn_attention, real=real, implementation="xla"),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1)])
def test_matches_dense_attention(impl, heads, kv_heads):
    q, k, v, w, real = _inputs(200, heads, kv_heads, 8)  # 200: not a multiple of any block
    _check_against_dense(IMPLS[impl](real), q, k, v, w, real)


def test_chunked_with_cache_offset_matches_dense():
    """The prompt pass: queries at slots offset.. over a longer cache of key slots."""
    q, _, _, _, _ = _inputs(140, 4, 2, 8)
    _, k, v, _, real = _inputs(300, 4, 2, 8, pads=(0, 20, 290), seed=1)
    for offset in (0, 7):
        mask = CausalMask(real, jnp.int32(offset))
        got = jax.jit(chunked_attention)(q, k, v, real, jnp.int32(offset))
        want = grouped_query_attention(q, k, v, mask.dense(140))
        query_real = np.asarray(mask.dense(140).any(-1))
        _assert_close(got, want, query_real)


# splash and cuDNN hand a sliding-window layer to chunked.
@pytest.mark.parametrize("impl", ["chunked", "splash"])
def test_sliding_window_matches_dense_attention(impl):
    """A 50-slot window over 200 tokens (blocks of 128): outputs and gradients of the banded mask."""
    q, k, v, w, real = _inputs(200, 4, 2, 8)
    window = jnp.int32(50)
    windowed = lambda q, k, v: memory_efficient_attention(q, k, v, CausalMask(real, impl=impl, window=window))  # noqa: E731
    _check_against_dense(windowed, q, k, v, w, real, window)


def test_chunked_sliding_window_with_cache_offset_matches_dense():
    q, _, _, _, _ = _inputs(140, 4, 2, 8)
    _, k, v, _, real = _inputs(300, 4, 2, 8, pads=(0, 20, 290), seed=1)
    mask = CausalMask(real, jnp.int32(7), window=jnp.int32(30))
    got = jax.jit(chunked_attention)(q, k, v, real, jnp.int32(7), jnp.int32(30))
    dense = mask.dense(140)
    assert not bool(jnp.all(dense == CausalMask(real, jnp.int32(7)).dense(140)))  # the window hides keys
    _assert_close(got, grouped_query_attention(q, k, v, dense), np.asarray(dense.any(-1)))


FAMILIES = {
    "qwen2": QwenConfig.tiny("qwen2", num_hidden_layers=2),
    "qwen3": QwenConfig.tiny("qwen3", num_key_value_heads=1),
}


def _model_loss_and_grads(model, ids, mask):
    def loss(m):
        logits = m.logits(m(ids, attention_mask=mask))
        return jnp.sum(jnp.where(mask[..., None], jnp.square(logits), 0.0)) / mask.sum()

    return nnx.jit(nnx.value_and_grad(loss))(model)


@pytest.mark.parametrize("impl", ["chunked", "splash"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_loss_and_grads_match_xla(impl, family, randomize, left_padded):
    model = randomize(init_from_config(FAMILIES[family], remat="full"), seed=1)
    ids, mask = map(jnp.asarray, left_padded(model.config.vocab_size, 150, pads=(0, 37, 140)))
    ref_loss, ref_grads = _model_loss_and_grads(model, ids, mask)
    model.set_attention(impl)
    loss, grads = _model_loss_and_grads(model, ids, mask)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_array_less(np.abs(a - b), RTOL * np.abs(b).max() + 1e-30),
                 grads, ref_grads)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    hidden, cache = model(ids, attention_mask=mask, cache=model.init_cache(ids.shape[0], ids.shape[1] + 9))
    return model.logits(hidden), cache.k


def test_chunked_prefill_matches_xla_prefill(randomize, left_padded):
    model = randomize(init_from_config(FAMILIES["qwen3"]), seed=2)
    ids, mask = map(jnp.asarray, left_padded(model.config.vocab_size, 133, pads=(0, 5, 130)))
    want, want_k = _prefill(*nnx.split(model), ids, mask)
    model.set_attention("chunked")
    got, got_k = _prefill(*nnx.split(model), ids, mask)
    _assert_close(got, want, mask.astype(bool))
    real_slots = np.zeros(got_k.shape[1:3], bool)  # pad and empty slots stay invisible: never read
    real_slots[:, : mask.shape[1]] = np.asarray(mask.astype(bool))
    _assert_close(got_k[:, real_slots], want_k[:, real_slots], np.ones(got_k.shape[0], bool))


def test_resolve_attention():
    assert resolve_attention("auto", "float32", "cpu") == "chunked"
    assert resolve_attention("auto", "bfloat16", "tpu") == "splash"
    assert resolve_attention("auto", "bfloat16", "gpu") == "cudnn"
    assert resolve_attention("auto", "float32", "gpu") == "chunked"
    assert resolve_attention("xla", "float32", "tpu") == "xla"
    with pytest.raises(ValueError, match="attention='cudnn' needs a bfloat16 or float16 model, not float32"):
        resolve_attention("cudnn", "float32", "gpu")
    with pytest.raises(ValueError, match="attention='flash' is not supported; use one of auto, xla"):
        resolve_attention("flash", "float32")
    with pytest.raises(ValueError, match="resolved implementation"):
        init_from_config(FAMILIES["qwen2"]).set_attention("auto")


def test_splash_kernel_compiles_for_tpu(tpu_devices):
    """Forward and backward Pallas kernels lowered and compiled by the TPU compiler, the
    batch split over 4 chips by shard_map (FSDP-style activation rules)."""
    mesh = jax.sharding.Mesh(np.array(tpu_devices), ("fsdp",))
    rules = (("batch", "fsdp"), ("heads", None))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))

    def grads(q, k, v, real):
        mask = CausalMask(real, impl="splash", sharding=(mesh, rules))
        loss = lambda *qkv: jnp.sum(memory_efficient_attention(*qkv, mask).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    shapes = [((4, 320, 8, 128), jnp.bfloat16), ((4, 320, 2, 128), jnp.bfloat16),
              ((4, 320, 2, 128), jnp.bfloat16), ((4, 320), jnp.bool_)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    compiled = jax.jit(grads).lower(*args).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3  # forward, dq and dkv kernels


@pytest.mark.parametrize("length, chunked", [(17, False), (CHUNK, False), (CHUNK + 1, True)])
def test_chunked_runs_dense_when_the_keys_fit_one_chunk(length, chunked):
    """One chunk of the chunked path holds as many scores as dense attention over <= CHUNK
    keys; padding a short sequence to a whole chunk would only add work."""
    q = jnp.zeros((1, length, 4, 8))
    k = v = jnp.zeros((1, length, 2, 8))
    mask = CausalMask(jnp.ones((1, length), bool), impl="chunked")
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attend(q, k, v, mask))(q, k, v))
    assert ("custom_vjp_call" in jaxpr) == chunked
