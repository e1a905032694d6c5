"""Routing replay (Qwen3-MoE): a forward that reuses recorded experts, the gate weights taken from
the current router at those experts so its gradient still flows; `routing_of` reads a forward's
own routing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.moe import SparseMoE
from grpo_core.models.router_stats import router_statistics, routing_of

MOE = QwenConfig.tiny("qwen3_moe", vocab_size=64)
ROWS, WIDTH = 3, 10


def batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, MOE.vocab_size, (ROWS, WIDTH)), jnp.int32)
    mask = jnp.asarray(np.arange(WIDTH)[None] >= np.array([[0], [2], [5]]), jnp.int32)  # left padding
    return ids, mask


@functools.partial(jax.jit, static_argnums=0)
def logits_of(graphdef, params, ids, mask, routing):
    model = nnx.merge(graphdef, params)
    return model.logits(model(ids, attention_mask=mask, routing=routing))


def test_replaying_the_models_own_experts_gives_identical_logits():
    model = init_from_config(MOE, seed=0)
    ids, mask = batch()
    own = routing_of(model, ids, mask)
    assert own.shape == (ROWS, WIDTH, MOE.num_hidden_layers, MOE.num_experts_per_tok)
    graphdef, params = nnx.split(model)
    plain = logits_of(graphdef, params, ids, mask, None)
    partly = own.at[:, : WIDTH // 2].set(-1)  # tokens without a record route as usual
    for routing in (own, partly, jnp.full_like(own, -1)):
        np.testing.assert_array_equal(logits_of(graphdef, params, ids, mask, routing), plain)


def forced(own: jax.Array) -> jax.Array:
    """Every recorded expert moved to the next one: a routing no token chose."""
    return (own + 1) % MOE.num_experts


def test_forced_experts_change_the_logits_and_the_router_gets_their_gradient():
    model = init_from_config(MOE, seed=0)
    ids, mask = batch()
    routing = forced(routing_of(model, ids, mask))
    graphdef, params = nnx.split(model)
    probe = jax.random.normal(jax.random.key(1), (ROWS, WIDTH, MOE.vocab_size))

    def objective(p, routing):
        m = nnx.merge(graphdef, p)
        return jnp.sum(m.logits(m(ids, attention_mask=mask, routing=routing)) * probe * mask[..., None])

    plain = jax.jit(objective)(params, None)
    replayed, grads = jax.jit(jax.value_and_grad(objective))(params, routing)
    assert abs(float(replayed - plain)) > 1e-3 * abs(float(plain))
    router = grads["layers"]["mlp"]["gate"]["kernel"][...]
    assert float(jnp.max(jnp.abs(router))) > 1e-4  # kernels are normal(0.02): gradients O(1e-2)


def test_sparse_block_weights_forced_experts_by_the_renormalised_router_probabilities():
    rng = np.random.RandomState(0)
    moe = SparseMoE(8, 6, 4, 2, normalize=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    for variable in (moe.gate.kernel, moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
        variable[...] = jnp.asarray(rng.normal(0, 0.5, variable.shape), jnp.float32)
    x = jnp.asarray(rng.normal(0, 1, (5, 8)), jnp.float32)
    replay = jnp.asarray([[3, 0], [1, 2], [-1, -1], [2, 3], [0, 1]], jnp.int32)
    out, experts = moe.routed(x, replay)
    probs, own_weights, own = moe.route(x)
    np.testing.assert_array_equal(experts, jnp.where(replay >= 0, replay, own))
    at = np.take_along_axis(np.asarray(probs, np.float64), np.asarray(experts), axis=1)
    weights = np.where(np.asarray(replay) >= 0, at / at.sum(1, keepdims=True), np.asarray(own_weights))
    expected = np.einsum("nkh,nk->nh", np.asarray(moe.experts(x, experts), np.float64), weights)
    # f32 against the same terms in f64: O(1) outputs, rounding ~1e-7.
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def agreement_of(graphdef, params, ids, mask, routing):
    return router_statistics(nnx.merge(graphdef, params), ids, mask, routing).agreement


def test_router_statistics_agreement_counts_recorded_experts_the_router_also_chose():
    model = init_from_config(MOE, seed=0)
    ids, mask = batch()
    own = routing_of(model, ids, mask)
    graphdef, params = nnx.split(model)
    agreement = functools.partial(agreement_of, graphdef, params, ids, mask)
    assert float(agreement(own)) == 1.0
    assert float(agreement(own[..., ::-1])) == 1.0  # the same experts in other slots: the same set
    half = own.at[..., 1].set(forced(own)[..., 1])  # slot 1 now an expert the router may not have chosen
    recorded_half = jnp.where(jnp.arange(WIDTH)[None, :, None, None] < 6, half, -1)
    assert 0.5 <= float(agreement(recorded_half)) < 1.0
    assert float(agreement(jnp.full_like(own, -1))) == 1.0  # nothing recorded: replay changed nothing
    assert agreement(None) is None
