"""Expert parallelism (grpo_core.models.moe_parallel) on 8 devices: the experts split over fsdp
give the replicated-expert path's loss, gradients, router statistics and routing replay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.moe_parallel import expert_parallel_from_rules
from grpo_core.models.router_stats import router_statistics, routing_of
from grpo_core.sharding import DEFAULT_RULES, shard_model
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P


# 8 experts: they split over fsdp = 2, 4 and 8. Vocab 128 and heads 4 / kv 2 divide tp = 2.
CFG = QwenConfig.tiny("qwen3_moe", vocab_size=128, num_experts=8, num_experts_per_tok=2)
# The experts' `expert` dim on fsdp first; their hidden dim (and the router's expert dim) fall through to None.
EP_RULES = (("expert", "fsdp"), *((n, a) for n, a in DEFAULT_RULES if n != "expert"), ("expert", None),
            ("embed", None))
# f32 on CPU: the split sums the k slots of a token over the devices (another order); ~1e-7 seen.
RTOL = 1e-5


def mesh_of(shape):
    return Mesh(np.asarray(jax.devices()).reshape(shape), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)


def randomized(model, std=0.2):
    """Every parameter redrawn ~ N(0, std) (norm scales around 1), so the router's choices vary."""
    rng = np.random.RandomState(1)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(1.0 if "scale" in str(path[-1]) else 0.0, std, x.shape), x.dtype),
        state))
    return model


def model_on(shape, expert_parallel: bool):
    model = randomized(init_from_config(CFG, seed=0))
    return shard_model(model, mesh_of(shape), EP_RULES if expert_parallel else DEFAULT_RULES)


def batch(rows=8, length=12):
    rng = np.random.default_rng(0)
    mask = (np.arange(length)[None] < rng.integers(length // 2, length + 1, rows)[:, None]).astype(np.int32)
    return jnp.asarray(rng.integers(0, CFG.vocab_size, (rows, length)), jnp.int32), jnp.asarray(mask)


def objective(model, ids, mask, routing):
    """A loss through the logits, plus the balance loss (the router statistics' own forward)."""
    logits = model.logits(model(ids, attention_mask=mask, routing=routing))
    probe = jnp.sin(jnp.arange(CFG.vocab_size, dtype=jnp.float32))
    stats = router_statistics(model, ids, mask, routing)
    return jnp.sum(logits * probe * mask[..., None]) / jnp.sum(mask) + stats.balance_loss, \
        (stats.load, stats.balance_loss, stats.agreement)


def loss_and_grads(model, ids, mask, routing=None):
    return nnx.jit(nnx.value_and_grad(objective, has_aux=True))(model, ids, mask, routing)


def assert_close(ours, theirs):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= RTOL * max(np.abs(b).max(), 1e-6), np.abs(a - b).max()


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_expert_parallel_loss_gradients_and_router_statistics_equal_the_replicated_experts(shape):
    ids, mask = batch()
    plain, split = model_on(shape, False), model_on(shape, True)
    assert plain.layers.mlp.expert_parallel is None and split.layers.mlp.expert_parallel.axis == "fsdp"
    (loss, stats), grads = loss_and_grads(plain, ids, mask)
    (ep_loss, ep_stats), ep_grads = loss_and_grads(split, ids, mask)
    assert_close(ep_loss, loss)
    assert_close(ep_stats, stats)  # load per layer and expert, balance loss
    assert_close(ep_grads, grads)
    assert np.abs(np.asarray(grads.layers.mlp.experts.down_proj[...])).max() > 0  # the experts do learn


def test_routing_replay_through_the_expert_parallel_layer():
    ids, mask = batch()
    plain, split = model_on((2, 4, 1), False), model_on((2, 4, 1), True)
    routing = routing_of(plain, ids, mask)
    routing = jnp.where(jnp.arange(ids.shape[1])[None, :, None, None] % 2 == 0, (routing + 1) % CFG.num_experts, -1)
    (loss, stats), grads = loss_and_grads(plain, ids, mask, routing)
    (ep_loss, ep_stats), ep_grads = loss_and_grads(split, ids, mask, routing)
    assert_close((ep_loss, ep_stats), (loss, stats))  # with the replay's agreement
    assert_close(ep_grads, grads)


def test_expert_weights_are_split_over_fsdp_on_their_expert_dimension():
    split = model_on((1, 4, 2), True)
    experts = split.layers.mlp.experts
    assert experts.gate_proj[...].sharding.spec == P(None, "fsdp", None, "tp")  # [L, E, H, I]
    assert experts.down_proj[...].sharding.spec == P(None, "fsdp", "tp", None)  # [L, E, I, H]
    assert split.layers.mlp.gate.kernel[...].sharding.spec == P(None, "fsdp", None)  # router [L, H, E]: embed
    plain = model_on((1, 4, 2), False).layers.mlp.experts
    assert plain.gate_proj[...].sharding.spec == P(None, None, "fsdp", "tp")


def test_tokens_that_do_not_split_over_the_devices_run_replicated():
    ids, mask = batch(rows=3, length=5)  # 15 tokens: no split over 8 devices
    plain, split = model_on((1, 8, 1), False), model_on((1, 8, 1), True)
    forward = nnx.jit(lambda m: m.logits(m(ids, attention_mask=mask)))
    assert_close(forward(split), forward(plain))


def test_expert_parallelism_only_where_the_axis_divides_the_experts():
    mesh = mesh_of((1, 8, 1))
    rules = (("batch", ("dp", "fsdp")), ("expert", "fsdp"), ("mlp", "tp"))
    assert expert_parallel_from_rules(mesh, rules, 8).tokens == ("dp", "fsdp")
    assert expert_parallel_from_rules(mesh, rules, 12) is None  # 12 experts over 8 devices
    assert expert_parallel_from_rules(mesh, DEFAULT_RULES, 8) is None  # experts replicated
    assert expert_parallel_from_rules(mesh_of((8, 1, 1)), rules, 8) is None  # one fsdp device
    assert expert_parallel_from_rules(None, rules, 8) is None
